//! One sequence's grammar state. The host's sampler masks a row with it and then hands the
//! drawn token to the mask pool, which advances the matcher and computes the next mask
//! while the next forward pass runs; a row drawn on the device is masked by the rank with
//! the bits after its history (`allowed_bits`), computed after the pass is launched. When
//! nothing is allowed, the stop ids are (with their own logits), so the sequence ends.

use crate::sync::Shared as Arc;
use crate::sync::{BusyCell, OnceLock};

use llguidance::Matcher;
use llguidance::toktrie::SimpleVob;

use super::{CompiledGrammar, unless_panic};

/// Threads computing masks beside the forward pass.
const MASK_THREADS: usize = 2;

fn mask_pool() -> &'static rayon::ThreadPool {
    static POOL: OnceLock<rayon::ThreadPool> = OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(MASK_THREADS)
            .thread_name(|i| format!("troupe-mask-{i}"))
            // rayon aborts the process on a task's panic without a handler; the tasks
            // catch their own, this is the last line.
            .panic_handler(|p| {
                tracing::error!("a mask task panicked: {}", super::panic_message(p.as_ref()))
            })
            .build()
            .expect("the mask pool's threads start")
    })
}

pub struct SeqConstraint {
    /// Busy while a pool task brings the matcher forward: wait for it, never race it.
    state: BusyCell<State>,
    eos_id: u32,
    /// Ids that end the sequence: allowed wherever the grammar allows its end.
    stop_ids: Arc<[u32]>,
}

impl std::fmt::Debug for SeqConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SeqConstraint")
            .field("num_seen", &self.state.with_current(|st| st.seen.len()))
            .finish()
    }
}

struct State {
    matcher: Matcher,
    /// The generated tokens the matcher has seen, stop ids included (not consumed).
    seen: Vec<u32>,
    /// The mask for `seen`, once computed.
    mask: Option<SimpleVob>,
    /// The matcher panicked: nothing is allowed from here on, so the sequence ends.
    failed: bool,
}

impl State {
    fn fail(&mut self, why: &str) {
        tracing::error!("the grammar matcher panicked ({why}); its sequence ends here");
        self.failed = true;
        self.mask = Some(SimpleVob::new());
    }
}

impl SeqConstraint {
    /// A fresh matcher for `grammar`; the first mask is computed at once on the pool,
    /// beside the prompt's prefill.
    pub fn start(grammar: &CompiledGrammar, eos_id: u32, stop_ids: Arc<[u32]>) -> Arc<Self> {
        let c = Arc::new(SeqConstraint {
            state: BusyCell::new(State {
                matcher: Matcher::new(Ok(grammar.parser.clone())),
                seen: Vec::new(),
                mask: None,
                failed: false,
            }),
            eos_id,
            stop_ids,
        });
        c.advance(Vec::new());
        c
    }

    /// Moves the matcher to `history` and computes its mask, on the pool.
    pub fn advance(self: &Arc<Self>, history: Vec<u32>) {
        self.state.mark_busy();
        let me = self.clone();
        mask_pool().spawn(move || {
            me.state.finish(|st| {
                let advanced = unless_panic(|| {
                    me.sync(st, &history);
                    if st.mask.is_none() {
                        st.mask = Some(compute_mask(&mut st.matcher));
                    }
                });
                if let Err(why) = advanced {
                    st.fail(&why);
                }
            })
        });
    }

    /// Sets the logits of every token the grammar forbids after `history` to −∞.
    pub fn mask_logits(&self, history: &[u32], logits: &mut [f32]) {
        let bits = self.allowed_bits(history, logits.len());
        mask_with_bits(&bits, logits);
    }

    /// The ids of `0..vocab` the grammar allows after `history`, one bit each (bit `id % 32`
    /// of word `id / 32`): the mask `mask_logits` applies, for a sampler elsewhere (the
    /// device's).
    pub fn allowed_bits(&self, history: &[u32], vocab: usize) -> Vec<u32> {
        self.state.with_idle(|st| {
            unless_panic(|| self.bits_with(st, history, vocab)).unwrap_or_else(|why| {
                st.fail(&why);
                self.bits_with(st, history, vocab)
            })
        })
    }

