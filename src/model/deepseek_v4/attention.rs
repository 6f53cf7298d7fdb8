//! One DeepSeek-V4 attention block over one sequence's chunk: shared-KV MQA with partial
//! RoPE, a sliding window read from the state slot's ring, compressed entries read from
//! paged blocks (every visible one for HCA; the lightning indexer's top-k for CSA), a
//! learned sink per head, the output's RoPE undone, and the grouped output projection.

use rayon::prelude::*;

use super::cache::DsV4Cache;
use super::config::{AttentionKind, DsV4Config};
use super::ops::{Linear, rms_norm, rope_rows};
use super::torch_topk::torch_top_k;
use super::weights::{Attention, Compressor, Indexer};

/// Where one sequence's chunk sits.
pub struct ChunkAt<'a> {
    pub slot: usize,
    /// Position of the chunk's first token.
    pub pos0: usize,
    pub block_table: &'a [u32],
}

pub struct Rope<'a> {
    pub main: &'a [f32],
    pub compress: &'a [f32],
}

/// `x` is the chunk's normed block input `[n, hidden]`; returns `[n, hidden]`.
pub fn attention(
    cfg: &DsV4Config,
    layer: usize,
    w: &Attention,
    cache: &mut DsV4Cache,
    at: &ChunkAt<'_>,
    rope: &Rope<'_>,
    x: &[f32],
) -> Vec<f32> {
    let (hd, heads) = (cfg.head_dim, cfg.num_heads);
    let n = x.len() / cfg.hidden_size;
    let freqs = if cfg.attention[layer] == AttentionKind::Sliding {
        rope.main
    } else {
        rope.compress
    };

    let mut q_residual = w.q_a.apply(x);
    rms_norm(
        &mut q_residual,
        cfg.q_lora_rank,
        Some(&w.q_a_norm),
        cfg.rms_norm_eps,
    );
    let mut q = w.q_b.apply(&q_residual);
    rms_norm(&mut q, hd, None, cfg.rms_norm_eps);
    let mut kv = w.kv.apply(x);
    rms_norm(&mut kv, hd, Some(&w.kv_norm), cfg.rms_norm_eps);
    for i in 0..n {
        rope_rows(
            &mut q[i * heads * hd..(i + 1) * heads * hd],
            hd,
            freqs,
            at.pos0 + i,
            1.0,
        );
        rope_rows(&mut kv[i * hd..(i + 1) * hd], hd, freqs, at.pos0 + i, 1.0);
    }

    let block_size = cache.block_size;
    let span = cache.span(at.slot);
    if let Some(comp) = &w.compressor {
        feed(cfg, comp, cache, layer, false, at, rope.compress, x);
    }
    let selected = w.indexer.as_ref().map(|ix| {
        feed(
            cfg,
            &ix.compressor,
            cache,
            layer,
            true,
            at,
            rope.compress,
            x,
        );
        select(cfg, ix, cache, layer, at, rope.compress, x, &q_residual)
    });

    let scale = (hd as f32).powf(-0.5);
    let window = cfg.sliding_window;
    let mut out = vec![0.0f32; n * heads * hd];
    let cache_ref = &*cache;
    // Queries are independent: each fills its own output rows.
    out.par_chunks_mut(heads * hd)
        .enumerate()
        .for_each(|(i, out_i)| {
            let t = at.pos0 + i;
            let mut keys: Vec<&[f32]> = Vec::new();
            for p in (t + 1).saturating_sub(window).max(span.state_start)..=t {
                keys.push(if p < at.pos0 {
                    cache_ref.ring_row(layer, at.slot, p)
                } else {
                    &kv[(p - at.pos0) * hd..(p - at.pos0 + 1) * hd]
                });
            }
            if let Some(comp) = &cache_ref.layers[layer].compressor {
                match &selected {
                    Some(sel) => keys.extend(
                        sel[i]
                            .iter()
                            .map(|&e| comp.entry(at.block_table, block_size, e)),
                    ),
                    None => keys.extend(
                        (0..(t + 1) / comp.rate).map(|e| comp.entry(at.block_table, block_size, e)),
                    ),
                }
            }
            let mut logits = Vec::with_capacity(keys.len());
            for h in 0..heads {
                let qh = &q[(i * heads + h) * hd..(i * heads + h + 1) * hd];
                logits.clear();
                logits.extend(keys.iter().map(|k| dot(qh, k) * scale));
                let sink = w.sinks[h];
                let max = logits.iter().copied().fold(sink, f32::max);
                let mut sum = (sink - max).exp();
                for l in logits.iter_mut() {
                    *l = (*l - max).exp();
                    sum += *l;
                }
                let oh = &mut out_i[h * hd..(h + 1) * hd];
                for (k, p) in keys.iter().zip(&logits) {
                    let p = p / sum;
                    oh.iter_mut().zip(k.iter()).for_each(|(o, v)| *o += p * v);
                }
            }
            rope_rows(out_i, hd, freqs, t, -1.0);
        });

    // The ring keeps the chunk's last `window - 1` rows for the next chunk.
    let keep = n.min(cache.ring_len());
    for i in n - keep..n {
        cache.write_ring(layer, at.slot, at.pos0 + i, &kv[i * hd..(i + 1) * hd]);
    }

    let grouped = grouped_projection(&w.o_a, &out, cfg.o_groups, cfg.o_lora_rank);
    w.o_b.apply(&grouped)
}

