//! DeepSeek-V4 (seed §5, §8): one forward pass over the cache layout the engine pages
//! (state slots + blocks of compressed entries), on any backend that implements
//! `kernels::deepseek_v4::DsV4Kernels` — the CPU's f32 reference or CUDA.
//!
//! | file | what it is |
//! |---|---|
//! | `config.rs` | `DsV4Config` from transformers' `DeepseekV4Config` JSON |
//! | `weights.rs` | tensors by DeepSeek's names, placed on the backend |
//! | `cache.rs` | state slots (SWA ring, compressor windows, overlap) and paged compressed entries |
//! | `residency.rs` | which routed experts a rank holds; its share loaded, experts read or dropped as EPLB's placement moves them |
//! | `saved_state.rs` | slot states saved at block boundaries, for prefix hits without a replay |
//! | `plan.rs` | a step's rows, sequences and closing windows, made once for all layers |
//! | `embedding.rs` | a step's tokens embedded, from the host's table or, read from the last picks, the device's |
//! | `recorded.rs` | decode steps over fixed-address buffers, recorded once and replayed |
//! | `block.rs` | one block: manifold-constrained hyper-connections around attention and MoE |
//! | `attention.rs` | SWA + CSA (lightning indexer) + HCA attention with sinks, grouped output |
//! | `moe.rs` | hash-routed and score-routed MoE with the shared expert, expert-parallel |
//! | `expert_parallel.rs` | which rank of a group computes which routed product |
//! | `expert_placement.rs` | which routed experts a one-device rank keeps in host memory (`--cpu-moe`, `--n-cpu-moe`, the automatic split) |
//! | `host_experts.rs` | those experts, packed in host memory, computed by the CPU beside the device |
//! | `mtp.rs` | the MTP layer: DeepSeek's `MTPBlock`, drafting tokens from the last streams |
//! | `quantized.rs` | FP8 / packed-FP4 weights with their scale grids, dequantized |
//! | `rope.rs` | the partial RoPE's frequencies (YaRN) |

mod arena;
pub mod attention;
pub mod block;
pub mod cache;
pub mod config;
mod embedding;
pub mod expert_parallel;
pub mod expert_placement;
pub mod expert_streaming;
pub mod expert_table;
mod footprint;
pub mod host_experts;
mod layer_clock;
pub mod moe;
pub mod mtp;
pub mod pass;
mod plan;
pub mod quantized;
mod recorded;
pub mod residency;
pub mod rope;
pub mod saved_state;
pub mod weights;

use std::path::Path;

use cache::{DsV4Cache, SlotSpan};
use config::DsV4Config;
use expert_parallel::ExpertGroup;
use pass::{Consts, Pass};
use plan::Plan;
use weights::{DsV4Weights, HyperConnection, OnBackend};

use crate::error::{Result, TroupeError};
use crate::kernels::cpu::CpuBackend;
use crate::kernels::deepseek_v4::{DsV4Kernels, DsV4Shape};
use crate::model::loader::{SafetensorsSource, TensorSource};

/// One sequence's share of a step.
#[derive(Clone, Copy)]
pub struct DsSeqStep<'a> {
    pub token_ids: &'a [u32],
    /// Tokens the sequence's state slot and blocks already hold.
    pub num_cached_tokens: usize,
    /// Blocks covering at least `num_cached_tokens + token_ids.len()` positions.
    pub block_table: &'a [u32],
    pub state_slot: u32,
    /// The slot's history: a step starting at `span.state_start` starts it afresh (0 for
    /// a new sequence; a prefix hit's replay starts later).
    pub span: SlotSpan,
    /// Trailing positions of `token_ids` that return logits.
    pub num_logit_rows: usize,
}

