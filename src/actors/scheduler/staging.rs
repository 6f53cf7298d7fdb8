//! Admitting a submission: where the prefix store may hold prompt blocks the device does
//! not, they are read on a blocking thread while the engine runs other steps, and the
//! submission comes back as `SchedulerMsg::Staged` with them.

use ractor::{ActorRef, RpcReplyPort};
use tokio::sync::mpsc::UnboundedSender;

use super::super::rank_worker::RankMsg;
use super::{Request, SchedulerMsg, SchedulerState, seq_id_of};
use crate::api::{EngineError, EngineRequest, RequestError, RequestOutput, choice_seed};
use crate::sched::{SeqRequest, StoredPrefix};
use crate::step::with_virtual_ids;
use crate::structured::{CompiledGrammar, SeqConstraint};
use crate::sync::Shared;

/// A request as `SchedulerMsg::Submit` brings it.
pub struct Submission {
    pub(super) request_id: u64,
    pub(super) request: Box<EngineRequest>,
    /// `request.grammar`, compiled.
    pub(super) grammar: Option<Shared<CompiledGrammar>>,
    pub(super) stream: UnboundedSender<RequestOutput>,
    pub(super) reply: RpcReplyPort<Result<(), EngineError>>,
    pub(super) span: tracing::Span,
}

impl SchedulerState {
    /// Hands `sub` back when it is to be admitted now; else stages its prompt's blocks
    /// past the device's prefix hits from the store and sends it back as `Staged`.
    pub(super) fn stage(
        &mut self,
        sub: Submission,
        myself: &ActorRef<SchedulerMsg>,
    ) -> Option<Submission> {
        let Some(store) = self.kv_store.clone() else {
            return Some(sub);
        };
        // A scored prompt computes every position: nothing to read.
        if sub.request.prompt_logprobs.is_some() {
            return Some(sub);
        }
        // Blocks are named as the core names them: an image's placeholders by its content.
        let tokens = with_virtual_ids(&sub.request.prompt_ids, &sub.request.images);
        let first_block = self.core.num_device_prefix_blocks(&tokens, 0);
        if self.failed.is_some() || !store.may_have(&tokens, 0, first_block) {
            return Some(sub);
        }
        let myself = myself.clone();
        self.num_staging += 1;
        tokio::task::spawn_blocking(move || {
            let stored = store.stage(&tokens, 0, first_block);
            let submission = Box::new(sub);
            // A stopped scheduler answers nobody; the caller's call times out.
            let _ = myself.cast(SchedulerMsg::Staged { submission, stored });
        });
        None
    }

    /// Blocks the core registered since the last step, to every rank: ahead of any step
    /// that could reuse them.
    pub(super) fn send_kv_saves(&mut self) {
        let saves = self.core.take_kv_saves();
        if saves.is_empty() {
            return;
        }
        for worker in &self.workers {
            let _ = worker.cast(RankMsg::SaveKv(saves.clone()));
        }
    }

    /// Answers `reply` once every block registered so far is in the store: the saves go
    /// out now and the first rank (a store has one) answers after copying them.
    pub(super) fn flush_kv_saves(&mut self, reply: RpcReplyPort<()>) {
        self.send_kv_saves();
        match (&self.kv_store, self.workers.first()) {
            (Some(_), Some(worker)) => {
                let _ = worker.cast(RankMsg::KvSaved(reply));
            }
            _ => {
                let _ = reply.send(());
            }
        }
    }

    /// Admits `sub` to the core with the blocks the store holds for it.
    pub(super) fn submit(&mut self, sub: Submission, stored: StoredPrefix) {
        if let Some(reason) = &self.failed {
            let _ = sub
                .reply
                .send(Err(EngineError::Unavailable(reason.clone())));
            return;
        }
        let mut choices = self.choices(&sub);
        let (first_seq, mut first) = choices.remove(0);
        first.pending_forks = choices;
        let seq_id = first_seq.seq_id;
        match self.core.add_with_stored(first_seq, stored) {
            Ok(()) => {
                self.requests.insert(seq_id, first);
                let _ = sub.reply.send(Ok(()));
                self.kick();
            }
            Err(e) => {
                let _ = sub
                    .reply
                    .send(Err(RequestError::Unservable(e.to_string()).into()));
            }
        }
    }

