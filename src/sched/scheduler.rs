//! The step planner: continuous batching with cost-model-sized chunked prefill, prefix
//! caching, LCFS preemption by recompute, zero-overhead scheduling (ZOS) and deferred
//! release.
//!
//! Contract with the caller (the scheduler actor):
//! - `schedule()` may run while up to one earlier step is in flight (so at most two are
//!   in flight); it plans as if every in-flight sampling row yields exactly one token.
//!   A decode row whose input token is still in flight reads it on the device through
//!   [`RowInput::FromPrevious`].
//! - `on_step_done()` is called once per planned step, in plan order, with that step's
//!   sampled tokens (one per `sample == true` row, in row order).
//! - Resources a sequence leaves behind (finish, abort, preemption) are reused only after
//!   every in-flight step that may touch them is done.
//!
//! One `schedule()` is O(running + admitted rows + blocks allocated), no hashing on the
//! decode path; `on_step_done()` is O(rows + newly full blocks).

use crate::spec::{
    LatencyCurve, ModelDraftCalibration, ModelDrafter, NgramCalibration, NgramDrafter, SeqDrafter,
    VerifyPrice,
};
use std::collections::{HashMap, VecDeque};

use self::resources::{DeferredRelease, Reserve};
use super::block_manager::BlockManager;
use super::cost_model::{CostModel, StepFeatures};
use super::prefix_cache::{CachedBlock, PrefixCache, PrefixCacheStats};
use super::sequence::{SeqEvent, SeqRequest, SeqStatus, Sequence};
use super::state_slots::StateSlots;
use super::{PlannedRow, SchedError, SchedulerConfig, SeqId, StepId, StepPlan};

/// What the scheduler remembers of an in-flight step's row.
#[derive(Debug, Clone)]
struct RowRecord {
    /// Index into `Scheduler::seqs`; stays valid while the row is in flight because a
    /// sequence with in-flight rows is never removed.
    seq_idx: usize,
    num_tokens: usize,
    sample: bool,
    num_draft_tokens: usize,
}

#[derive(Debug, Clone)]
struct InFlightStep {
    step_id: StepId,
    rows: Vec<RowRecord>,
    features: StepFeatures,
}

/// Match lengths the prompt-lookup drafter tries, longest first.
const NGRAM_MIN: usize = 1;
const NGRAM_MAX: usize = 4;

