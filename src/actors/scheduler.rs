//! The scheduler actor: a thin shell around `sched::Scheduler`. It admits requests, sends
//! each planned step to the rank worker, turns sampled tokens into request outputs, and
//! resets the core when a rank or the sampler restarts.

use crate::sync::Shared;
use std::collections::{HashMap, VecDeque};

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::sync::mpsc::UnboundedSender;

use super::rank_worker::RankMsg;
use super::sampler::SamplerMsg;
use crate::api::{EngineError, EngineRequest, EngineStatus, MAX_CHOICES, RequestOutput};
use crate::runner::RankReport;
use crate::runner::sampled_tokens::SampledTokens;
use crate::sampling::SamplingParams;
use crate::sampling::ScoredToken;
use crate::sched::{FinishReason, Scheduler, SchedulerConfig, SeqId, SeqRequest, StoredPrefix};
use crate::step::{SampledStep, Step};
use crate::store::KvStore;
use crate::structured::{CompiledGrammar, SeqConstraint};

mod detach;
mod lifecycle;
mod prompt_scores;
mod queue;
mod sampled;
mod staging;
mod step_loop;

pub use detach::Detached;
use staging::Submission;

pub enum SchedulerMsg {
    Submit {
        request_id: u64,
        request: Box<EngineRequest>,
        /// `request.grammar`, compiled.
        grammar: Option<Shared<CompiledGrammar>>,
        stream: UnboundedSender<RequestOutput>,
        reply: RpcReplyPort<Result<(), EngineError>>,
        /// The caller's span (the HTTP request's): the request's log lines go under it.
        span: tracing::Span,
    },
    Abort {
        request_id: u64,
    },
    /// A submission whose prompt blocks the prefix store was asked for, with what it
    /// holds (read on a blocking thread meanwhile).
    Staged {
        submission: Box<Submission>,
        stored: StoredPrefix,
    },
    /// From the request's stream: a stop string ended completion `index`'s text.
    StopChoice {
        request_id: u64,
        index: usize,
    },
    /// From the sampler: the sampled rows of a step, in row order.
    StepSampled(SampledStep),
    /// From the supervisor, at start and after restarts: device state is fresh, so every
    /// unfinished sequence is recomputed.
    Attach {
        /// A new group of rank workers, rank order.
        workers: Option<Vec<ActorRef<RankMsg>>>,
        sampler: Option<ActorRef<SamplerMsg>>,
        /// What the new group's ranks measured and how they were placed, rank order
        /// (empty when the group is unchanged).
        reports: Vec<RankReport>,
    },
    /// From the supervisor: no rank can run; fail everything now and later.
    RankLost {
        reason: String,
    },
    Status(RpcReplyPort<EngineStatus>),
    /// The chain hashes of the prefix cache's blocks.
    CachedBlocks(RpcReplyPort<Vec<u64>>),
    /// Replies once every block registered so far is in the prefix store.
    FlushKvSaves(RpcReplyPort<()>),
    /// Hands out every request a peer can continue exactly (`detach.rs`).
    Detach(RpcReplyPort<Vec<Detached>>),
    /// Replies once no request is left.
    Drain(RpcReplyPort<()>),
    /// `queue_timeout` after a submission: its completions still waiting end with an error.
    QueueDeadline {
        request_id: u64,
    },
    /// Ends every request with `reason` as its error and refuses new ones with it (the
    /// server is shutting down).
    CancelAll {
        reason: String,
    },
}

/// A generated token's logprob and its top alternatives.
type TokenLogprobs = (f32, Vec<(u32, f32)>);

pub struct SchedulerArgs {
    pub config: SchedulerConfig,
    pub zero_overhead_scheduling: bool,
    /// Sampled requests' drafts are accepted by rejection sampling (`SpecAcceptance`).
    pub rejection_acceptance: bool,
    /// The ranks draw seeded rows without processors where the logits lie
    /// (`Backend::device_picks`), so they verify such rows' drafts by their picks.
    pub samples_on_device: bool,
    pub sampled: SampledTokens,
    pub stop_ids: Vec<u32>,
    /// The prefix store prompts are looked up in before admission.
    pub kv_store: Option<Shared<KvStore>>,
    /// How long a request may wait for admission before it ends with an error.
    pub queue_timeout: Option<std::time::Duration>,
}

