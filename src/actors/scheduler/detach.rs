//! `serve --drain-to`: the requests a peer can continue exactly, handed out of the engine
//! mid-generation. A peer continues one from its prompt and the tokens it has generated
//! as a longer prompt: the seeded draws are keyed by position, the repetition penalty by
//! the set of prompt and output tokens, so the continuation draws what this engine would
//! have. Those whose sampling reads the output alone (frequency and presence penalties),
//! that follow a grammar, score their prompt or have several completions stay and finish
//! here.

use tokio::sync::mpsc::UnboundedSender;

use super::{Request, SchedulerState, request_id_of};
use crate::api::{EngineRequest, RequestOutput};
use crate::sched::SeqId;

/// A request taken out of the engine: what a peer needs to continue it, and the caller's
/// channel the peer's outputs go on to.
pub struct Detached {
    pub request_id: u64,
    /// As submitted, its seed resolved.
    pub request: EngineRequest,
    /// Generated so far, every one of them already sent to the caller.
    pub generated: Vec<u32>,
    pub stream: UnboundedSender<RequestOutput>,
}

impl SchedulerState {
    /// Every movable request out of the core (its blocks released, its rows in flight
    /// dropped), with nothing sent to its caller.
    pub(super) fn detach_movable(&mut self) -> Vec<Detached> {
        let ids: Vec<SeqId> = self
            .requests
            .iter()
            .filter(|(_, r)| movable(r))
            .map(|(id, _)| *id)
            .collect();
        let mut out = Vec::with_capacity(ids.len());
        for seq_id in ids {
            let Some(r) = self.requests.remove(&seq_id) else {
                continue;
            };
            // Its request gone from `requests`, the core's end of it reaches nobody.
            self.core.abort(seq_id);
            out.push(Detached {
                request_id: request_id_of(seq_id),
                request: r.request,
                generated: r.token_ids.to_vec(),
                stream: r.stream,
            });
        }
        for event in self.core.take_events() {
            if let crate::sched::SeqEvent::Finished { seq_id, reason } = event {
                self.finish(seq_id, reason);
            }
        }
        out
    }
}

fn movable(r: &Request) -> bool {
    let (req, p) = (&r.request, &r.request.params);
    req.n == 1
        && r.pending_forks.is_empty()
        && r.constraint.is_none()
        && req.grammar.is_none()
        && req.prompt_logprobs.is_none()
        // A peer's core would name the images' placeholders as token ids.
        && req.images.is_empty()
        && p.frequency_penalty == 0.0
        && p.presence_penalty == 0.0
}
