//! The scheduler's bookkeeping around steps: a new group of ranks attached (device state
//! fresh, every unfinished sequence recomputed), each sampled step's measures counted,
//! the status a caller reads, and sequences ended from outside the step (a stop string,
//! a cancel, the last rank lost).

use ractor::ActorRef;

use super::super::rank_worker::RankMsg;
use super::super::sampler::SamplerMsg;
use super::SchedulerState;
use crate::api::EngineStatus;
use crate::runner::RankReport;
use crate::sched::FinishReason;
use crate::step::SampledStep;

impl SchedulerState {
    /// A new group of rank workers (`workers`, rank order, with what they measured and how
    /// they were placed), a new sampler, or both: the device state is fresh.
    pub(super) fn attach(
        &mut self,
        workers: Option<Vec<ActorRef<RankMsg>>>,
        sampler: Option<ActorRef<SamplerMsg>>,
        reports: Vec<RankReport>,
    ) {
        if let Some(workers) = workers {
            self.status.tensor_parallel_size = workers.len();
            self.workers = workers;
            self.status.cpu_affinity = reports.iter().map(RankReport::cores).collect();
            let weights = || reports.iter().filter_map(|r| r.weights.as_ref());
            self.status.resident_weight_bytes = weights().map(|w| w.resident_bytes as u64).sum();
            self.status.resident_host_weight_bytes =
                weights().map(|w| w.host_resident_bytes as u64).sum();
            self.status.weight_card = reports
                .first()
                .and_then(|r| r.weights.as_ref())
                .map(|w| w.card())
                .unwrap_or_default();
            // The leader measured it as it started (a lone rank only).
            let curve = reports.into_iter().next().and_then(|r| r.decode_curve);
            if let Some(curve) = curve {
                self.status.num_decode_curve_points = curve.num_points();
                self.core.set_decode_curve(curve);
            }
        }
        if sampler.is_some() {
            self.sampler = sampler;
        }
        self.epoch = self.sampled.invalidate();
        self.in_flight.clear();
        self.core.reset_device_state();
        self.status.num_resets += 1;
    }

    /// A sampled step's idle times and expert balance into the status.
    pub(super) fn count_step(&mut self, step: &SampledStep) {
        self.status.worker_idle_secs += step.worker_idle_secs;
        self.status.device_idle_secs += step.device_idle_secs.unwrap_or(0.0);
        if let Some(b) = step.moe_balance {
            self.status.moe_lb = b.worst_moe_lb;
            self.status.num_eplb_rebalances = b.num_rebalances;
            self.status.num_eplb_moved_experts = b.num_moved_experts;
            self.status.measured_moe_lb = b.measured_moe_lb;
        }
    }

    /// The status now: the counters kept here and the core's.
    pub(super) fn status_now(&self) -> EngineStatus {
        let mut s = self.status.clone();
        let core = &self.core;
        s.num_spec_draft_tokens = core.num_proposed_drafts();
        s.num_spec_sat_out_rows = core.num_sat_out_rows();
        s.num_running = core.num_running();
        s.num_waiting = core.num_waiting();
        s.num_queued_prefill_tokens = core.num_queued_prefill_tokens();
        s.num_free_blocks = core.num_free_blocks();
        s.num_free_state_slots = core.num_free_state_slots().unwrap_or(0);
        s.num_preemptions = core.num_preemptions();
        let prefix = core.prefix_cache_stats();
        s.num_prefix_queried_blocks = prefix.num_queried_blocks;
        s.num_prefix_hit_blocks = prefix.num_hit_blocks;
        s.num_stored_hit_blocks = core.num_stored_hit_blocks();
        s.num_resumed_hits = core.num_resumed_hits();
        s.num_replayed_hits = core.num_replayed_hits();
        s.kv_store = self
            .kv_store
            .as_ref()
            .map(|k| k.stats())
            .unwrap_or_default();
        s
    }

    /// The last rank is gone: the engine has failed, and every request with it.
    pub(super) fn rank_lost(&mut self, reason: &str) {
        let reason = format!("no rank worker is left: {reason}");
        tracing::error!("the engine has failed: {reason}");
        self.status.failure = Some(reason.clone());
        self.failed = Some(reason.clone());
        self.sampled.invalidate();
        self.fail_all(&reason);
    }

    /// `CancelAll`: every sequence cut; what is still on its way in (a body being read, a
    /// prompt being staged from the store) is refused with the same reason, never started.
    pub(super) fn cancel_all(&mut self, reason: String) {
        tracing::warn!("cancelling {} sequences: {reason}", self.requests.len());
        self.failed = Some(reason.clone());
        self.fail_all(&reason);
    }

    /// A stop string ended completion `index` of `request_id`: the core still counts the
    /// sequence as running, so it ends there too.
    pub(super) fn stop_choice(&mut self, request_id: u64, index: usize) {
        let seq_id = super::seq_id_of(request_id, index);
        if self.requests.contains_key(&seq_id) {
            self.core.abort(seq_id);
            self.finish(seq_id, FinishReason::Stop);
        }
    }
}