/// One completion of a request. A request with `n` completions runs as `n` sequences,
/// `seq_id = request_id << 8 | index`.
struct Request {
    index: usize,
    /// Completions 1..n wait here until completion 0's prompt is in the KV cache, so
    /// they start from its blocks instead of computing the prompt again.
    pending_forks: Vec<(SeqRequest, Request)>,
    stream: UnboundedSender<RequestOutput>,
    request: EngineRequest,
    /// Ids that end this completion (the model's unless `ignore_eos`, plus the request's
    /// own); banned while fewer than `min_tokens` were generated.
    stop_ids: Shared<[u32]>,
    /// `request.params` with the seed resolved, shared with every step's sampling rows.
    params: Shared<SamplingParams>,
    prompt_ids: Shared<[u32]>,
    /// The prompt's images, handed to the ranks with each of its rows.
    images: Option<Shared<[crate::step::PromptImage]>>,
    /// Generated so far; copied on write only while a step still holds the previous one.
    token_ids: Shared<Vec<u32>>,
    /// Structured output: the grammar state the sampler masks this completion with.
    constraint: Option<Shared<SeqConstraint>>,
    /// The caller's span: admission, preemption and finish are logged under it.
    span: tracing::Span,
    /// Has been in a planned step.
    started: bool,
    /// Prompt logprobs being gathered (`prompt_scores.rs`).
    prompt_scores: Option<Vec<Option<ScoredToken>>>,
}

pub struct SchedulerState {
    core: Scheduler,
    zos: bool,
    rejection_acceptance: bool,
    samples_on_device: bool,
    sampled: SampledTokens,
    epoch: u64,
    /// The rank workers every step goes to (rank order); empty before the first attach.
    workers: Vec<ActorRef<RankMsg>>,
    sampler: Option<ActorRef<SamplerMsg>>,
    stop_ids: Shared<[u32]>,
    no_ids: Shared<[u32]>,
    requests: HashMap<SeqId, Request>,
    in_flight: VecDeque<Shared<Step>>,
    failed: Option<String>,
    drains: Vec<RpcReplyPort<()>>,
    status: EngineStatus,
    /// When the last step's tokens came in (the period between steps is a step's cost).
    last_sampled_at: Option<std::time::Instant>,
    kv_store: Option<Shared<KvStore>>,
    /// Submissions whose blocks are being read from the store (a drain waits for them).
    num_staging: usize,
    queue_timeout: Option<std::time::Duration>,
}

impl SchedulerState {
    fn answer_drains(&mut self) {
        if self.requests.is_empty() && self.num_staging == 0 {
            for d in self.drains.drain(..) {
                let _ = d.send(());
            }
        }
    }

    fn emit(&mut self, seq_id: SeqId, out: RequestOutput) {
        let gone = match self.requests.get(&seq_id) {
            Some(r) => r.stream.send(out).is_err(),
            None => false,
        };
        if gone {
            // The caller dropped its stream: nobody wants the rest.
            self.abort_request(request_id_of(seq_id));
        }
    }

    /// Admits completions 1..n once completion 0's prompt blocks are cached.
    fn start_forks(&mut self, forks: Vec<(SeqRequest, Request)>) {
        for (seq, r) in forks {
            let seq_id = seq.seq_id;
            self.requests.insert(seq_id, r);
            if let Err(e) = self.core.add(seq) {
                self.fail(seq_id, &e.to_string());
            }
        }
    }

    fn fail(&mut self, seq_id: SeqId, reason: &str) {
        if let Some(r) = self.requests.remove(&seq_id) {
            r.span
                .in_scope(|| tracing::debug!(index = r.index, reason, "failed"));
            let _ = r.stream.send(RequestOutput {
                request_id: request_id_of(seq_id),
                index: r.index,
                error: Some(reason.to_string()),
                ..Default::default()
            });
        }
    }

    /// Ends every completion of `request_id` still running.
    fn abort_request(&mut self, request_id: u64) {
        for index in 0..MAX_CHOICES {
            let seq_id = seq_id_of(request_id, index);
            if self.requests.contains_key(&seq_id) {
                self.core.abort(seq_id);
                self.finish(seq_id, FinishReason::Abort);
            }
        }
    }

    fn finish(&mut self, seq_id: SeqId, reason: FinishReason) {
        if let Some(mut r) = self.requests.remove(&seq_id) {
            r.span.in_scope(|| {
                tracing::debug!(
                    index = r.index,
                    ?reason,
                    tokens = r.token_ids.len(),
                    "finished"
                )
            });
            let forks = std::mem::take(&mut r.pending_forks);
            let prompt_logprobs = r.take_scores();
            let _ = r.stream.send(RequestOutput {
                prompt_logprobs,
                request_id: request_id_of(seq_id),
                index: r.index,
                finish_reason: Some(reason),
                seed: Some(r.params.seed),
                ..Default::default()
            });
            if reason == FinishReason::Abort {
                for (seq, fork) in forks {
                    let _ = fork.stream.send(RequestOutput {
                        request_id: request_id_of(seq.seq_id),
                        index: fork.index,
                        finish_reason: Some(FinishReason::Abort),
                        seed: Some(fork.params.seed),
                        ..Default::default()
                    });
                }
            } else {
                // Finished before its first token (a stop token at once): the prompt is
                // cached all the same.
                self.start_forks(forks);
            }
        }
    }

