//! Test harness for the scheduler: a fake device that writes each row's input tokens
//! into a paged "KV" through the row's block table and samples the next token as a hash
//! of the whole context read back through the block table. A wrong position, block
//! table, prefix hit or early block reuse therefore changes the output, which is
//! compared with a one-sequence-at-a-time reference.

use std::collections::{BTreeMap, HashMap, VecDeque};

use super::Scheduler;
use crate::sched::{
    FinishReason, RowInput, SchedulerConfig, SeqEvent, SeqId, SeqRequest, StepId, StepPlan,
};

pub(super) const VOCAB: u32 = 64;
pub(super) const STOP: u32 = 0;

pub(super) fn fake_next(context: &[u32]) -> u32 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &t in context {
        h = (h ^ t as u64).wrapping_mul(0x0100_0000_01b3);
    }
    (h >> 17) as u32 % VOCAB
}

/// A "model" a prompt-lookup drafter can predict: mostly the previous token's successor in
/// a fixed cycle, but every context hash ≡ 0 mod 4 breaks it — so a wrong KV position or
/// a rejected draft left in the KV still changes the output.
pub(super) fn predictable_next(context: &[u32]) -> u32 {
    let h = fake_next(context);
    match context.last() {
        Some(&last) if !h.is_multiple_of(4) => (last * 5 + 3) % VOCAB,
        _ => h,
    }
}

/// Output of a request run alone: generated tokens and why it ended.
pub(super) fn reference(req: &SeqRequest, max_context_tokens: usize) -> (Vec<u32>, FinishReason) {
    reference_with(req, max_context_tokens, fake_next)
}

pub(super) fn reference_with(
    req: &SeqRequest,
    max_context_tokens: usize,
    next: fn(&[u32]) -> u32,
) -> (Vec<u32>, FinishReason) {
    let mut context = req.prompt_ids.clone();
    let mut out = Vec::new();
    loop {
        let t = next(&context);
        if !req.ignore_eos && req.stop_ids.contains(&t) {
            return (out, FinishReason::Stop);
        }
        context.push(t);
        out.push(t);
        if out.len() >= req.max_tokens || context.len() >= max_context_tokens {
            return (out, FinishReason::Length);
        }
    }
}

/// A state slot as the fake device keeps it: its position and the last `window` tokens it
/// saw, as a sliding-window model's state. A sampled token whose slot did not see the
/// window before it comes out wrong, so an inexact resume changes the output.
#[derive(Debug, Clone, Default)]
struct SimSlot {
    pos: usize,
    seen: VecDeque<u32>,
}

pub(super) struct Device {
    pub(super) block_size: usize,
    /// With state slots: the tokens a state depends on (the replay bound); 0: no state.
    window: usize,
    slots: HashMap<u32, SimSlot>,
    saved: HashMap<u32, SimSlot>,
    /// Saved states put into slots.
    pub(super) num_state_loads: usize,
    /// States saved with a store's key (`StateSave::keep_as`), as a store keeps them.
    pub(super) kept_states: HashMap<u64, Vec<u8>>,
    /// Stored states put into slots.
    pub(super) num_state_imports: usize,
    kv: Vec<Option<u32>>,
    /// Per step, per row: the last token that row sampled and the drafts it rejected.
    sampled: HashMap<StepId, Vec<Option<(u32, usize)>>>,
    pub(super) num_from_previous: usize,
    /// The next token given the context read back from the KV.
    pub(super) next: fn(&[u32]) -> u32,
    /// Draft tokens verified and accepted.
    pub(super) num_drafts: usize,
    pub(super) num_accepted: usize,
}

impl Device {
    pub(super) fn new(cfg: &SchedulerConfig) -> Self {
        Self {
            block_size: cfg.block_size,
            window: cfg.num_state_slots.map_or(0, |_| cfg.num_replay_tokens),
            slots: HashMap::new(),
            saved: HashMap::new(),
            num_state_loads: 0,
            kept_states: HashMap::new(),
            num_state_imports: 0,
            kv: vec![None; cfg.num_blocks * cfg.block_size],
            sampled: HashMap::new(),
            num_from_previous: 0,
            next: fake_next,
            num_drafts: 0,
            num_accepted: 0,
        }
    }

    pub(super) fn slot(&self, table: &[u32], pos: usize) -> usize {
        table[pos / self.block_size] as usize * self.block_size + pos % self.block_size
    }

    /// One token per sampling row (no drafts in the plan).
    pub(super) fn execute(&mut self, plan: &StepPlan) -> Vec<u32> {
        self.execute_verified(plan)
            .into_iter()
            .map(|tokens| {
                assert_eq!(tokens.len(), 1, "a row without drafts yields one token");
                tokens[0]
            })
            .collect()
    }