/// The pure scheduling core; see the module doc for the call contract.
#[derive(Clone)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    blocks: BlockManager,
    slots: Option<StateSlots>,
    prefix_cache: PrefixCache,
    cost_model: CostModel,
    /// Slab of live sequences (unfinished, or finished with rows still in flight).
    seqs: Vec<Option<Sequence>>,
    free_seq_slots: Vec<usize>,
    idx_of: HashMap<SeqId, usize>,
    waiting: VecDeque<usize>,
    /// Admission order: the last one is the preemption victim (LCFS).
    running: Vec<usize>,
    in_flight: VecDeque<InFlightStep>,
    deferred: VecDeque<DeferredRelease>,
    num_deferred_blocks: usize,
    next_step_id: StepId,
    next_arrival: u64,
    num_preemptions: u64,
    hits: Vec<CachedBlock>,
    /// Events raised while planning (a sequence stopped by preemption), handed out by
    /// `take_events` or with the next `on_step_done`.
    pending_events: Vec<SeqEvent>,
    /// What every sequence's prompt-lookup drafter learned about acceptance.
    ngram_calibration: NgramCalibration,
    /// What every sequence's model drafter learned about its draft probabilities.
    model_draft_calibration: ModelDraftCalibration,
    /// Decode step seconds by rows, measured on this hardware: with the cost model's
    /// attention terms, what confidence-scheduled verification prices steps with.
    decode_curve: Option<LatencyCurve>,
    /// How verify steps ran against that curve, next to plain ones.
    verify_price: VerifyPrice,
    /// The last decode step completed: rows, whether it verified, its curve seconds.
    last_decode_step: Option<(StepId, usize, bool, f64)>,
    /// Draft tokens drafters proposed for planned rows (verified or cut by the budget).
    num_proposed_drafts: u64,
    /// Times a speculating sequence sat out a step to wait for its drafts' verification.
    num_sat_out_rows: u64,
    /// Sequences preempted since `take_preempted` was last asked (for the request logs).
    preempted: Vec<SeqId>,
    store: stored::StoreLink,
    states: resume::StateLink,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> Self {
        assert!(cfg.block_size > 0, "block_size must be positive");
        assert!(cfg.max_step_tokens > 0, "max_step_tokens must be positive");
        assert!(cfg.max_num_seqs > 0, "max_num_seqs must be positive");
        Self {
            blocks: BlockManager::new(cfg.num_blocks),
            slots: cfg.num_state_slots.map(StateSlots::new),
            prefix_cache: PrefixCache::new(cfg.num_blocks, cfg.block_size),
            cost_model: CostModel::default(),
            seqs: Vec::new(),
            free_seq_slots: Vec::new(),
            idx_of: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            in_flight: VecDeque::new(),
            deferred: VecDeque::new(),
            num_deferred_blocks: 0,
            next_step_id: 0,
            next_arrival: 0,
            num_preemptions: 0,
            hits: Vec::new(),
            pending_events: Vec::new(),
            decode_curve: None,
            verify_price: VerifyPrice::default(),
            last_decode_step: None,
            num_proposed_drafts: 0,
            num_sat_out_rows: 0,
            preempted: Vec::new(),
            store: stored::StoreLink::default(),
            states: resume::StateLink::new(cfg.num_saved_states, cfg.num_blocks),
            ngram_calibration: NgramDrafter::calibration(
                NGRAM_MIN,
                NGRAM_MAX,
                cfg.num_speculative_tokens,
            ),
            model_draft_calibration: ModelDrafter::calibration(cfg.num_speculative_tokens),
            cfg,
        }
    }

    /// Replaces the cost model (a calibrated one from an earlier run, or a test prior).
    pub fn with_cost_model(mut self, cost_model: CostModel) -> Self {
        self.cost_model = cost_model;
        self
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    pub fn cost_model(&self) -> &CostModel {
        &self.cost_model
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_in_flight_steps(&self) -> usize {
        self.in_flight.len()
    }

    pub fn has_unfinished(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    pub fn num_free_blocks(&self) -> usize {
        self.blocks.num_free()
    }

    /// Prompt tokens of the waiting and running sequences not yet computed.
    pub fn num_queued_prefill_tokens(&self) -> usize {
        self.waiting
            .iter()
            .chain(&self.running)
            .filter_map(|&i| self.seqs[i].as_ref())
            .map(|s| s.num_prompt_tokens.saturating_sub(s.num_computed_tokens))
            .sum()
    }

    pub fn num_free_state_slots(&self) -> Option<usize> {
        self.slots.as_ref().map(StateSlots::num_free)
    }

    /// Events raised by `schedule` itself (today: sequences ended by `stop_preempted`).
    pub fn take_events(&mut self) -> Vec<SeqEvent> {
        std::mem::take(&mut self.pending_events)
    }

    /// The chain hashes of the blocks its prefix cache holds.
    pub fn cached_block_hashes(&self) -> Vec<u64> {
        self.prefix_cache.hashes().collect()
    }

    pub fn prefix_cache_stats(&self) -> PrefixCacheStats {
        self.prefix_cache.stats()
    }

    /// Queues a request, or refuses it for good (see [`SchedError`]).
    pub fn add(&mut self, req: SeqRequest) -> Result<(), SchedError> {
        let seq_id = req.seq_id;
        let cfg = &self.cfg;
        if self.idx_of.contains_key(&seq_id) {
            return Err(SchedError::DuplicateId { seq_id });
        }
        if req.prompt_ids.is_empty() {
            return Err(SchedError::EmptyPrompt { seq_id });
        }
        if req.max_tokens == 0 {
            return Err(SchedError::ZeroMaxTokens { seq_id });
        }
        let num_prompt_tokens = req.prompt_ids.len();
        if num_prompt_tokens >= cfg.max_context_tokens {
            return Err(SchedError::PromptTooLong {
                seq_id,
                num_prompt_tokens,
                max_context_tokens: cfg.max_context_tokens,
            });
        }
        if cfg.num_state_slots == Some(0) {
            return Err(SchedError::NoStateSlots { seq_id });
        }
        // The last sampled token is never fed back, so its position needs no KV.
        let max_kv_positions = num_prompt_tokens
            .saturating_add(req.max_tokens)
            .min(cfg.max_context_tokens)
            - 1;
        let num_blocks_needed = max_kv_positions.div_ceil(cfg.block_size);
        if num_blocks_needed > cfg.num_blocks {
            return Err(SchedError::NeverFits {
                seq_id,
                num_blocks_needed,
                num_blocks_total: cfg.num_blocks,
            });
        }
        let mut seq = Sequence::new(req, self.next_arrival);
        if cfg.num_speculative_tokens > 0 {
            seq.drafter = Some(if cfg.model_drafts {
                SeqDrafter::Model(ModelDrafter::new(self.model_draft_calibration.clone()))
            } else {
                SeqDrafter::Ngram(NgramDrafter::with_calibration(
                    NGRAM_MIN,
                    NGRAM_MAX,
                    self.ngram_calibration.clone(),
                ))
            });
        }
        self.next_arrival += 1;
        let idx = match self.free_seq_slots.pop() {
            Some(idx) => {
                self.seqs[idx] = Some(seq);
                idx
            }
            None => {
                self.seqs.push(Some(seq));
                self.seqs.len() - 1
            }
        };
        self.idx_of.insert(seq_id, idx);
        self.waiting.push_back(idx);
        Ok(())
    }

    /// Draft tokens proposed so far, those the confidence budget cut included.
    pub fn num_proposed_drafts(&self) -> u64 {
        self.num_proposed_drafts
    }

    /// Times a speculating sequence sat out a step (`waits_for_drafts`).
    pub fn num_sat_out_rows(&self) -> u64 {
        self.num_sat_out_rows
    }

    /// Prices verification with a measured decode latency curve (see `decode_curve`).
    pub fn set_decode_curve(&mut self, curve: LatencyCurve) {
        self.decode_curve = Some(curve);
    }

    /// Ends a sequence early. No event is emitted; its resources come back once no
    /// in-flight step reads them. False if the id is unknown or already finished.
    pub fn abort(&mut self, seq_id: SeqId) -> bool {
        let Some(&idx) = self.idx_of.get(&seq_id) else {
            return false;
        };
        match self.seq(idx).status {
            SeqStatus::Finished => return false,
            SeqStatus::Running => self.running.retain(|&i| i != idx),
            SeqStatus::Waiting => self.waiting.retain(|&i| i != idx),
        }
        self.finish(idx);
        true
    }

    /// Plans the next step, or `None` when nothing can run now.
    pub fn schedule(&mut self) -> Option<StepPlan> {
        let step_id = self.next_step_id;
        let budget_secs = self.cfg.step_time_budget_secs;
        let mut rows: Vec<PlannedRow> = Vec::with_capacity(self.running.len());
        let mut records: Vec<RowRecord> = Vec::with_capacity(self.running.len());
        let mut num_tokens_left = self.cfg.max_step_tokens;
        // Prefill chunks are sized against every decode row of the step, planned or not
        // yet, so an early chunk cannot eat the budget of later decodes. Summed lazily:
        // a decode-only step never needs it.
        let mut decode_features: Option<StepFeatures> = None;
        let mut prefill_features = StepFeatures::default();
        let mut num_prefill_rows = 0;
        let mut preempted_any = false;

        let mut verify_drafts = if self.cfg.confidence_verify && self.cfg.num_speculative_tokens > 0
        {
            Some(self.confidence_drafts())
        } else {
            None
        };
        let mut i = 0;
        while i < self.running.len() && num_tokens_left > 0 {
            let idx = self.running[i];
            let seq = self.seq(idx);
            if !seq.may_sample_more(self.cfg.max_context_tokens) {
                i += 1;
                continue;
            }
            if seq.drafter.is_some() && seq.num_in_flight_rows > 0 && self.waits_for_drafts(idx) {
                // A row that verifies drafts yields an unknown number of tokens, and new
                // drafts need the in-flight token: the next row of its sequence waits
                // (no ZOS continuation).
                self.num_sat_out_rows += 1;
                i += 1;
                continue;
            }
            let num_cached = seq.num_scheduled_tokens;
            let num_remaining = seq.num_tokens() - num_cached;
            let is_decode = num_remaining == 1;
            let mut drafts = Vec::new();
            let q = if is_decode {
                drafts = match verify_drafts.as_mut() {
                    Some(chosen) => {
                        let (mut d, num_proposed) = chosen.remove(&idx).unwrap_or_default();
                        d.truncate(num_tokens_left - 1);
                        self.num_proposed_drafts += num_proposed as u64;
                        d
                    }
                    None => {
                        let d = self.drafts(idx, num_tokens_left - 1);
                        self.num_proposed_drafts += d.len() as u64;
                        d
                    }
                };
                1 + drafts.len()
            } else {
                let max_q = num_remaining
                    .min(num_tokens_left)
                    .min(self.seq(idx).max_chunk_tokens());
                let base = *decode_features.get_or_insert_with(|| self.decode_features());
                let features = base + prefill_features;
                match self.chunk(&features, num_cached, max_q, budget_secs, num_prefill_rows) {
                    0 => {
                        i += 1;
                        continue;
                    }
                    q => self.align_chunk(idx, num_cached, q, None),
                }
            };
            let num_new_blocks = self.num_new_blocks(idx, num_cached + q);
            let num_running_before = self.running.len();
            let reserved = self.reserve_blocks(idx, num_new_blocks);
            preempted_any |= self.running.len() < num_running_before;
            match reserved {
                Reserve::Reserved => {}
                Reserve::Wait => {
                    i += 1;
                    continue;
                }
                Reserve::SelfPreempted => break,
            }
            self.allocate_into(idx, num_new_blocks);
            if !is_decode {
                prefill_features.add_row(q, num_cached);
                num_prefill_rows += 1;
            }
            self.push_row(idx, step_id, q, &drafts, &mut rows, &mut records);
            num_tokens_left -= q;
            i += 1;
        }

        // FCFS admission; not in a step that had to preempt (the victim would be
        // re-admitted at once and thrash).
        while !preempted_any
            && num_tokens_left > 0
            && self.running.len() < self.cfg.max_num_seqs
            && let Some(&idx) = self.waiting.front()
        {
            let base = *decode_features.get_or_insert_with(|| self.decode_features());
            let features = base + prefill_features;
            let Some(q) = self.try_admit(idx, &features, num_tokens_left, num_prefill_rows) else {
                break;
            };
            let num_cached = self.seq(idx).num_scheduled_tokens;
            prefill_features.add_row(q, num_cached);
            num_prefill_rows += 1;
            self.push_row(idx, step_id, q, &[], &mut rows, &mut records);
            num_tokens_left -= q;
        }

        if rows.is_empty() {
            return None;
        }
        self.next_step_id += 1;
        let mut step_features = StepFeatures::default();
        for row in &rows {
            step_features.add_row(row.num_tokens(), row.num_cached_tokens);
        }
        self.in_flight.push_back(InFlightStep {
            step_id,
            rows: records,
            features: step_features,
        });
        Some(StepPlan {
            step_id,
            rows,
            kv_loads: std::mem::take(&mut self.store.loads),
            state_loads: std::mem::take(&mut self.states.loads),
            state_imports: std::mem::take(&mut self.states.imports),
            state_saves: std::mem::take(&mut self.states.saves),
        })
    }

    /// Cost features of the decode rows this step would plan for the running sequences.
    fn decode_features(&self) -> StepFeatures {
        let mut features = StepFeatures::default();
        for &idx in &self.running {
            let seq = self.seq(idx);
            // A decode row: one position left (drafts in flight counted as accepted).
            if seq.num_tokens().checked_sub(seq.num_scheduled_tokens) == Some(1)
                && seq.may_sample_more(self.cfg.max_context_tokens)
            {
                features.add_row(1, seq.num_scheduled_tokens);
            }
        }
        features
    }

    fn seq(&self, idx: usize) -> &Sequence {
        self.seqs[idx].as_ref().expect("index of a live sequence")
    }

    fn seq_mut(&mut self, idx: usize) -> &mut Sequence {
        self.seqs[idx].as_mut().expect("index of a live sequence")
    }

    /// Prefill chunk size; the first prefill row of a step gets at least one token so
    /// prefills always progress, later ones only what fits the budget.
    fn chunk(
        &self,
        features: &StepFeatures,
        num_cached: usize,
        max_q: usize,
        budget_secs: f64,
        num_prefill_rows: usize,
    ) -> usize {
        let q = self
            .cost_model
            .largest_fitting_chunk(features, num_cached, max_q, budget_secs);
        if q == 0 && num_prefill_rows == 0 {
            max_q.min(1)
        } else {
            q
        }
    }

    fn num_new_blocks(&self, idx: usize, num_positions: usize) -> usize {
        num_positions
            .div_ceil(self.cfg.block_size)
            .saturating_sub(self.seq(idx).block_table.len())
    }

    /// Admits waiting sequence `idx` (blocks, cache hits and slot at once, or nothing)
    /// and returns its first chunk's size; `None` if it cannot run now.
    fn try_admit(
        &mut self,
        idx: usize,
        features: &StepFeatures,
        num_tokens_left: usize,
        num_prefill_rows: usize,
    ) -> Option<usize> {
        let mut hits = std::mem::take(&mut self.hits);
        hits.clear();
        let seq = self.seq(idx);
        // Its rows from before a preemption still run: their KV would race ours.
        if seq.num_in_flight_rows > 0 {
            self.hits = hits;
            return None;
        }
        let block_size = self.cfg.block_size;
        // Never match the last token: it must be computed to sample the next one. A scored
        // prompt matches nothing: a hit's positions would have no logits.
        let num_matchable = if seq.scores_prompt() {
            0
        } else {
            seq.tokens.len() - 1
        };
        if self.cfg.enable_prefix_cache {
            self.prefix_cache.match_prefix(
                &seq.tokens[..num_matchable],
                seq.cache_salt,
                usize::MAX,
                &mut hits,
            );
        }
        let num_stored = self.num_stored_hits(idx, &hits, num_matchable / block_size);
        let num_cached = (hits.len() + num_stored) * block_size;
        // A model with per-sequence state resumes a hit from a saved or stored state, or
        // by recomputing the tokens that rebuild it (their blocks are the hits).
        let resume = self.resume_point(idx, &hits, num_stored, num_cached);
        let start = resume.start;
        let max_q = (self.seq(idx).tokens.len() - start)
            .min(num_tokens_left)
            .min(self.seq(idx).max_chunk_tokens());
        let q = self.chunk(
            features,
            start,
            max_q,
            self.cfg.step_time_budget_secs,
            num_prefill_rows,
        );
        let q = self.align_chunk(idx, start, q, Some((&resume, num_cached)));
        // Stored hits are loaded into fresh blocks even where a replay's first chunk ends
        // before them.
        let num_new_blocks = (start + q)
            .div_ceil(block_size)
            .max(hits.len() + num_stored)
            .saturating_sub(hits.len());
        // Hits on evictable blocks stop being allocatable once taken.
        let num_evictable_hits = hits
            .iter()
            .filter(|h| self.blocks.ref_count(h.block_id) == 0)
            .count();
        let fits = q > 0
            && self.blocks.num_free() - num_evictable_hits >= num_new_blocks
            && self.slots.as_ref().is_none_or(|s| s.num_free() > 0);
        if !fits {
            self.hits = hits;
            return None;
        }
        // Commit: nothing below can fail.
        for h in &hits {
            self.blocks.share(h.block_id);
        }
        if self.cfg.enable_prefix_cache {
            self.prefix_cache
                .record_query(num_matchable / block_size, hits.len());
        }
        let slot = self.slots.as_mut().map(|s| s.allocate().expect("checked"));
        let seq = self.seq_mut(idx);
        seq.block_table.extend(hits.iter().map(|h| h.block_id));
        seq.block_hashes.extend(hits.iter().map(|h| h.hash));
        seq.num_scheduled_tokens = start;
        seq.num_computed_tokens = start;
        seq.state_start = if resume.exact() { 0 } else { start };
        seq.replay_until = num_cached;
        seq.state_slot = slot;
        seq.status = SeqStatus::Running;
        let num_hits = hits.len();
        self.hits = hits;
        self.allocate_into(idx, num_new_blocks);
        self.load_stored(idx, num_hits, num_stored);
        if let Some(slot) = slot {
            self.commit_resume(resume, slot, num_cached);
        }
        self.waiting.pop_front();
        self.running.push(idx);
        Some(q)
    }
}

mod completion;
mod resources;
mod resume;
#[cfg(test)]
mod resume_tests;
mod rows;
#[cfg(test)]
mod score_tests;
#[cfg(test)]
mod sim;
#[cfg(test)]
mod spec_tests;
#[cfg(test)]
mod store_tests;
mod stored;
#[cfg(test)]
mod tests;
