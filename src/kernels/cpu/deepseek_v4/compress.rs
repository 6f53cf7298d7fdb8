//! The compressors' windows on the CPU: each step's projected kv and gate rows go into
//! their slot's open window; each window they close emits one entry — a per-channel
//! softmax over the window's gate logits (+ position bias; with overlap, over the previous
//! window's Ca half and this window's Cb half) weighting its kv rows — unless the window is
//! a cached prefix being replayed. A window starting at the slot's first position has no
//! previous half.

use std::collections::HashMap;

use super::{entry_index, rms_norm_rows, rope_rows};
use crate::kernels::cpu::CpuBackend;
use crate::kernels::deepseek_v4::{
    Compressor, NO_ENTRY, S_LEN, S_POS0, S_REPLAY, S_ROW0, S_SLOT, S_START, S_TABLE, SEQ_FIELDS,
    StepMeta,
};
use crate::kernels::entry_format::EntryFormat;

pub(super) fn feed(
    c: &mut Compressor<CpuBackend>,
    kv: &[f32],
    gate: &[f32],
    position_bias: &[f32],
    meta: &StepMeta<CpuBackend>,
    block_size: usize,
) {
    let (rate, width, dim) = (c.rate, c.width, c.dim);
    let cb = if c.overlap { dim } else { 0 };
    let mut entry = vec![0.0f32; dim];
    let mut logits = vec![0.0f32; 2 * rate];
    for sq in meta.seqs[..meta.num_seqs * SEQ_FIELDS].chunks_exact(SEQ_FIELDS) {
        let slot = sq[S_SLOT] as usize;
        let (pos0, row0, len) = (sq[S_POS0] as usize, sq[S_ROW0] as usize, sq[S_LEN] as usize);
        let (start, replay) = (sq[S_START] as usize, sq[S_REPLAY] as usize);
        let table = &meta.tables[sq[S_TABLE] as usize..];
        let buf = slot * rate * width;
        let prev = slot * rate * dim;
        for i in 0..len {
            let pos = pos0 + i;
            let s = pos % rate;
            let row = buf + s * width;
            let src = (row0 + i) * width;
            c.buf_kv[row..row + width].copy_from_slice(&kv[src..src + width]);
            c.buf_gate[row..row + width].copy_from_slice(&gate[src..src + width]);
            if s != rate - 1 {
                continue;
            }
            let w = pos / rate;
            let has_prev = c.overlap && w * rate > start;
            let emit = (w + 1) * rate > replay;
            for (ch, out) in entry.iter_mut().enumerate() {
                // Slot j < rate: the previous window's Ca (absent for the first window).
                let mut slots = 0;
                if has_prev {
                    for j in 0..rate {
                        logits[slots] = c.prev_gate[prev + j * dim + ch];
                        slots += 1;
                    }
                }
                let first_cb = slots;
                for j in 0..rate {
                    logits[slots] =
                        c.buf_gate[buf + j * width + cb + ch] + position_bias[j * width + cb + ch];
                    slots += 1;
                }
                let max = logits[..slots]
                    .iter()
                    .copied()
                    .fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0.0;
                for l in logits[..slots].iter_mut() {
                    *l = (*l - max).exp();
                    sum += *l;
                }
                let mut acc = 0.0;
                for (j, l) in logits[..first_cb].iter().enumerate() {
                    acc += l / sum * c.prev_kv[prev + j * dim + ch];
                }
                for j in 0..rate {
                    acc += logits[first_cb + j] / sum * c.buf_kv[buf + j * width + cb + ch];
                }
                *out = acc;
            }
            if emit {
                let idx = entry_index(table, block_size, rate, c.entries_per_block, w);
                if c.format == EntryFormat::F32 {
                    c.entries[idx * dim..(idx + 1) * dim].copy_from_slice(&entry);
                } else {
                    // Packed after its norm and RoPE (`finish`).
                    c.staged.push((idx as u32, entry.clone()));
                }
            }
            if c.overlap {
                for j in 0..rate {
                    let (src, dst) = (buf + j * width, prev + j * dim);
                    let (prev_kv, buf_kv) = (&mut c.prev_kv, &c.buf_kv);
                    prev_kv[dst..dst + dim].copy_from_slice(&buf_kv[src..src + dim]);
                    for ch in 0..dim {
                        c.prev_gate[dst + ch] =
                            c.buf_gate[src + ch] + position_bias[j * width + ch];
                    }
                }
            }
        }
    }
}

/// RMS norm (with `norm`) and RoPE at its window's first position of each entry `emits`
/// lists as (entry index, position).
pub(super) fn finish(
    c: &mut Compressor<CpuBackend>,
    emits: &[u32],
    norm: &[f32],
    eps: f32,
    freqs: &[f32],
) {
    let dim = c.dim;
    if c.format != EntryFormat::F32 {
        return finish_packed(c, emits, norm, eps, freqs);
    }
    for pair in emits.chunks_exact(2) {
        if pair[0] == NO_ENTRY {
            continue;
        }
        let at = pair[0] as usize * dim;
        let entry = &mut c.entries[at..at + dim];
        rms_norm_rows(entry, dim, Some(norm), eps);
        rope_rows(entry, dim, freqs, pair[1] as usize, 1.0);
    }
}

/// `finish` for a packed format: each staged entry normed and roped in f32, then packed
/// into its row.
fn finish_packed(
    c: &mut Compressor<CpuBackend>,
    emits: &[u32],
    norm: &[f32],
    eps: f32,
    freqs: &[f32],
) {
    let (dim, row_len, format) = (c.dim, c.row_len, c.format);
    let mut staged: HashMap<u32, Vec<f32>> = c.staged.drain(..).collect();
    for pair in emits.chunks_exact(2) {
        let Some(mut entry) = staged.remove(&pair[0]) else {
            continue;
        };
        rms_norm_rows(&mut entry, dim, Some(norm), eps);
        rope_rows(&mut entry, dim, freqs, pair[1] as usize, 1.0);
        let at = pair[0] as usize * row_len;
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut c.entries[at..at + row_len]);
        format.encode(&entry, &mut bytes[..format.bytes(dim)]);
    }
    debug_assert!(staged.is_empty(), "an emitted entry the plan does not list");
}

/// Entry `idx` of `c` as f32: its row of `entries`, or decoded into `scratch` (`dim`
/// values) where packed.
pub(super) fn entry<'a>(
    c: &'a Compressor<CpuBackend>,
    idx: usize,
    scratch: &'a mut [f32],
) -> &'a [f32] {
    let (dim, row_len) = (c.dim, c.row_len);
    let row = &c.entries[idx * row_len..(idx + 1) * row_len];
    if c.format == EntryFormat::F32 {
        return row;
    }
    let bytes: &[u8] = bytemuck::cast_slice(row);
    c.format
        .decode(&bytes[..c.format.bytes(dim)], &mut scratch[..dim]);
    &scratch[..dim]
}
