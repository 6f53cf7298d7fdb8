//! DeepSeek-V4's attention on the CPU: shared-KV MQA with partial RoPE over a sliding
//! window (ring rows before the chunk, the chunk's own rows after) and compressed entries
//! (every closed window for HCA; the lightning indexer's top-k for CSA), with a learned
//! sink per head.

use rayon::prelude::*;

use super::super::torch_topk::torch_top_k;
use super::{compress, dot, entry_index, rope_rows};
use crate::kernels::cpu::CpuBackend;
use crate::kernels::deepseek_v4::{
    AttentionKeys, Compressor, NO_ENTRY, S_LEN, S_POS0, S_ROW0, S_SLOT, S_START, S_TABLE,
    SEQ_FIELDS, StepMeta,
};
use crate::kernels::entry_format::EntryFormat;

type Meta = StepMeta<CpuBackend>;

/// Row `i`'s (sequence fields, position).
fn row_at(meta: &Meta, i: usize) -> (&[u32], usize) {
    let seq = meta.rows[2 * i] as usize;
    (
        &meta.seqs[seq * SEQ_FIELDS..(seq + 1) * SEQ_FIELDS],
        meta.rows[2 * i + 1] as usize,
    )
}

fn table<'a>(meta: &'a Meta, sq: &[u32]) -> &'a [u32] {
    &meta.tables[sq[S_TABLE] as usize..]
}

pub(super) fn rope(x: &mut [f32], meta: &Meta, heads: usize, dim: usize, freqs: &[f32], sign: f32) {
    x[..meta.num_rows * heads * dim]
        .par_chunks_mut(heads * dim)
        .enumerate()
        .for_each(|(i, row)| rope_rows(row, dim, freqs, row_at(meta, i).1, sign));
}

pub(super) fn attend(
    out: &mut [f32],
    q: &[f32],
    keys: &AttentionKeys<'_, CpuBackend>,
    sinks: &[f32],
    meta: &Meta,
    heads: usize,
    hd: usize,
) {
    let scale = (hd as f32).powf(-0.5);
    // Queries are independent: each fills its own output rows.
    out[..meta.num_rows * heads * hd]
        .par_chunks_mut(heads * hd)
        .enumerate()
        .for_each(|(i, out_i)| {
            let (sq, t) = row_at(meta, i);
            let (slot, pos0, row0) = (
                sq[S_SLOT] as usize,
                sq[S_POS0] as usize,
                sq[S_ROW0] as usize,
            );
            // The compressed entries this row reads, decoded first where packed.
            let mut picked = Vec::new();
            if let Some((c, selection)) = keys.compressed {
                let tbl = table(meta, sq);
                let at =
                    |e: usize| entry_index(tbl, keys.block_size, c.rate, c.entries_per_block, e);
                match selection {
                    Some((sel, k)) => picked.extend(
                        sel[i * k..(i + 1) * k]
                            .iter()
                            .take_while(|&&e| e != NO_ENTRY)
                            .map(|&e| at(e as usize)),
                    ),
                    None => picked.extend((0..(t + 1) / c.rate).map(at)),
                }
            }
            let mut decoded = Vec::new();
            if let Some((c, _)) = keys
                .compressed
                .filter(|(c, _)| c.format != EntryFormat::F32)
            {
                decoded = vec![0f32; picked.len() * c.dim];
                for (&idx, out) in picked.iter().zip(decoded.chunks_exact_mut(c.dim)) {
                    compress::entry(c, idx, out);
                }
            }
            let window = (t + 1)
                .saturating_sub(keys.window)
                .max(sq[S_START] as usize)..=t;
            // A packed ring: every window row as the ring holds it — rows before the chunk
            // decoded, the chunk's own rounded through the format — so a row sees the same
            // keys however the sequence was chunked.
            let (format, words) = (keys.ring_format, keys.ring_format.words(hd));
            let ring_row = |p: usize| {
                let at = (slot * keys.ring_len + p % keys.ring_len) * words;
                &keys.ring[at..at + words]
            };
            let mut packed_rows = Vec::new();
            if format != EntryFormat::F32 {
                packed_rows = vec![0f32; window.clone().count() * hd];
                let mut bytes = vec![0u8; format.bytes(hd)];
                for (p, out) in window.clone().zip(packed_rows.chunks_exact_mut(hd)) {
                    if p < pos0 {
                        let held: &[u8] = bytemuck::cast_slice(ring_row(p));
                        format.decode(&held[..bytes.len()], out);
                    } else {
                        let at = (row0 + p - pos0) * hd;
                        format.encode(&keys.kv[at..at + hd], &mut bytes);
                        format.decode(&bytes, out);
                    }
                }
            }
            let mut rows: Vec<&[f32]> = Vec::new();
            if format != EntryFormat::F32 {
                rows.extend(packed_rows.chunks_exact(hd));
            } else {
                for p in window.clone() {
                    rows.push(if p < pos0 {
                        ring_row(p)
                    } else {
                        let at = (row0 + p - pos0) * hd;
                        &keys.kv[at..at + hd]
                    });
                }
            }
            if let Some((c, _)) = keys.compressed {
                if c.format == EntryFormat::F32 {
                    rows.extend(
                        picked
                            .iter()
                            .map(|&idx| &c.entries[idx * c.dim..(idx + 1) * c.dim]),
                    );
                } else {
                    rows.extend(decoded.chunks_exact(c.dim));
                }
            }
            out_i.fill(0.0);
            let mut logits = Vec::with_capacity(rows.len());
            for h in 0..heads {
                let qh = &q[(i * heads + h) * hd..(i * heads + h + 1) * hd];
                logits.clear();
                logits.extend(rows.iter().map(|k| dot(qh, k) * scale));
                let sink = sinks[h];
                let max = logits.iter().copied().fold(sink, f32::max);
                let mut sum = (sink - max).exp();
                for l in logits.iter_mut() {
                    *l = (*l - max).exp();
                    sum += *l;
                }
                let oh = &mut out_i[h * hd..(h + 1) * hd];
                for (k, p) in rows.iter().zip(&logits) {
                    let p = p / sum;
                    oh.iter_mut().zip(k.iter()).for_each(|(o, v)| *o += p * v);
                }
            }
        });
}