/// Projects each of the `groups` contiguous head groups with its own block of `o_a`.
fn grouped_projection(o_a: &Linear, x: &[f32], groups: usize, rank: usize) -> Vec<f32> {
    let per_group = o_a.cols;
    let n = x.len() / (groups * per_group);
    let mut gathered = vec![0.0f32; n * per_group];
    let mut out = vec![0.0f32; n * groups * rank];
    let mut part = vec![0.0f32; n * rank];
    for g in 0..groups {
        for i in 0..n {
            let src = (i * groups + g) * per_group;
            gathered[i * per_group..(i + 1) * per_group].copy_from_slice(&x[src..src + per_group]);
        }
        let w = &o_a.w[g * rank * per_group..(g + 1) * rank * per_group];
        super::ops::matmul_t(&gathered, n, w, rank, per_group, &mut part);
        for i in 0..n {
            out[(i * groups + g) * rank..(i * groups + g + 1) * rank]
                .copy_from_slice(&part[i * rank..(i + 1) * rank]);
        }
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn feed(
    cfg: &DsV4Config,
    comp: &Compressor,
    cache: &mut DsV4Cache,
    layer: usize,
    indexer: bool,
    at: &ChunkAt<'_>,
    freqs: &[f32],
    x: &[f32],
) {
    let kv = comp.kv.apply(x);
    let gate = comp.gate.apply(x);
    let block_size = cache.block_size;
    let span = cache.span(at.slot);
    let lc = &mut cache.layers[layer];
    let target = if indexer {
        lc.indexer.as_mut()
    } else {
        lc.compressor.as_mut()
    };
    let target = target.expect("a compressing layer has its compressor cache");
    let dim = target.dim;
    let eps = cfg.rms_norm_eps;
    target.feed(
        at.slot,
        span,
        at.pos0,
        &kv,
        &gate,
        &comp.position_bias,
        at.block_table,
        block_size,
        |entry, pos| {
            rms_norm(entry, dim, Some(&comp.norm), eps);
            rope_rows(entry, dim, freqs, pos, 1.0);
        },
    );
}

/// The lightning indexer: for each query, the compressed entries it attends to — the
/// `index_topk` best by `Σ_h w_h · relu(q_h · k)` among those whose window has closed.
/// Ties at the k-th place resolve as torch's `topk` over exactly those entries, which is
/// what transformers' decode runs (its uncached forward also scores the masked future
/// entries, so there its choice among ties depends on the sequence's length).
#[allow(clippy::too_many_arguments)]
fn select(
    cfg: &DsV4Config,
    ix: &Indexer,
    cache: &DsV4Cache,
    layer: usize,
    at: &ChunkAt<'_>,
    freqs: &[f32],
    x: &[f32],
    q_residual: &[f32],
) -> Vec<Vec<usize>> {
    let (ihd, iheads) = (cfg.index_head_dim, cfg.index_n_heads);
    let mut q = ix.q_b.apply(q_residual);
    let head_weights = ix.weights_proj.apply(x);
    let keys = cache.layers[layer]
        .indexer
        .as_ref()
        .expect("CSA layers have an indexer cache");
    let score_scale = (ihd as f32).powf(-0.5);
    let weight_scale = (iheads as f32).powf(-0.5);
    q.par_chunks_mut(iheads * ihd)
        .enumerate()
        .map(|(i, qi)| {
            let t = at.pos0 + i;
            rope_rows(qi, ihd, freqs, t, 1.0);
            let visible = (t + 1) / cfg.csa_rate;
            let scores: Vec<f32> = (0..visible)
                .map(|e| {
                    let k = keys.entry(at.block_table, cache.block_size, e);
                    let mut s = 0.0f32;
                    for h in 0..iheads {
                        let d = dot(&qi[h * ihd..(h + 1) * ihd], k).max(0.0) * score_scale;
                        s += d * head_weights[i * iheads + h] * weight_scale;
                    }
                    s
                })
                .collect();
            // Attended in entry order, the canonical order the GPU shares.
            let mut kept = torch_top_k(&scores, cfg.index_topk, false);
            kept.sort_unstable();
            kept
        })
        .collect()
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}