    /// The request's `n` completions, each as the core's sequence and the actor's record
    /// (the first is admitted; the others fork from its prompt blocks).
    fn choices(&self, sub: &Submission) -> Vec<(SeqRequest, Request)> {
        let (request, grammar) = (&sub.request, &sub.grammar);
        // Resolved by `EngineHandle::generate` (drawn there when the caller gave none).
        let seed = request.seed.unwrap_or_default();
        let prompt_ids: Shared<[u32]> = request.prompt_ids.clone().into();
        let model_stop_ids: &[u32] = if request.ignore_eos {
            &[]
        } else {
            &self.stop_ids
        };
        let stop_ids: Shared<[u32]> = model_stop_ids
            .iter()
            .chain(&request.stop_token_ids)
            .copied()
            .collect();
        let eos_id = self.stop_ids.first().copied().unwrap_or(0);
        (0..request.n)
            .map(|index| {
                let mut params = request.params.clone();
                params.seed = choice_seed(seed, index);
                let seq = SeqRequest {
                    seq_id: seq_id_of(sub.request_id, index),
                    // The core's copy: an image's placeholders named by its content, so
                    // prefix-cache blocks of different images never match.
                    prompt_ids: with_virtual_ids(&request.prompt_ids, &request.images),
                    max_tokens: request.max_tokens,
                    stop_ids: stop_ids.to_vec(),
                    // Folded into `stop_ids`: EOS left out, the request's own kept.
                    ignore_eos: false,
                    cache_salt: 0,
                    // As `RowSampling::verifies_on_device` finds its rows, or
                    // `masked_on_device` those with a grammar (the rank learns
                    // what the row continued yielded from its picks).
                    verified_by_picks: (params.is_greedy() || self.samples_on_device)
                        && params.has_no_processors()
                        && (grammar.is_none() || self.samples_on_device)
                        && request.min_tokens == 0,
                    // Completion 0 scores the prompt; the others start from its blocks.
                    score_prompt: index == 0 && request.prompt_logprobs.is_some(),
                };
                let r = Request {
                    stop_ids: stop_ids.clone(),
                    index,
                    pending_forks: Vec::new(),
                    stream: sub.stream.clone(),
                    params: Shared::new(params),
                    prompt_ids: prompt_ids.clone(),
                    images: (!request.images.is_empty())
                        .then(|| Shared::from(request.images.clone())),
                    request: (**request).clone(),
                    token_ids: Shared::new(Vec::new()),
                    constraint: grammar
                        .as_ref()
                        .map(|g| SeqConstraint::start(g, eos_id, stop_ids.clone())),
                    span: sub.span.clone(),
                    started: false,
                    prompt_scores: (index == 0 && request.prompt_logprobs.is_some())
                        .then(|| vec![None; request.prompt_ids.len()]),
                };
                (seq, r)
            })
            .collect()
    }

    /// A submission as it arrives: queued under the caller's span, its queue deadline
    /// set, then staged from the store or admitted.
    pub(super) fn receive(&mut self, sub: Submission, myself: &ActorRef<SchedulerMsg>) {
        let request_id = sub.request_id;
        sub.span.in_scope(|| {
            tracing::debug!(
                engine_request = request_id,
                prompt_tokens = sub.request.prompt_ids.len(),
                max_tokens = sub.request.max_tokens,
                n = sub.request.n,
                "queued"
            )
        });
        if let Some(limit) = self.queue_timeout {
            myself.send_after(limit, move || SchedulerMsg::QueueDeadline { request_id });
        }
        if let Some(sub) = self.stage(sub, myself) {
            self.submit(sub, StoredPrefix::default());
        }
    }
}