    /// Per sampling row, its tokens: a draft row's accepted drafts (each the target's own
    /// pick at its position) and the target's token after them.
    pub(super) fn execute_verified(&mut self, plan: &StepPlan) -> Vec<Vec<u32>> {
        // Stored blocks first, as a rank fills them before the rows run.
        for load in &plan.kv_loads {
            for (i, t) in load.payload.chunks_exact(4).enumerate() {
                let token = u32::from_le_bytes(t.try_into().expect("4 bytes"));
                self.kv[load.block_id as usize * self.block_size + i] = Some(token);
            }
        }
        for load in &plan.state_loads {
            let state = self.saved[&load.saved].clone();
            assert_eq!(
                state.pos, load.position,
                "a saved state of another position"
            );
            self.slots.insert(load.slot, state);
            self.num_state_loads += 1;
        }
        for import in &plan.state_imports {
            let words: Vec<u32> = import
                .payload
                .chunks_exact(4)
                .map(|w| u32::from_le_bytes(w.try_into().expect("4 bytes")))
                .collect();
            let state = SimSlot {
                pos: words[0] as usize,
                seen: words[1..].iter().copied().collect(),
            };
            assert_eq!(
                state.pos, import.position,
                "a stored state of another position"
            );
            self.slots.insert(import.slot, state);
            self.num_state_imports += 1;
        }
        let mut per_row = vec![None; plan.rows.len()];
        let mut out = Vec::new();
        for (r, row) in plan.rows.iter().enumerate() {
            // A row continuing a verify row moves back by the drafts that row rejected.
            let (input, start) = match &row.input {
                RowInput::Tokens(t) => (t.clone(), row.num_cached_tokens),
                RowInput::FromPrevious {
                    prev_step,
                    prev_row,
                    drafts,
                } => {
                    self.num_from_previous += 1;
                    let (token, num_rejected) =
                        self.sampled[prev_step][*prev_row].expect("previous row sampled");
                    let mut input = vec![token];
                    input.extend_from_slice(drafts);
                    (input, row.num_cached_tokens - num_rejected)
                }
            };
            let end = start + input.len();
            assert!(
                row.block_table.len() * self.block_size >= end,
                "table too short"
            );
            for (k, &t) in input.iter().enumerate() {
                let s = self.slot(&row.block_table, start + k);
                self.kv[s] = Some(t);
            }
            let state = row.state_slot.filter(|_| self.window > 0).map(|slot| {
                let fresh = start == row.state_start;
                let st = self.slots.entry(slot).or_default();
                if fresh {
                    *st = SimSlot {
                        pos: start,
                        seen: VecDeque::new(),
                    };
                }
                assert_eq!(st.pos, start, "slot {slot} continued at another position");
                for &t in &input {
                    st.seen.push_back(t);
                    if st.seen.len() > self.window {
                        st.seen.pop_front();
                    }
                }
                st.pos = end;
                st.seen.clone()
            });
            if row.sample {
                let context: Vec<u32> = (0..end)
                    .map(|p| self.kv[self.slot(&row.block_table, p)].expect("position filled"))
                    .collect();
                let k = row.num_draft_tokens;
                let exact = state.is_none_or(|seen| {
                    seen.iter()
                        .eq(&context[end.saturating_sub(self.window)..end])
                });
                let mut tokens = Vec::new();
                for i in 0..=k {
                    let t = (self.next)(&context[..end - k + i]);
                    let t = if exact { t } else { (t + 1) % VOCAB };
                    tokens.push(t);
                    if i == k || context[end - k + i] != t {
                        break;
                    }
                }
                self.num_drafts += k;
                self.num_accepted += tokens.len() - 1;
                per_row[r] = tokens.last().map(|&t| (t, k + 1 - tokens.len()));
                out.push(tokens);
            }
        }
        for save in &plan.state_saves {
            let state = self.slots[&save.slot].clone();
            assert!(
                state.pos.is_multiple_of(self.block_size),
                "saved off a block boundary"
            );
            if let Some(hash) = save.keep_as {
                let words = std::iter::once(state.pos as u32).chain(state.seen.iter().copied());
                let bytes = words.flat_map(u32::to_le_bytes).collect();
                self.kept_states.insert(hash, bytes);
            }
            self.saved.insert(save.saved, state);
        }
        self.sampled.insert(plan.step_id, per_row);
        out
    }
}

impl Device {
    /// Block `block_id` as a store keeps it (the sim's KV is its tokens).
    pub(super) fn block_payload(&self, block_id: u32) -> Vec<u8> {
        let first = block_id as usize * self.block_size;
        self.kv[first..first + self.block_size]
            .iter()
            .flat_map(|t| t.expect("a saved block is full").to_le_bytes())
            .collect()
    }
}

