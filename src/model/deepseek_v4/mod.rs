//! DeepSeek-V4 (seed §5, §8): the f32 host reference of the forward pass, over the cache
//! layout the engine pages (state slots + blocks of compressed entries).
//!
//! | file | what it is |
//! |---|---|
//! | `config.rs` | `DsV4Config` from transformers' `DeepseekV4Config` JSON |
//! | `weights.rs` | tensors by DeepSeek's names |
//! | `cache.rs` | state slots (SWA ring, compressor windows, overlap) and paged compressed entries |
//! | `attention.rs` | SWA + CSA (lightning indexer) + HCA attention with sinks, grouped output |
//! | `mhc.rs` | manifold-constrained hyper-connections |
//! | `moe.rs` | hash-routed and score-routed MoE with the shared expert |
//! | `mtp.rs` | the MTP layer: DeepSeek's `MTPBlock`, drafting tokens from the last streams |
//! | `quantized.rs` | FP8 / packed-FP4 weights with their scale grids, dequantized |
//! | `ops.rs` | linear, RMS norm, interleaved partial RoPE (YaRN), scoring, top-k |
//! | `cuda/` | the same pass on the GPU (`--device cuda`), over a device copy of the cache |

pub mod attention;
pub mod cache;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod expert_parallel;
pub mod mhc;
pub mod moe;
pub mod mtp;
pub mod ops;
pub mod quantized;
pub mod torch_topk;
pub mod weights;

use std::path::Path;

use attention::{ChunkAt, Rope};
use cache::{DsV4Cache, SlotSpan};
use config::DsV4Config;
use weights::{DsV4Weights, HyperConnection, Layer};

use crate::error::{Result, TroupeError};
use crate::model::loader::{SafetensorsSource, TensorSource};

/// One sequence's share of a step.
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

pub struct DsV4Model {
    pub cfg: DsV4Config,
    weights: DsV4Weights,
    main_freqs: Vec<f32>,
    compress_freqs: Vec<f32>,
}

impl DsV4Model {
    pub fn new(cfg: DsV4Config, weights: DsV4Weights) -> Self {
        let main_freqs = ops::inv_freqs(&cfg.main_rope, cfg.rope_head_dim);
        let compress_freqs = ops::inv_freqs(&cfg.compress_rope, cfg.rope_head_dim);
        DsV4Model {
            cfg,
            weights,
            main_freqs,
            compress_freqs,
        }
    }

    /// The model of `dir`'s `config.json` with seeded random weights (`--dummy-weights`):
    /// no checkpoint is read.
    pub fn load_dummy_dir(dir: &Path) -> Result<Self> {
        let cfg = DsV4Config::from_dir(dir)?;
        let weights = DsV4Weights::dummy(&cfg)?;
        Ok(Self::new(cfg, weights))
    }

    /// An HF directory: `config.json` (model_type `deepseek_v4`) + safetensors.
    pub fn load_dir(dir: &Path) -> Result<Self> {
        let cfg = DsV4Config::from_dir(dir)?;
        let src = SafetensorsSource::open_dir(dir)?;
        Self::load(cfg, &src)
    }

    pub fn load(cfg: DsV4Config, src: &dyn TensorSource) -> Result<Self> {
        let weights = DsV4Weights::load(&cfg, src)?;
        Ok(Self::new(cfg, weights))
    }

    pub fn vocab_size(&self) -> usize {
        self.cfg.vocab_size
    }

