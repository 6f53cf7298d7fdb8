//! Decode steps as recorded graphs (the backend's `StepRecorder`): a step of one token a
//! sequence runs over buffers the cache keeps at fixed addresses — the plan's lists, the
//! embedded tokens, the streams, the logits and the expert counts — so that, recorded
//! once per (rows, indexer span), every later step of that shape is one replay. Only the
//! host's work outside the blocks remains per step: the plan's lists written in, the
//! embedding gathered (on the device, from the last picks where they lie), the logits
//! copied out for the picks — and, with routed experts in host memory and a backend that
//! orders host work in its steps (`HostCalls`), their products, served while the replay
//! runs.

use std::hash::{DefaultHasher, Hash, Hasher};

use super::arena::DecodeArena;
use super::block;
use super::cache::DsV4Cache;
use super::pass::Pass;
use super::{DsSeqStep, DsV4Model};
use crate::kernels::StepRecorder;
use crate::kernels::deepseek_v4::DsV4Kernels;

/// The most rows a recorded step takes; wider decode steps run eagerly.
pub const MAX_RECORDED_ROWS: usize = 256;

impl<B: DsV4Kernels> DsV4Model<B> {
    /// The recorder a step of `steps` may run through: decode rows only (one token, one
    /// logit row each), few enough, on a backend that records.
    pub(super) fn recorder_for(&self, steps: &[DsSeqStep<'_>]) -> Option<&dyn StepRecorder> {
        let decode = steps
            .iter()
            .all(|s| s.token_ids.len() == 1 && s.num_logit_rows == 1);
        let rows = steps.len();
        (decode && (1..=MAX_RECORDED_ROWS).contains(&rows))
            .then(|| self.backend.recorder())
            .flatten()
    }

    /// `forward_eager` for decode `steps` (slots settled) through `recorder`, over the
    /// cache's arena: copies of the logits and the streams, and, when `counted`, the
    /// tokens per expert.
    pub(super) fn forward_recorded(
        &self,
        recorder: &dyn StepRecorder,
        cache: &mut DsV4Cache<B>,
        steps: &[DsSeqStep<'_>],
        picked_rows: &[u32],
        counted: bool,
    ) -> (B::Buf, B::Buf, Option<Vec<u32>>) {
        let (b, cfg) = (&self.backend, &self.cfg);
        let (d, n_hc) = (cfg.hidden_size, cfg.hc_mult);
        let rows = steps.len();
        let host = self.host.as_ref();
        let host_calls = host.and(b.host_calls());
        let tables: usize = steps.iter().map(|s| s.block_table.len()).sum();
        let mut arena = match cache.decode.take() {
            Some(a) if a.fits(rows, tables) => a,
            old => {
                let rows_capacity = cache.num_slots().clamp(rows, MAX_RECORDED_ROWS);
                let tables_capacity = old
                    .map_or(0, |a| a.tables_capacity)
                    .max(tables.next_power_of_two())
                    .max(rows_capacity * 16);
                // Steps recorded over the old arena would write into freed buffers.
                recorder.forget_recorded();
                if let Some(calls) = host_calls {
                    let (d, k) = (cfg.hidden_size, cfg.num_experts_per_tok);
                    let rows = rows_capacity;
                    calls.reserve_host_calls(rows * d, rows * k, rows * k * d);
                }
                Box::new(DecodeArena::new(self, rows_capacity, tables_capacity))
            }
        };
        arena.plan.refill(b, cfg, cache.block_size, steps);
        // Outside the recording: the ids (or the picks they are read from) change.
        let a = &mut *arena;
        self.embed_into(steps, &mut a.plan, picked_rows, &mut a.embedded);

        let mut key = DefaultHasher::new();
        (&raw const *arena as usize, rows, arena.plan.index_span).hash(&mut key);
        let a = &mut *arena;
        let mut body = || {
            b.zero_ids(&mut a.counts);
            b.dsv4_expand(&mut a.streams, &a.embedded, rows, n_hc, d);
            let pass = Pass {
                host,
                host_calls,
                b,
                cfg,
                consts: &self.consts,
                plan: &a.plan,
            };
            for (l, w) in self.weights.layers.iter().enumerate() {
                block::block(&pass, l, w, cache, &mut a.streams, &mut a.counts, None);
            }
            let (head, norm) = (&self.weights.hc_head, &self.weights.norm);
            self.logits_into(head, norm, &a.streams, rows, &mut a.logits);
        };
        let key = key.finish();
        tracing::trace!(rows, key, "recorded step launched");
        recorder.run_recorded(key, &mut body);
        if let (Some(h), Some(calls)) = (host, host_calls) {
            let dims = (rows, cfg.num_experts_per_tok, d, cfg.swiglu_limit);
            calls
                .serve_host_calls(&mut |layer, x, chosen, ys| {
                    h.compute_into(layer as usize, x, chosen, dims, ys);
                })
                .unwrap_or_else(|e| panic!("a recorded step's host experts: {e}"));
            tracing::trace!(rows, "recorded step's host calls served");
        }

        // The arena's buffers are the next step's: the caller gets its own copies.
        let all: Vec<usize> = (0..rows).collect();
        let mut logits = b.scratch(rows * cfg.vocab_size);
        b.gather_rows(&arena.logits, cfg.vocab_size, &all, &mut logits);
        let mut streams = b.scratch(rows * n_hc * d);
        b.gather_rows(&arena.streams, n_hc * d, &all, &mut streams);
        let counts = counted.then(|| {
            let mut counts = b.download_ids(&arena.counts, cfg.num_layers * cfg.num_routed_experts);
            if let Some(h) = host {
                counts
                    .iter_mut()
                    .zip(h.take_counts())
                    .for_each(|(c, n)| *c += n);
            }
            counts
        });
        cache.decode = Some(arena);
        (logits, streams, counts)
    }
}