pub(super) fn fake_secs(plan: &StepPlan) -> f64 {
    1e-3 + plan
        .rows
        .iter()
        .map(|r| r.num_tokens() as f64 * 1e-5)
        .sum::<f64>()
}

#[derive(Default, Debug, PartialEq)]
pub(super) struct Outputs(pub(super) BTreeMap<SeqId, (Vec<u32>, Option<FinishReason>)>);

impl Outputs {
    pub(super) fn merge(&mut self, later: Outputs) {
        for (seq_id, (tokens, reason)) in later.0 {
            let o = self.0.entry(seq_id).or_default();
            assert!(o.1.is_none(), "{seq_id} continued after finishing");
            o.0.extend(tokens);
            o.1 = reason;
        }
    }

    pub(super) fn apply(&mut self, events: Vec<SeqEvent>) {
        for e in events {
            match e {
                SeqEvent::Token { seq_id, token } => {
                    let o = self.0.entry(seq_id).or_default();
                    assert!(o.1.is_none(), "token after finish for {seq_id}");
                    o.0.push(token);
                }
                SeqEvent::Finished { seq_id, reason } => {
                    let o = self.0.entry(seq_id).or_default();
                    assert!(o.1.replace(reason).is_none(), "{seq_id} finished twice");
                }
            }
        }
    }
}

/// Runs until nothing is left, keeping up to `depth` steps in flight (1: ZOS off, 2: on).
/// `hook(scheduler, tick, device_queue)` runs before each tick.
pub(super) fn drive(
    s: &mut Scheduler,
    dev: &mut Device,
    depth: usize,
    mut hook: impl FnMut(&mut Scheduler, usize, &mut VecDeque<StepPlan>),
) -> Outputs {
    let mut outputs = Outputs::default();
    let mut queue: VecDeque<StepPlan> = VecDeque::new();
    for tick in 0.. {
        hook(s, tick, &mut queue);
        if queue.len() < depth
            && let Some(plan) = s.schedule()
        {
            queue.push_back(plan);
            continue;
        }
        match queue.pop_front() {
            Some(plan) => {
                let sampled = dev.execute_verified(&plan);
                let rows: Vec<&[u32]> = sampled.iter().map(Vec::as_slice).collect();
                outputs.apply(s.on_step_verified(plan.step_id, &rows, fake_secs(&plan)));
            }
            None if !s.has_unfinished() => break,
            None => panic!("deadlock at tick {tick}: nothing planned, nothing in flight"),
        }
        assert!(tick < 1_000_000, "no progress");
    }
    outputs
}

pub(super) fn req(seq_id: SeqId, prompt_ids: Vec<u32>, max_tokens: usize) -> SeqRequest {
    SeqRequest {
        seq_id,
        prompt_ids,
        max_tokens,
        stop_ids: vec![STOP],
        ignore_eos: false,
        cache_salt: 0,
        verified_by_picks: true,
        score_prompt: false,
    }
}

pub(super) fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 1 + (seed * 7919 + i * 31) % (VOCAB - 1))
        .collect()
}

pub(super) fn expect_reference(out: &Outputs, reqs: &[SeqRequest], cfg: &SchedulerConfig) {
    expect_reference_with(out, reqs, cfg, fake_next);
}

pub(super) fn expect_reference_with(
    out: &Outputs,
    reqs: &[SeqRequest],
    cfg: &SchedulerConfig,
    next: fn(&[u32]) -> u32,
) {
    for r in reqs {
        let (tokens, reason) = reference_with(r, cfg.max_context_tokens, next);
        assert_eq!(
            out.0.get(&r.seq_id),
            Some(&(tokens, Some(reason))),
            "request {}",
            r.seq_id
        );
    }
}

pub(super) fn assert_idle_and_full(s: &Scheduler) {
    assert!(!s.has_unfinished());
    assert_eq!(s.num_in_flight_steps(), 0);
    assert_eq!(s.num_free_blocks(), s.config().num_blocks, "a block leaked");
    assert_eq!(
        s.num_free_state_slots(),
        s.config().num_state_slots,
        "a slot leaked"
    );
    assert!(
        s.seqs.iter().all(Option::is_none),
        "a sequence record leaked"
    );
    s.check_block_integrity();
}

pub(super) fn small_cfg() -> SchedulerConfig {
    SchedulerConfig {
        block_size: 4,
        num_blocks: 64,
        max_context_tokens: 256,
        ..SchedulerConfig::default()
    }
}
