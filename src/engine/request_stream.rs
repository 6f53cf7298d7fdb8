//! `RequestStream`: one request's outputs as its caller reads them. The scheduler sends
//! tokens; the stream turns them into text (detokenized incrementally, per completion)
//! and ends a completion at a stop string, telling the scheduler to stop it.

use std::collections::VecDeque;

use ractor::ActorRef;
use tokio::sync::{OwnedSemaphorePermit, mpsc};

use crate::actors::scheduler::SchedulerMsg;
use crate::api::{ChoiceText, FinishReason, RequestOutput, choice_seed};
use crate::model::tokenizer::Tokenizer;
use crate::sync::Shared;

/// The outputs of one request, in order; dropping it before the end aborts the request.
pub struct RequestStream {
    pub request_id: u64,
    seed: u64,
    rx: mpsc::UnboundedReceiver<RequestOutput>,
    scheduler: ActorRef<SchedulerMsg>,
    tokenizer: Option<Shared<Tokenizer>>,
    choices: Vec<ChoiceState>,
    num_finished_choices: usize,
    /// Outputs made here (a completion's end at a stop string), sent before the next.
    ready: VecDeque<RequestOutput>,
    _permit: OwnedSemaphorePermit,
}

struct ChoiceState {
    text: ChoiceText,
    /// Its final output has been handed out: whatever the scheduler still sends for it
    /// (tokens drawn before the stop reached it, its own final) is dropped.
    done: bool,
}

impl RequestStream {
    pub(super) fn new(
        request_id: u64,
        seed: u64,
        rx: mpsc::UnboundedReceiver<RequestOutput>,
        scheduler: ActorRef<SchedulerMsg>,
        tokenizer: Option<Shared<Tokenizer>>,
        choices: Vec<ChoiceText>,
        permit: OwnedSemaphorePermit,
    ) -> Self {
        RequestStream {
            request_id,
            seed,
            rx,
            scheduler,
            tokenizer,
            choices: choices
                .into_iter()
                .map(|text| ChoiceState { text, done: false })
                .collect(),
            num_finished_choices: 0,
            ready: VecDeque::new(),
            _permit: permit,
        }
    }

    /// The next output; `None` after the final one.
    pub async fn next(&mut self) -> Option<RequestOutput> {
        loop {
            if let Some(out) = self.ready.pop_front() {
                return Some(out);
            }
            if self.is_finished() {
                return None;
            }
            let Some(out) = self.rx.recv().await else {
                // The engine went away with completions unfinished: each ends with an
                // error, never as if it had finished.
                for (index, choice) in self.choices.iter_mut().enumerate() {
                    if !choice.done {
                        choice.done = true;
                        self.ready.push_back(RequestOutput {
                            request_id: self.request_id,
                            index,
                            error: Some("the engine stopped before the request finished".into()),
                            ..Default::default()
                        });
                    }
                }
                self.num_finished_choices = self.choices.len();
                continue;
            };
            if let Some(out) = self.take(out) {
                return Some(out);
            }
        }
    }

    /// `out` with its text; `None` when it belongs to a completion already ended here.
    fn take(&mut self, mut out: RequestOutput) -> Option<RequestOutput> {
        let index = out.index;
        let Some(choice) = self.choices.get_mut(index) else {
            return Some(out);
        };
        if choice.done {
            return None;
        }
        let is_final = out.is_final();
        if out.error.is_none() {
            let tok = self.tokenizer.as_deref();
            let (text, stopped) = choice.text.push(tok, &out.token_ids, is_final);
            out.text = text;
            out.stop_string = choice.text.matched().map(str::to_string);
            if stopped && !is_final {
                // A stop string ended the text: the completion ends here, with its own
                // final output, and the scheduler stops drawing for it.
                self.ready.push_back(RequestOutput {
                    request_id: self.request_id,
                    index,
                    finish_reason: Some(FinishReason::Stop),
                    stop_string: out.stop_string.take(),
                    seed: Some(choice_seed(self.seed, index)),
                    ..Default::default()
                });
                choice.done = true;
                self.num_finished_choices += 1;
                let _ = self.scheduler.cast(SchedulerMsg::StopChoice {
                    request_id: self.request_id,
                    index,
                });
                return Some(out);
            }
        }
        if is_final {
            choice.done = true;
            self.num_finished_choices += 1;
        }
        Some(out)
    }

    fn is_finished(&self) -> bool {
        self.num_finished_choices >= self.choices.len()
    }

    /// Collects the whole output (of the first completion when `n > 1`).
    pub async fn collect(self) -> RequestOutput {
        self.collect_choices().await.swap_remove(0)
    }

    /// Collects every completion, by index: tokens, text, the finish reason or the error.
    pub async fn collect_choices(mut self) -> Vec<RequestOutput> {
        let mut all: Vec<RequestOutput> = (0..self.choices.len())
            .map(|index| RequestOutput {
                request_id: self.request_id,
                index,
                ..Default::default()
            })
            .collect();
        while let Some(o) = self.next().await {
            let Some(c) = all.get_mut(o.index) else {
                continue;
            };
            c.token_ids.extend(o.token_ids);
            c.text.push_str(&o.text);
            c.token_logprobs.extend(o.token_logprobs);
            c.top_logprobs.extend(o.top_logprobs);
            c.prompt_logprobs = o.prompt_logprobs.or(c.prompt_logprobs.take());
            c.seed = o.seed.or(c.seed);
            c.finish_reason = o.finish_reason.or(c.finish_reason);
            c.stop_string = o.stop_string.or(c.stop_string.take());
            c.error = o.error.or(c.error.take());
        }
        for c in &mut all {
            if c.finish_reason.is_none() && c.error.is_none() {
                c.error = Some("the engine stopped before the request finished".into());
            }
        }
        all
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.is_finished() {
            let _ = self.scheduler.cast(SchedulerMsg::Abort {
                request_id: self.request_id,
            });
        }
    }
}