    fn bits_with(&self, st: &mut State, history: &[u32], vocab: usize) -> Vec<u32> {
        if !st.failed {
            self.sync(st, history);
        }
        let mask = st.mask.get_or_insert_with(|| compute_mask(&mut st.matcher));
        let mask_len = mask.len().min(vocab);
        let ends = mask_len > self.eos_id as usize && mask.is_allowed(self.eos_id);
        let mut bits = vec![0u32; vocab.div_ceil(32)];
        let mut num_allowed = 0usize;
        for id in 0..mask_len {
            if mask.is_allowed(id as u32) {
                bits[id / 32] |= 1 << (id % 32);
                num_allowed += 1;
            }
        }
        // Stop ids end the sequence wherever the grammar may end, and only there.
        for &id in self.stop_ids.iter() {
            let id = id as usize;
            if id < vocab {
                let was = bits[id / 32] >> (id % 32) & 1 == 1;
                match (was, ends) {
                    (false, true) => {
                        bits[id / 32] |= 1 << (id % 32);
                        num_allowed += 1;
                    }
                    (true, false) => {
                        bits[id / 32] &= !(1 << (id % 32));
                        num_allowed -= 1;
                    }
                    _ => {}
                }
            }
        }
        if num_allowed == 0 {
            // A grammar in an error state, or one whose end is banned: end the sequence
            // rather than draw from nothing (EOS where no stop id is left: `ignore_eos`),
            // and never hand a sampler a row without one id to draw.
            let stops: Vec<u32> = self
                .stop_ids
                .iter()
                .copied()
                .filter(|&id| (id as usize) < vocab)
                .collect();
            let ends = match stops.is_empty() {
                false => stops,
                true if (self.eos_id as usize) < vocab => vec![self.eos_id],
                true => (0..vocab as u32).collect(),
            };
            for id in ends {
                bits[id as usize / 32] |= 1 << (id % 32);
            }
        }
        bits
    }

    /// Brings the matcher to `history` by rolling back to the common prefix and
    /// consuming the rest (a restarted step or a preemption may replay tokens).
    fn sync(&self, st: &mut State, history: &[u32]) {
        let common = st
            .seen
            .iter()
            .zip(history)
            .take_while(|(a, b)| a == b)
            .count();
        if common == st.seen.len() && common == history.len() {
            return;
        }
        let num_undo = st.seen[common..]
            .iter()
            .filter(|t| !self.stop_ids.contains(t))
            .count();
        if num_undo > 0 && st.matcher.rollback(num_undo).is_err() {
            // Matcher::rollback leaves an error state on failure; masks then end the
            // sequence.
        }
        for &t in &history[common..] {
            if !self.stop_ids.contains(&t) {
                let _ = st.matcher.consume_token(t);
            }
        }
        st.seen.truncate(common);
        st.seen.extend_from_slice(&history[common..]);
        st.mask = None;
    }
}

/// Whether mask `bits` (`SeqConstraint::allowed_bits`' layout) allows `id`.
pub fn allows(bits: &[u32], id: u32) -> bool {
    bits.get(id as usize / 32)
        .is_some_and(|w| w >> (id % 32) & 1 == 1)
}

/// Sets the logits of the ids mask `bits` forbids to −∞.
pub fn mask_with_bits(bits: &[u32], logits: &mut [f32]) {
    for (id, logit) in logits.iter_mut().enumerate() {
        if !allows(bits, id as u32) {
            *logit = f32::NEG_INFINITY;
        }
    }
}

fn compute_mask(matcher: &mut Matcher) -> SimpleVob {
    matcher.compute_mask_or_eos().unwrap_or_else(|_| {
        // Nothing allowed: `mask_logits` then allows only the stop ids.
        SimpleVob::new()
    })
}