/// The ring keeps each chunk's last `ring_len` rows for the next chunk, as `format`.
pub(super) fn ring_write(
    ring: &mut [f32],
    kv: &[f32],
    meta: &Meta,
    format: EntryFormat,
    ring_len: usize,
    hd: usize,
) {
    if ring_len == 0 {
        return;
    }
    let words = format.words(hd);
    for sq in meta.seqs[..meta.num_seqs * SEQ_FIELDS].chunks_exact(SEQ_FIELDS) {
        let (slot, pos0, row0, len) = (
            sq[S_SLOT] as usize,
            sq[S_POS0] as usize,
            sq[S_ROW0] as usize,
            sq[S_LEN] as usize,
        );
        for i in len - len.min(ring_len)..len {
            let at = (slot * ring_len + (pos0 + i) % ring_len) * words;
            let row = &kv[(row0 + i) * hd..(row0 + i + 1) * hd];
            if format == EntryFormat::F32 {
                ring[at..at + hd].copy_from_slice(row);
            } else {
                let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut ring[at..at + words]);
                format.encode(row, &mut bytes[..format.bytes(hd)]);
            }
        }
    }
}

/// The lightning indexer: for each row, the compressed entries it attends to — the `k`
/// best by `Σ_h w_h · relu(q_h · key)` among those whose window has closed. Ties at the
/// k-th place resolve as torch's `topk` over exactly those entries, which is what
/// transformers' decode runs (its uncached forward also scores the masked future entries,
/// so there its choice among ties depends on the sequence's length).
#[allow(clippy::too_many_arguments)]
pub(super) fn index_select(
    sel: &mut [u32],
    q: &[f32],
    head_weights: &[f32],
    keys: &Compressor<CpuBackend>,
    meta: &Meta,
    block_size: usize,
    heads: usize,
    k: usize,
) {
    let dim = keys.dim;
    let score_scale = (dim as f32).powf(-0.5);
    let weight_scale = (heads as f32).powf(-0.5);
    sel[..meta.num_rows * k]
        .par_chunks_mut(k)
        .enumerate()
        .for_each(|(i, sel_i)| {
            let (sq, t) = row_at(meta, i);
            let tbl = table(meta, sq);
            let qi = &q[i * heads * dim..(i + 1) * heads * dim];
            let mut scratch = vec![0f32; dim];
            let visible = (t + 1) / keys.rate;
            let scores: Vec<f32> = (0..visible)
                .map(|e| {
                    let idx = entry_index(tbl, block_size, keys.rate, keys.entries_per_block, e);
                    let key = compress::entry(keys, idx, &mut scratch);
                    let mut s = 0.0f32;
                    for h in 0..heads {
                        let d = dot(&qi[h * dim..(h + 1) * dim], key).max(0.0) * score_scale;
                        s += d * head_weights[i * heads + h] * weight_scale;
                    }
                    s
                })
                .collect();
            // Attended in entry order, the canonical order the GPU shares.
            let mut kept = torch_top_k(&scores, k, false);
            kept.sort_unstable();
            sel_i.fill(NO_ENTRY);
            for (s, e) in sel_i.iter_mut().zip(kept) {
                *s = e as u32;
            }
        });
}
