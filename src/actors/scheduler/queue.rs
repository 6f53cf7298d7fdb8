//! What the scheduler does for requests still waiting: ends those past `--queue-timeout`,
//! and logs preemptions under each request's span.

use super::{MAX_CHOICES, SchedulerState, seq_id_of};

impl SchedulerState {
    pub(super) fn log_preemptions(&mut self) {
        for seq_id in self.core.take_preempted() {
            if let Some(r) = self.requests.get(&seq_id) {
                r.span.in_scope(|| {
                    tracing::debug!(index = r.index, "preempted: its KV is recomputed later")
                });
            }
        }
    }

    /// Ends the completions of `request_id` that are still waiting for admission.
    pub(super) fn expire_queued(&mut self, request_id: u64) {
        let Some(limit) = self.queue_timeout else {
            return;
        };
        for index in 0..MAX_CHOICES {
            let seq_id = seq_id_of(request_id, index);
            // A sequence that has been in a step (then preempted, or requeued by a device
            // reset) has started: only the never-started wait in the queue.
            let never_started = self.requests.get(&seq_id).is_some_and(|r| !r.started);
            if never_started && self.core.is_queued(seq_id) {
                self.core.abort(seq_id);
                self.fail(
                    seq_id,
                    &format!(
                        "the request waited in the queue for longer than --queue-timeout ({} s); the engine is overloaded, retry later",
                        limit.as_secs_f64()
                    ),
                );
            }
        }
        self.answer_drains();
    }
}