    fn fail_all(&mut self, reason: &str) {
        let all: Vec<(SeqId, Request)> = self.requests.drain().collect();
        for (seq_id, mut r) in all {
            self.core.abort(seq_id);
            let forks = std::mem::take(&mut r.pending_forks);
            for (seq_id, r) in
                std::iter::once((seq_id, r)).chain(forks.into_iter().map(|(s, r)| (s.seq_id, r)))
            {
                let _ = r.stream.send(RequestOutput {
                    request_id: request_id_of(seq_id),
                    index: r.index,
                    error: Some(reason.to_string()),
                    ..Default::default()
                });
            }
        }
        self.answer_drains();
    }
}

const CHOICE_BITS: u32 = 8;

fn seq_id_of(request_id: u64, index: usize) -> SeqId {
    (request_id << CHOICE_BITS) | index as u64
}

fn request_id_of(seq_id: SeqId) -> u64 {
    seq_id >> CHOICE_BITS
}

pub struct SchedulerActor;

impl ractor::Message for SchedulerMsg {}
impl ractor::Message for SampledStep {}

impl Actor for SchedulerActor {
    type Msg = SchedulerMsg;
    type State = SchedulerState;
    type Arguments = SchedulerArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<SchedulerMsg>,
        args: SchedulerArgs,
    ) -> Result<SchedulerState, ActorProcessingErr> {
        let num_total_blocks = args.config.num_blocks;
        let num_total_state_slots = args.config.num_state_slots.unwrap_or(0);
        let mut core = Scheduler::new(args.config);
        core.set_kv_store(args.kv_store.is_some());
        Ok(SchedulerState {
            core,
            zos: args.zero_overhead_scheduling,
            rejection_acceptance: args.rejection_acceptance,
            samples_on_device: args.samples_on_device,
            epoch: args.sampled.epoch(),
            sampled: args.sampled,
            workers: Vec::new(),
            sampler: None,
            stop_ids: args.stop_ids.into(),
            no_ids: Shared::from(Vec::new()),
            requests: HashMap::new(),
            in_flight: VecDeque::new(),
            failed: None,
            drains: Vec::new(),
            last_sampled_at: None,
            kv_store: args.kv_store,
            num_staging: 0,
            queue_timeout: args.queue_timeout,
            status: EngineStatus {
                num_total_blocks,
                num_total_state_slots,
                ..Default::default()
            },
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<SchedulerMsg>,
        msg: SchedulerMsg,
        st: &mut SchedulerState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SchedulerMsg::Submit {
                request_id,
                request,
                grammar,
                stream,
                reply,
                span,
            } => {
                let sub = Submission {
                    request_id,
                    request,
                    grammar,
                    stream,
                    reply,
                    span,
                };
                st.receive(sub, &myself);
            }
            SchedulerMsg::Staged { submission, stored } => {
                st.num_staging -= 1;
                st.submit(*submission, stored);
            }
            SchedulerMsg::Abort { request_id } => {
                st.abort_request(request_id);
                st.kick();
            }
            SchedulerMsg::StopChoice { request_id, index } => {
                st.stop_choice(request_id, index);
                st.kick();
            }
            SchedulerMsg::StepSampled(step) => {
                if step.epoch == st.epoch {
                    st.count_step(&step);
                    st.on_sampled(step);
                    st.kick();
                }
            }
            SchedulerMsg::Attach {
                workers,
                sampler,
                reports,
            } => {
                st.attach(workers, sampler, reports);
                st.kick();
            }
            SchedulerMsg::RankLost { reason } => st.rank_lost(&reason),
            SchedulerMsg::Status(reply) => {
                let _ = reply.send(st.status_now());
            }
            SchedulerMsg::CachedBlocks(reply) => {
                let _ = reply.send(st.core.cached_block_hashes());
            }
            SchedulerMsg::FlushKvSaves(reply) => st.flush_kv_saves(reply),
            SchedulerMsg::Detach(reply) => {
                let _ = reply.send(st.detach_movable());
                st.kick();
            }
            SchedulerMsg::Drain(reply) => {
                st.drains.push(reply);
                st.answer_drains();
            }
            SchedulerMsg::QueueDeadline { request_id } => {
                st.expire_queued(request_id);
                st.kick();
            }
            SchedulerMsg::CancelAll { reason } => {
                st.cancel_all(reason);
                st.kick();
            }
        }
        Ok(())
    }
}
