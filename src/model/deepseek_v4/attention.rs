//! One DeepSeek-V4 attention block over the step's rows: shared-KV MQA with partial RoPE,
//! a sliding window read from each state slot's ring, compressed entries read from paged
//! blocks (every visible one for HCA; the lightning indexer's top-k for CSA), a learned
//! sink per head, the output's RoPE undone, and the grouped output projection.

use super::cache::LayerCache;
use super::config::AttentionKind;
use super::pass::Pass;
use super::weights::{Attention, CompressorWeights};
use crate::kernels::deepseek_v4::{AttentionKeys, Compressor, DsV4Kernels, GroupedShape};
use crate::kernels::entry_format::EntryFormat;

/// `x` is the step's normed block input `[rows, hidden]`; returns `[rows, hidden]`.
pub fn attention<B: DsV4Kernels>(
    p: &Pass<'_, B>,
    layer: usize,
    a: &Attention<B>,
    lc: &mut LayerCache<B>,
    (block_size, ring_len, ring_format): (usize, usize, EntryFormat),
    x: &B::Buf,
) -> B::Buf {
    let (b, cfg) = (p.b, p.cfg);
    let t = p.plan.num_rows();
    let meta = &p.plan.meta;
    let (hd, heads, eps) = (cfg.head_dim, cfg.num_heads, cfg.rms_norm_eps);
    let freqs = if cfg.attention[layer] == AttentionKind::Sliding {
        &p.consts.main_freqs
    } else {
        &p.consts.compress_freqs
    };
    let mut qr = b.scratch(t * cfg.q_lora_rank);
    b.matmul(x, t, &a.q_a, None, &mut qr);
    let mut q_residual = b.scratch(t * cfg.q_lora_rank);
    b.rms_norm(&qr, &a.q_a_norm, eps, t, cfg.q_lora_rank, &mut q_residual);
    let mut q = b.scratch(t * heads * hd);
    b.matmul(&q_residual, t, &a.q_b, None, &mut q);
    let mut qn = b.scratch(t * heads * hd);
    b.rms_norm(&q, &p.consts.ones, eps, t * heads, hd, &mut qn);
    let mut kv = b.scratch(t * hd);
    b.matmul(x, t, &a.kv, None, &mut kv);
    let mut kvn = b.scratch(t * hd);
    b.rms_norm(&kv, &a.kv_norm, eps, t, hd, &mut kvn);
    b.dsv4_rope(&mut qn, meta, heads, hd, freqs, 1.0);
    b.dsv4_rope(&mut kvn, meta, 1, hd, freqs, 1.0);

    if let (Some(cw), Some(cc)) = (&a.compressor, lc.compressor.as_mut()) {
        feed(p, cw, cc, x, block_size);
    }
    let mut selection = None;
    if let (Some(ix), Some(ic)) = (&a.indexer, lc.indexer.as_mut()) {
        feed(p, &ix.compressor, ic, x, block_size);
        let (ih, ihd) = (cfg.index_n_heads, cfg.index_head_dim);
        let mut iq = b.scratch(t * ih * ihd);
        b.matmul(&q_residual, t, &ix.q_b, None, &mut iq);
        b.dsv4_rope(&mut iq, meta, ih, ihd, &p.consts.compress_freqs, 1.0);
        let mut head_weights = b.scratch(t * ih);
        b.matmul(x, t, &ix.weights_proj, None, &mut head_weights);
        let mut sel = b.alloc_ids(t * cfg.index_topk);
        b.dsv4_index_select(
            &mut sel,
            &iq,
            &head_weights,
            ic,
            meta,
            block_size,
            ih,
            p.plan.index_span,
            cfg.index_topk,
        );
        selection = Some(sel);
    }
    let keys = AttentionKeys {
        kv: &kvn,
        ring: &lc.ring,
        ring_len,
        ring_format,
        window: cfg.sliding_window,
        compressed: lc
            .compressor
            .as_ref()
            .map(|c| (c, selection.as_ref().map(|s| (s, cfg.index_topk)))),
        block_size,
    };
    let mut out = b.scratch(t * heads * hd);
    b.dsv4_attention(&mut out, &qn, &keys, &a.sinks, meta, heads, hd);
    b.dsv4_rope(&mut out, meta, heads, hd, freqs, -1.0);
    // The ring keeps each chunk's last `window - 1` rows for the next chunk.
    b.dsv4_ring_write(&mut lc.ring, &kvn, meta, ring_format, ring_len, hd);

    // The grouped output projection: each group's heads through its own block of o_a.
    let (groups, rank) = (cfg.o_groups, cfg.o_lora_rank);
    let shape = GroupedShape {
        rows: t,
        groups,
        cols: heads * hd / groups,
        n: rank,
    };
    let mut grouped = b.scratch(t * groups * rank);
    b.dsv4_grouped_projection(&out, &a.o_a, shape, &mut grouped);
    let mut y = b.scratch(t * cfg.hidden_size);
    b.matmul(&grouped, t, &a.o_b, None, &mut y);
    y
}

/// One compressor's projections of the step, fed to its windows; the entries they close
/// normed and rotated.
fn feed<B: DsV4Kernels>(
    p: &Pass<'_, B>,
    w: &CompressorWeights<B>,
    c: &mut Compressor<B>,
    x: &B::Buf,
    block_size: usize,
) {
    let b = p.b;
    let t = p.plan.num_rows();
    let mut kv = b.scratch(t * c.width);
    b.matmul(x, t, &w.kv, None, &mut kv);
    let mut gate = b.scratch(t * c.width);
    b.matmul(x, t, &w.gate, None, &mut gate);
    b.dsv4_compress_feed(c, &kv, &gate, &w.position_bias, &p.plan.meta, block_size);
    let (emits, count) = p.plan.emits(c.rate);
    b.dsv4_entry_finish(
        c,
        emits,
        count,
        &w.norm,
        p.cfg.rms_norm_eps,
        &p.consts.compress_freqs,
    );
}
