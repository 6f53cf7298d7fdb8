//! `--spec mtp`: DeepSeek-V4's MTP layer drafting for the verify rows of a DeepSeek-V4
//! rank. MTP position `i` needs the model's last streams at `i` and the token at `i + 1`,
//! so each slot keeps the streams of the positions whose next token was not known when
//! they were computed (a step's last position; a verify row's every position, until the
//! sampler says which drafts were accepted). Before a step, a verify row's pending
//! positions up to its first token are run through the MTP layer (its cache advances
//! only over accepted tokens); the last gives the first draft, and each further draft
//! feeds the block's own streams back, on a snapshot of the slot's MTP cache that is
//! rewound afterwards. After the step, every row's positions whose next token is known
//! are run, so a prefill chunk leaves one pending position behind.

use crate::kernels::cpu::CpuBackend;
use crate::kernels::deepseek_v4::DsV4Kernels;
use crate::model::deepseek_v4::cache::DsV4Cache;
use crate::model::deepseek_v4::mtp::MtpLayer;
use crate::model::deepseek_v4::{DsSeqStep, DsV4Model};

use super::draft::greedy;

/// One slot's positions `pos0 ..` with their streams (on the host: a few positions a slot,
/// uploaded when they run) and tokens, not yet run through the MTP layer; its MTP cache
/// holds the positions before `pos0`.
#[derive(Default)]
struct Pending {
    pos0: usize,
    streams: Vec<f32>,
    tokens: Vec<u32>,
}

pub(super) struct MtpDrafter<B: DsV4Kernels = CpuBackend> {
    layer: MtpLayer<B>,
    cache: DsV4Cache<B>,
    slots: Vec<Pending>,
    /// `[n_hc · hidden]`: the floats of one position's streams.
    width: usize,
}

impl<B: DsV4Kernels> MtpDrafter<B> {
    pub fn new(layer: MtpLayer<B>, model: &DsV4Model<B>, num_slots: usize) -> Self {
        MtpDrafter {
            cache: layer.new_cache_on(&model.backend, num_slots),
            width: layer.stream_width(),
            layer,
            slots: (0..num_slots).map(|_| Pending::default()).collect(),
        }
    }

    /// Starts `slot`'s MTP history at `position` (a new sequence, or a slot whose main
    /// state was put there whole: it has seen none of the positions before).
    pub(super) fn restart(&mut self, slot: usize, position: usize) {
        MtpLayer::restart(&mut self.cache, slot, position);
        self.slots[slot] = Pending {
            pos0: position,
            ..Pending::default()
        };
    }

    /// Lines a row's slot up with where the row starts: a new history restarts it; rejected
    /// drafts leave the pending positions; a slot that cannot continue (nothing the MTP
    /// layer could be fed) restarts at the row, with no drafts from it until it has seen
    /// a position.
    fn sync(&mut self, s: &DsSeqStep<'_>) {
        let slot = s.state_slot as usize;
        let start = s.num_cached_tokens;
        if start == s.span.state_start {
            return self.restart(slot, start);
        }
        let p = &mut self.slots[slot];
        let held = p.pos0 + p.tokens.len();
        if p.pos0 > start || held < start {
            return self.restart(slot, start);
        }
        let keep = start - p.pos0;
        p.tokens.truncate(keep);
        p.streams.truncate(keep * self.width);
    }

    /// Runs `count` pending positions of `slot` whose next tokens are the pending tokens
    /// after them and then `next`; returns the block's output streams.
    fn run_pending(
        &mut self,
        model: &DsV4Model<B>,
        slot: usize,
        count: usize,
        next: Option<u32>,
    ) -> B::Buf {
        let p = &mut self.slots[slot];
        let mut next_ids: Vec<u32> = p.tokens[1..(count + 1).min(p.tokens.len())].to_vec();
        next_ids.extend(next);
        debug_assert_eq!(next_ids.len(), count);
        let out = self.layer.forward(
            model,
            &mut self.cache,
            slot,
            p.pos0,
            &model.backend.upload(&p.streams[..count * self.width]),
            &next_ids,
        );
        p.tokens.drain(..count);
        p.streams.drain(..count * self.width);
        p.pos0 += count;
        out
    }