/// The model on backend `B` (the CPU's f32 reference by default).
pub struct DsV4Model<B: DsV4Kernels = CpuBackend> {
    pub cfg: DsV4Config,
    weights: DsV4Weights<B>,
    consts: Consts<B>,
    /// The embedding on the device (`[vocab, hidden]` f32), where the backend keeps its
    /// picks there: a decode step's ids are read where the last step picked them (ZOS
    /// with no host round trip).
    embed_table: Option<B::Buf>,
    /// Routed experts kept in host memory and computed there (`host_experts.rs`).
    host: Option<host_experts::HostExperts<B>>,
    /// Last: the device buffers above go before it.
    pub backend: B,
}

impl DsV4Model<CpuBackend> {
    pub fn new(cfg: DsV4Config, weights: DsV4Weights<CpuBackend>) -> Self {
        Self::on(CpuBackend::default(), cfg, weights).expect("the CPU takes every shape")
    }

    /// The model of `dir`'s `config.json` with seeded random weights (`--dummy-weights`):
    /// no checkpoint is read.
    pub fn load_dummy_dir(dir: &Path) -> Result<Self> {
        Self::load_dir_on(CpuBackend::default(), dir, true)
    }

    /// An HF directory: `config.json` (model_type `deepseek_v4`) + safetensors.
    pub fn load_dir(dir: &Path) -> Result<Self> {
        Self::load_dir_on(CpuBackend::default(), dir, false)
    }

    pub fn load(cfg: DsV4Config, src: &dyn TensorSource) -> Result<Self> {
        let b = CpuBackend::default();
        let weights = DsV4Weights::load_into(&cfg, src, &OnBackend(&b))?;
        Self::on(b, cfg, weights)
    }
}

impl<B: DsV4Kernels> DsV4Model<B> {
    /// `weights` (placed on `backend`) as a model, once the backend's kernels take its shape.
    pub fn on(backend: B, cfg: DsV4Config, weights: DsV4Weights<B>) -> Result<Self> {
        prepare(&backend, &cfg)?;
        Ok(Self::assemble(backend, cfg, weights))
    }

    /// An HF directory's model on `backend` (`dummy`: seeded random weights made there);
    /// a shape the backend's kernels cannot take is refused before any weight is read.
    pub fn load_dir_on(backend: B, dir: &Path, dummy: bool) -> Result<Self> {
        Self::load_dir_holding(backend, dir, dummy, &weights::hold_all)
    }

    /// `load_dir_on` with only the routed experts `holds` names (an expert-parallel
    /// rank's share).
    pub fn load_dir_holding(
        backend: B,
        dir: &Path,
        dummy: bool,
        holds: &weights::Holds<'_>,
    ) -> Result<Self> {
        let cfg = DsV4Config::from_dir(dir)?;
        prepare(&backend, &cfg)?;
        let store = OnBackend(&backend);
        let src = (!dummy)
            .then(|| SafetensorsSource::open_dir(dir))
            .transpose()?;
        let src = src.as_ref().map(|s| s as &dyn TensorSource);
        let weights = DsV4Weights::load_holding(&cfg, src, &store, holds)?;
        Ok(Self::assemble(backend, cfg, weights))
    }

    /// Holds exactly the routed experts `holds` names from now on: the missing ones read
    /// from `dir`'s checkpoint (`dummy`: made), the others dropped. Returns how many it
    /// read.
    pub fn reside(&mut self, dir: &Path, dummy: bool, holds: &weights::Holds<'_>) -> Result<usize> {
        let src = (!dummy)
            .then(|| SafetensorsSource::open_dir(dir))
            .transpose()?;
        let src = src.as_ref().map(|s| s as &dyn TensorSource);
        let store = OnBackend(&self.backend);
        self.weights.reside(&self.cfg, src, &store, holds)
    }

    fn assemble(backend: B, cfg: DsV4Config, weights: DsV4Weights<B>) -> Self {
        let consts = Consts::new(&backend, &cfg);
        // f32, exactly the host's rows (an f32 checkpoint's or the dummy model's too).
        let embed_table = backend
            .device_picks()
            .is_some()
            .then(|| backend.upload(&weights.embed));
        DsV4Model {
            cfg,
            weights,
            consts,
            embed_table,
            host: None,
            backend,
        }
    }