    /// Runs every sequence's tokens and returns the logits of their logit rows, in order
    /// (`[Σ num_logit_rows, vocab]`). A sequence starting at its span's start resets its
    /// slot; one starting inside its last verify row (rejected drafts) rewinds to the
    /// snapshot taken before that row and runs the accepted part again; any other start
    /// must continue exactly where its slot stopped.
    pub fn forward(&self, cache: &mut DsV4Cache, steps: &[DsSeqStep<'_>]) -> Result<Vec<f32>> {
        let mut expert_tokens = vec![vec![0; self.cfg.num_routed_experts]; self.cfg.num_layers];
        self.forward_counting(cache, steps, &mut expert_tokens)
    }

    /// `forward`, adding each layer's tokens per routed expert to `expert_tokens`
    /// (`[layers][experts]`): the load statistics EPLB places experts by.
    pub fn forward_counting(
        &self,
        cache: &mut DsV4Cache,
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
        cache: &mut DsV4Cache,
        steps: &[DsSeqStep<'_>],
        expert_tokens: &mut [Vec<u64>],
        group: Option<&mut expert_parallel::ExpertGroup>,
    ) -> Result<Vec<f32>> {
        Ok(self.forward_streams(cache, steps, expert_tokens, group)?.0)
    }

    /// `forward_in_group`, also handing out every position's last-layer streams
    /// (`[Σ tokens, n_hc, hidden]`, before the hyper-head): what the MTP layer reads.
    pub fn forward_streams(
        &self,
        cache: &mut DsV4Cache,
        steps: &[DsSeqStep<'_>],
        expert_tokens: &mut [Vec<u64>],
        mut group: Option<&mut expert_parallel::ExpertGroup>,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let cfg = &self.cfg;
        let (d, n_hc) = (cfg.hidden_size, cfg.hc_mult);
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
                let snap = cache.rewind(slot).expect("checked above");
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
                cache.snapshot(slot, s.token_ids);
            } else {
                cache.clear_snapshot(slot);
            }
        }
        let token_ids: Vec<u32> = steps
            .iter()
            .flat_map(|s| s.token_ids.iter().copied())
            .collect();
        let tokens = token_ids.len();
        let mut streams = vec![0.0f32; tokens * n_hc * d];
        for (t, &id) in token_ids.iter().enumerate() {
            let row = self.embedding(id);
            for j in 0..n_hc {
                streams[(t * n_hc + j) * d..(t * n_hc + j + 1) * d].copy_from_slice(row);
            }
        }
        let rope = self.rope();
        let chunks: Vec<(ChunkAt<'_>, usize)> = steps
            .iter()
            .map(|s| {
                let at = ChunkAt {
                    slot: s.state_slot as usize,
                    pos0: s.num_cached_tokens,
                    block_table: s.block_table,
                };
                (at, s.token_ids.len())
            })
            .collect();
        for (l, w) in self.weights.layers.iter().enumerate() {
            let step = BlockStep {
                cfg,
                layer: l,
                rope: &rope,
                chunks: &chunks,
                token_ids: &token_ids,
            };
            block(
                &step,
                w,
                cache,
                &mut streams,
                &mut expert_tokens[l],
                group.as_deref_mut(),
            );
        }
        for s in steps {
            cache.set_slot_tokens(
                s.state_slot as usize,
                s.num_cached_tokens + s.token_ids.len(),
            );
        }

        // Only the logit rows go through the head.
        let mut picked = Vec::new();
        let mut row0 = 0;
        for s in steps {
            let n = s.token_ids.len();
            let first = row0 + n - s.num_logit_rows.min(n);
            picked.extend_from_slice(&streams[first * n_hc * d..(row0 + n) * n_hc * d]);
            row0 += n;
        }
        let logits = self.logits(&self.weights.hc_head, &self.weights.norm, &picked);
        Ok((logits, streams))
    }

    /// The head over last-layer streams (`[rows, n_hc, hidden]`) collapsed by `hc_head`
    /// and normed by `norm` (the model's own, or its MTP layer's): `[rows, vocab]`.
    pub fn logits(&self, hc_head: &HyperConnection, norm: &[f32], streams: &[f32]) -> Vec<f32> {
        let cfg = &self.cfg;
        let mut h = mhc::head(
            hc_head,
            streams,
            cfg.hc_mult,
            cfg.hidden_size,
            cfg.hc_eps,
            cfg.rms_norm_eps,
        );
        ops::rms_norm(&mut h, cfg.hidden_size, Some(norm), cfg.rms_norm_eps);
        self.weights.head.apply(&h)
    }

    /// Token `id`'s embedding row.
    pub fn embedding(&self, id: u32) -> &[f32] {
        let d = self.cfg.hidden_size;
        &self.weights.embed[id as usize * d..(id as usize + 1) * d]
    }

    pub fn rope(&self) -> Rope<'_> {
        Rope {
            main: &self.main_freqs,
            compress: &self.compress_freqs,
        }
    }
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

/// Where a block runs: the layer, its RoPE tables, each sequence's chunk and the step's
/// tokens (hash-routed layers read them).
pub struct BlockStep<'a> {
    pub cfg: &'a DsV4Config,
    pub layer: usize,
    pub rope: &'a Rope<'a>,
    pub chunks: &'a [(ChunkAt<'a>, usize)],
    pub token_ids: &'a [u32],
}

/// One block over the step's streams (`[tokens, n_hc, hidden]`), in place: mHC around
/// attention, then around the MoE (summed over `group` when there is one).
pub fn block(
    step: &BlockStep<'_>,
    w: &Layer,
    cache: &mut DsV4Cache,
    streams: &mut [f32],
    expert_tokens: &mut [u64],
    group: Option<&mut expert_parallel::ExpertGroup>,
) {
    let (cfg, l) = (step.cfg, step.layer);
    let (d, n_hc) = (cfg.hidden_size, cfg.hc_mult);
    let tokens = step.token_ids.len();
    let m = mhc::mix(&w.attn_hc, streams, cfg);
    let mut x = m.collapsed.clone();
    ops::rms_norm(&mut x, d, Some(&w.attn_norm), cfg.rms_norm_eps);
    let mut attn_out = vec![0.0f32; tokens * d];
    let mut row0 = 0;
    for (at, n) in step.chunks {
        let y = attention::attention(
            cfg,
            l,
            &w.attn,
            cache,
            at,
            step.rope,
            &x[row0 * d..(row0 + n) * d],
        );
        attn_out[row0 * d..(row0 + n) * d].copy_from_slice(&y);
        row0 += n;
    }
    mhc::merge(&m, streams, &attn_out, n_hc, d);

    let m = mhc::mix(&w.ffn_hc, streams, cfg);
    let mut x = m.collapsed.clone();
    ops::rms_norm(&mut x, d, Some(&w.ffn_norm), cfg.rms_norm_eps);
    let shard = group.as_ref().map(|g| &g.shard);
    let mut y = moe::moe(cfg, l, &w.moe, &x, step.token_ids, expert_tokens, shard);
    if let Some(g) = group {
        g.combine(&mut y);
    }
    mhc::merge(&m, streams, &y, n_hc, d);
}