    /// Per row: `num_drafts[i]` greedy drafts with their MTP probabilities for a row whose
    /// last `num_drafts[i]` tokens are placeholders (token 0 at probability 0 where the
    /// layer has nothing to draft from); empty for the others. Call for every row of
    /// every step: it also follows each slot's history.
    pub fn propose(
        &mut self,
        model: &DsV4Model<B>,
        steps: &[DsSeqStep<'_>],
        num_drafts: &[usize],
    ) -> Vec<Vec<(u32, f32)>> {
        steps
            .iter()
            .zip(num_drafts)
            .map(|(s, &k)| {
                self.sync(s);
                if k == 0 {
                    return Vec::new();
                }
                let slot = s.state_slot as usize;
                let pending = self.slots[slot].tokens.len();
                // A verify row carries one known token: the pending positions end right
                // before it.
                if s.token_ids.len() != k + 1 || pending == 0 {
                    return vec![(0, 0.0); k];
                }
                let out = self.run_pending(model, slot, pending, Some(s.token_ids[0]));
                let b = &model.backend;
                let last = (pending - 1) * self.width..pending * self.width;
                let mut h = b.upload(&b.read_floats(&out, last));
                let mut drafts = vec![greedy(&self.layer.logits_on(model, &h, 1))];
                if k > 1 {
                    let position = s.num_cached_tokens;
                    self.cache.snapshot_on(b, slot, &[]);
                    for j in 1..k {
                        let prev = drafts[j - 1].0;
                        h = self.layer.forward(
                            model,
                            &mut self.cache,
                            slot,
                            position + j - 1,
                            &h,
                            &[prev],
                        );
                        drafts.push(greedy(&self.layer.logits_on(model, &h, 1)));
                    }
                    self.cache.rewind_on(b, slot);
                }
                drafts
            })
            .collect()
    }

    /// After the model's pass over `steps` (drafts filled in) with last-layer `streams`
    /// (`[Σ tokens, n_hc, hidden]`): each row's positions join its slot's pending ones,
    /// and those whose next token is known (all but a row's last known token and its
    /// drafts) run through the MTP layer.
    pub fn absorb(
        &mut self,
        model: &DsV4Model<B>,
        steps: &[DsSeqStep<'_>],
        num_drafts: &[usize],
        streams: &B::Buf,
    ) {
        let mut row0 = 0;
        for (s, &k) in steps.iter().zip(num_drafts) {
            let n = s.token_ids.len();
            let slot = s.state_slot as usize;
            let p = &mut self.slots[slot];
            debug_assert_eq!(p.pos0 + p.tokens.len(), s.num_cached_tokens);
            p.tokens.extend_from_slice(s.token_ids);
            let rows = row0 * self.width..(row0 + n) * self.width;
            p.streams.extend(model.backend.read_floats(streams, rows));
            row0 += n;
            let known_end = s.num_cached_tokens + n - k;
            let count = (known_end - 1).saturating_sub(p.pos0);
            if count > 0 {
                self.run_pending(model, slot, count, None);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::model::deepseek_v4::cache::{SlotSpan, lcm_rates};

    fn checkpoint() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/goldens/tiny-dsv4-a")
    }

    /// A model, its cache and an MTP drafter for one sequence in slot 0.
    struct Rank {
        model: DsV4Model,
        cache: DsV4Cache,
        mtp: MtpDrafter,
        table: Vec<u32>,
    }

    impl Rank {
        fn new() -> Self {
            let model = DsV4Model::load_dir(&checkpoint()).unwrap();
            let block_size = lcm_rates(&model.cfg);
            let cache = DsV4Cache::new(&model.cfg, 1, 64 / block_size, block_size);
            let layer = MtpLayer::load_dir(&model.cfg, &checkpoint()).unwrap();
            let mtp = MtpDrafter::new(layer, &model, 1);
            let table = (0..(64 / block_size) as u32).collect();
            Rank {
                model,
                cache,
                mtp,
                table,
            }
        }

        /// One step of `known` tokens and `k` drafts at `position`: the drafts, and the
        /// model's argmax after the known tokens.
        fn step(&mut self, known: &[u32], k: usize, position: usize) -> (Vec<(u32, f32)>, u32) {
            let placeholders: Vec<u32> = known.iter().copied().chain(vec![0; k]).collect();
            let mut s = DsSeqStep {
                token_ids: &placeholders,
                num_cached_tokens: position,
                block_table: &self.table,
                state_slot: 0,
                span: SlotSpan::default(),
                num_logit_rows: k + 1,
            };
            let drafts = self
                .mtp
                .propose(&self.model, std::slice::from_ref(&s), &[k])
                .remove(0);
            let filled: Vec<u32> = known
                .iter()
                .copied()
                .chain(drafts.iter().map(|d| d.0))
                .collect();
            s.token_ids = &filled;
            let mut loads = vec![vec![0; self.model.cfg.num_routed_experts]; 5];
            let (logits, streams) = self
                .model
                .forward_streams(&mut self.cache, std::slice::from_ref(&s), &mut loads, None)
                .unwrap();
            self.mtp
                .absorb(&self.model, std::slice::from_ref(&s), &[k], &streams);
            let vocab = self.model.vocab_size();
            (drafts, greedy(&logits[..vocab]).0)
        }
    }

    fn reference() -> (Vec<u32>, Vec<u32>) {
        let read = |f: &str| -> serde_json::Value {
            serde_json::from_str(&std::fs::read_to_string(checkpoint().join(f)).unwrap()).unwrap()
        };
        let ids = |v: &serde_json::Value| -> Vec<u32> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect()
        };
        (
            ids(&read("reference.json")["greedy_prompt"]),
            ids(&read("mtp_reference.json")["drafts"]),
        )
    }

    #[test]
    fn drafts_after_a_prefill_are_the_reference_chain() {
        let (prompt, want) = reference();
        let mut rank = Rank::new();
        let (_, first) = rank.step(&prompt, 0, 0);
        let (drafts, _) = rank.step(&[first], want.len(), prompt.len());
        let tokens: Vec<u32> = drafts.iter().map(|d| d.0).collect();
        assert_eq!(tokens, want);
        assert!(drafts.iter().all(|d| d.1 > 0.0 && d.1 <= 1.0), "{drafts:?}");
    }

    /// After a verify row with `accepted` drafts taken, the next drafts equal those of a
    /// rank that saw the accepted tokens as one prefill: the MTP layer's cache holds the
    /// accepted positions only, computed from the model's own streams.
    #[test]
    fn drafts_after_rejections_equal_a_cold_run() {
        let (prompt, _) = reference();
        let k = 3;
        for accepted in 0..=k {
            let mut warm = Rank::new();
            let (_, first) = warm.step(&prompt, 0, 0);
            let (drafts, _) = warm.step(&[first], k, prompt.len());
            let correction = 7;
            let mut history = prompt.clone();
            history.push(first);
            history.extend(drafts[..accepted].iter().map(|d| d.0));
            let (got, _) = warm.step(&[correction], k, history.len());

            let mut cold = Rank::new();
            cold.step(&history, 0, 0);
            let (want, _) = cold.step(&[correction], k, history.len());
            let tokens = |d: &[(u32, f32)]| d.iter().map(|x| x.0).collect::<Vec<_>>();
            assert_eq!(tokens(&got), tokens(&want), "{accepted} accepted");
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (g.1 - w.1).abs() < 1e-5,
                    "{accepted} accepted: {got:?} vs {want:?}"
                );
            }
        }
    }
}