    /// A cache for this model on its backend.
    pub fn new_cache(
        &self,
        num_slots: usize,
        num_blocks: usize,
        block_size: usize,
    ) -> DsV4Cache<B> {
        DsV4Cache::on(&self.backend, &self.cfg, num_slots, num_blocks, block_size)
    }

    /// What the weights take on the device and the format of each tensor group.
    pub fn footprint(&self) -> crate::model::weights::WeightFootprint {
        let mut out = self.weights.footprint(&self.backend);
        if let Some(host) = &self.host {
            let h = host.footprint();
            out.host_resident_bytes += h.resident_bytes;
            out.groups.extend(h.groups);
        }
        out
    }

    pub fn vocab_size(&self) -> usize {
        self.cfg.vocab_size
    }

    /// Runs every sequence's tokens and returns the logits of their logit rows, in order
    /// (`[Σ num_logit_rows, vocab]`). A sequence starting at its span's start resets its
    /// slot; one starting inside its last verify row (rejected drafts) rewinds to the
    /// snapshot taken before that row and runs the accepted part again; any other start
    /// must continue exactly where its slot stopped.
    pub fn forward(&self, cache: &mut DsV4Cache<B>, steps: &[DsSeqStep<'_>]) -> Result<Vec<f32>> {
        let mut expert_tokens = vec![vec![0; self.cfg.num_routed_experts]; self.cfg.num_layers];
        self.forward_counting(cache, steps, &mut expert_tokens)
    }

    /// `forward`, adding each layer's tokens per routed expert to `expert_tokens`
    /// (`[layers][experts]`): the load statistics EPLB places experts by.
    pub fn forward_counting(
        &self,
        cache: &mut DsV4Cache<B>,
        steps: &[DsSeqStep<'_>],
        expert_tokens: &mut [Vec<u64>],
    ) -> Result<Vec<f32>> {
        self.forward_in_group(cache, steps, expert_tokens, None)
    }

    /// `forward_counting` as one rank of an expert-parallel group (`None`: alone): this
    /// rank's routed products only, summed over the group after each MoE layer. Every rank
    /// of the group runs it with the same steps. (The counts are of all tokens.)
    pub fn forward_in_group(
        &self,
        cache: &mut DsV4Cache<B>,
        steps: &[DsSeqStep<'_>],
        expert_tokens: &mut [Vec<u64>],
        group: Option<&mut ExpertGroup<B>>,
    ) -> Result<Vec<f32>> {
        Ok(self.forward_streams(cache, steps, expert_tokens, group)?.0)
    }

    /// `forward_in_group`, also handing out every position's last-layer streams
    /// (`[Σ tokens, n_hc, hidden]`, before the hyper-head): what the MTP layer reads.
    pub fn forward_streams(
        &self,
        cache: &mut DsV4Cache<B>,
        steps: &[DsSeqStep<'_>],
        expert_tokens: &mut [Vec<u64>],
        group: Option<&mut ExpertGroup<B>>,
    ) -> Result<(Vec<f32>, B::Buf)> {
        let (logits, streams) =
            self.forward_on_device(cache, steps, &[], Some(expert_tokens), group)?;
        let rows: usize = steps.iter().map(|s| s.num_logit_rows).sum();
        let logits = self.backend.download(&logits, rows * self.cfg.vocab_size);
        Ok((logits, streams))
    }

    /// `forward_streams` with the logits left on the device (`[Σ num_logit_rows, vocab]`)
    /// for picks made where they lie. `picked_rows` is empty or, per step, `NOT_PICKED` or
    /// the index of its first token among the backend's last picks (`Backend::embedding`;
    /// only where the embedding table is on the device). The tokens per routed expert are
    /// added to `expert_tokens` when asked for: reading them waits for the step.
    pub fn forward_on_device(
        &self,
        cache: &mut DsV4Cache<B>,
        steps: &[DsSeqStep<'_>],
        picked_rows: &[u32],
        expert_tokens: Option<&mut [Vec<u64>]>,
        mut group: Option<&mut ExpertGroup<B>>,
    ) -> Result<(B::Buf, B::Buf)> {
        let read_back = self.read_back_verify_picks(steps, picked_rows);
        let fixed: Vec<DsSeqStep<'_>>;
        let (steps, picked_rows) = match &read_back {
            Some((tokens, picked)) => {
                fixed = steps
                    .iter()
                    .zip(tokens)
                    .map(|(s, t)| DsSeqStep {
                        token_ids: t.as_deref().unwrap_or(s.token_ids),
                        ..*s
                    })
                    .collect();
                (&fixed[..], &picked[..])
            }
            None => (steps, picked_rows),
        };
        self.settle_slots(cache, steps, group.as_deref_mut())?;
        // A step with host experts is recorded where the backend orders host work in its
        // steps and the host computes every row (none streams its experts).
        let host_recordable = self.host.as_ref().is_none_or(|h| {
            self.backend.host_calls().is_some()
                && h.computes_on_host(steps.len() * self.cfg.num_experts_per_tok)
        });
        let recorder = (group.is_none() && host_recordable)
            .then(|| self.recorder_for(steps))
            .flatten();
        let counted = expert_tokens.is_some();
        tracing::trace!(rows = steps.len(), recorded = recorder.is_some(), "step");
        let (logits, streams, counts) = match recorder {
            Some(recorder) => self.forward_recorded(recorder, cache, steps, picked_rows, counted),
            None => self.forward_eager(cache, steps, picked_rows, counted, group),
        };
        for s in steps {
            cache.set_slot_tokens(
                s.state_slot as usize,
                s.num_cached_tokens + s.token_ids.len(),
            );
        }
        let experts = self.cfg.num_routed_experts;
        if let (Some(expert_tokens), Some(counts)) = (expert_tokens, counts) {
            for (layer, row) in expert_tokens.iter_mut().zip(counts.chunks_exact(experts)) {
                layer
                    .iter_mut()
                    .zip(row)
                    .for_each(|(n, &c)| *n += u64::from(c));
            }
        }
        Ok((logits, streams))
    }

    /// `forward_on_device`'s blocks and head for any steps (slots settled), each op
    /// launched as the pass reaches it: the logits, the streams and, when `counted`, the
    /// tokens per routed expert (`[layers, experts]`).
    fn forward_eager(
        &self,
        cache: &mut DsV4Cache<B>,
        steps: &[DsSeqStep<'_>],
        picked_rows: &[u32],
        counted: bool,
        mut group: Option<&mut ExpertGroup<B>>,
    ) -> (B::Buf, B::Buf, Option<Vec<u32>>) {
        let (b, cfg) = (&self.backend, &self.cfg);
        let (d, n_hc) = (cfg.hidden_size, cfg.hc_mult);
        let mut plan = Plan::new(b, cfg, cache.block_size, steps);
        let tokens = plan.num_rows();
        let mut embedded = b.scratch(tokens * d);
        self.embed_into(steps, &mut plan, picked_rows, &mut embedded);
        let mut streams = b.scratch(tokens * n_hc * d);
        b.dsv4_expand(&mut streams, &embedded, tokens, n_hc, d);
        let pass = Pass {
            b,
            cfg,
            consts: &self.consts,
            plan: &plan,
            host: self.host.as_ref(),
            host_calls: None,
        };
        let num_counts = cfg.num_layers * cfg.num_routed_experts;
        let mut counts = b.alloc_ids(num_counts);
        let mut clock = layer_clock::enabled().then(|| {
            layer_clock::settle(b, &streams);
            layer_clock::LayerClock::start()
        });
        for (l, w) in self.weights.layers.iter().enumerate() {
            block::block(
                &pass,
                l,
                w,
                cache,
                &mut streams,
                &mut counts,
                group.as_deref_mut(),
            );
            if let Some(clock) = clock.as_mut() {
                layer_clock::settle(b, &streams);
                clock.lap(self.host.as_ref().is_some_and(|h| h.has_layer(l)));
            }
        }
        if let Some(clock) = &clock {
            clock.report(tokens);
        }

        // Only the logit rows go through the head.
        let mut picked = Vec::new();
        let mut row0 = 0;
        for s in steps {
            let len = s.token_ids.len();
            picked.extend(row0 + len - s.num_logit_rows.min(len)..row0 + len);
            row0 += len;
        }
        let mut last = b.scratch(picked.len() * n_hc * d);
        b.gather_rows(&streams, n_hc * d, &picked, &mut last);
        let mut logits = b.scratch(picked.len() * cfg.vocab_size);
        let (head, norm) = (&self.weights.hc_head, &self.weights.norm);
        self.logits_into(head, norm, &last, picked.len(), &mut logits);
        let counts = counted.then(|| {
            let mut counts = b.download_ids(&counts, num_counts);
            if let Some(host) = &self.host {
                counts
                    .iter_mut()
                    .zip(host.take_counts())
                    .for_each(|(c, h)| *c += h);
            }
            counts
        });
        (logits, streams, counts)
    }

    /// Checks `steps` against `cache` and readies each one's state slot: restarted for a
    /// fresh history, rewound and replayed where drafts were rejected, snapshotted before
    /// a verify row.
    fn settle_slots(
        &self,
        cache: &mut DsV4Cache<B>,
        steps: &[DsSeqStep<'_>],
        mut group: Option<&mut ExpertGroup<B>>,
    ) -> Result<()> {
        let (b, cfg) = (&self.backend, &self.cfg);
        check_steps(
            cfg,
            steps,
            (cache.num_slots(), cache.num_blocks, cache.block_size),
            |slot| SlotView {
                span: cache.span(slot),
                num_tokens: cache.slot_tokens(slot),
                snapshot: cache.snapshot_span(slot),
            },
        )?;

        for s in steps {
            let slot = s.state_slot as usize;
            if s.num_cached_tokens == s.span.state_start {
                cache.restart(slot, s.span);
            } else if s.num_cached_tokens < cache.slot_tokens(slot) {
                // The state before the verify row, then its accepted tokens again.
                let snap = cache.rewind_on(b, slot).expect("checked above");
                let accepted = &snap.token_ids[..s.num_cached_tokens - snap.position];
                if !accepted.is_empty() {
                    let replay = DsSeqStep {
                        token_ids: accepted,
                        num_cached_tokens: snap.position,
                        block_table: s.block_table,
                        state_slot: s.state_slot,
                        span: s.span,
                        num_logit_rows: 1,
                    };
                    let mut scratch = vec![vec![0; cfg.num_routed_experts]; cfg.num_layers];
                    self.forward_in_group(cache, &[replay], &mut scratch, group.as_deref_mut())?;
                }
            }
            if s.num_logit_rows > 1 {
                cache.snapshot_on(b, slot, s.token_ids);
            } else {
                cache.clear_snapshot(slot);
            }
        }
        Ok(())
    }

    /// The head over `rows` last-layer streams (`[rows, n_hc, hidden]`) collapsed by
    /// `hc_head` and normed by `norm` (the model's own, or its MTP layer's): `[rows, vocab]`.
    pub fn logits(
        &self,
        hc_head: &HyperConnection<B>,
        norm: &B::Buf,
        streams: &B::Buf,
        rows: usize,
    ) -> Vec<f32> {
        let mut logits = self.backend.scratch(rows * self.cfg.vocab_size);
        self.logits_into(hc_head, norm, streams, rows, &mut logits);
        self.backend.download(&logits, rows * self.cfg.vocab_size)
    }

    /// `logits`, left on the device in `out`.
    fn logits_into(
        &self,
        hc_head: &HyperConnection<B>,
        norm: &B::Buf,
        streams: &B::Buf,
        rows: usize,
        out: &mut B::Buf,
    ) {
        let b = &self.backend;
        let h = block::hyper_head(b, &self.cfg, &self.consts, hc_head, norm, streams, rows);
        b.matmul(&h, rows, &self.weights.head, None, out);
    }

    /// Token `id`'s embedding row.
    pub fn embedding(&self, id: u32) -> &[f32] {
        let d = self.cfg.hidden_size;
        &self.weights.embed[id as usize * d..(id as usize + 1) * d]
    }

    /// What a pass's blocks share, for a layer run outside `forward` (the MTP block).
    pub(crate) fn pass<'a>(&'a self, cfg: &'a DsV4Config, plan: &'a Plan<B>) -> Pass<'a, B> {
        Pass {
            b: &self.backend,
            cfg,
            consts: &self.consts,
            plan,
            // The MTP block holds all its experts on the device.
            host: None,
            host_calls: None,
        }
    }
}

/// Readies `b`'s kernels for `cfg`'s shape, or names the dimension they cannot take.
fn prepare<B: DsV4Kernels>(b: &B, cfg: &DsV4Config) -> Result<()> {
    let shape = DsV4Shape {
        hc_mult: cfg.hc_mult,
        num_routed_experts: cfg.num_routed_experts,
        num_experts_per_tok: cfg.num_experts_per_tok,
        head_dim: cfg.head_dim,
        index_width: cfg.index_n_heads * cfg.index_head_dim,
        index_head_dim: cfg.index_head_dim,
    };
    b.dsv4_prepare(&shape)
        .map_err(|e| TroupeError::InvalidInput(e.to_string()))
}

/// What checking a step needs to know of a state slot.
pub struct SlotView {
    pub span: SlotSpan,
    pub num_tokens: usize,
    /// The tokens its last verify row covers, when it can rewind into it.
    pub snapshot: Option<(usize, usize)>,
}

/// Refuses, naming the sequence, a step that does not fit the cache it runs on
/// (`(slots, blocks, block_size)`): a slot out of range or continued with another history,
/// a start the slot cannot resume from, a block table too short, a token outside the
/// vocabulary.
pub fn check_steps(
    cfg: &DsV4Config,
    steps: &[DsSeqStep<'_>],
    (num_slots, num_blocks, block_size): (usize, usize, usize),
    slot_view: impl Fn(usize) -> SlotView,
) -> Result<()> {
    for (i, s) in steps.iter().enumerate() {
        let slot = s.state_slot as usize;
        if slot >= num_slots {
            return Err(TroupeError::InvalidInput(format!(
                "sequence {i}: state slot {slot} outside the {num_slots} slots"
            )));
        }
        let view = slot_view(slot);
        let fresh = s.num_cached_tokens == s.span.state_start;
        let held = if fresh {
            s.span.state_start
        } else {
            view.num_tokens
        };
        if !fresh && view.span != s.span {
            return Err(TroupeError::InvalidInput(format!(
                "sequence {i}: continues state slot {slot} with history {:?}, but the slot holds {:?}",
                s.span, view.span
            )));
        }
        // Drafts of the slot's last verify row were rejected: back to before it.
        let rewinds = !fresh
            && s.num_cached_tokens < held
            && view
                .snapshot
                .is_some_and(|(from, to)| from <= s.num_cached_tokens && s.num_cached_tokens <= to);
        if held != s.num_cached_tokens && !rewinds {
            return Err(TroupeError::InvalidInput(format!(
                "sequence {i}: starts at token {} but its state slot holds {held} tokens \
                 (DeepSeek-V4 state rewinds only into its last verify row)",
                s.num_cached_tokens
            )));
        }
        let needed = (s.num_cached_tokens + s.token_ids.len()).div_ceil(block_size);
        if s.block_table.len() < needed || s.block_table.iter().any(|&b| b as usize >= num_blocks) {
            return Err(TroupeError::InvalidInput(format!(
                "sequence {i}: block table of {} blocks does not cover {} tokens in a pool of {num_blocks}",
                s.block_table.len(),
                s.num_cached_tokens + s.token_ids.len(),
            )));
        }
        if let Some(&bad) = s.token_ids.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            return Err(TroupeError::InvalidInput(format!(
                "sequence {i}: token id {bad} outside the vocabulary of {}",
                cfg.vocab_size
            )));
        }
    }
    Ok(())
}
