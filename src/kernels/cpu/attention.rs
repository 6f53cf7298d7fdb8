//! Causal attention over the paged KV cache on the CPU.
//!
//! One task per (query token, kv head): the task walks the sequence's block table once
//! and serves every query head of the GQA group from each K/V row it loads, with an
//! online softmax per block, so no score buffer grows with the context and nothing is
//! allocated per step. A cache stored below f32 is decoded a block of one kv head at a
//! time into the task's scratch, once for the whole GQA group.

use rayon::prelude::*;

use super::kv_cache::KvRows;
use super::simd::{accumulate_rows, dot, exp_shifted, scale};
use crate::kernels::paged_kv::{KvCacheShape, SeqAttention};

pub const MAX_BLOCK_SIZE: usize = 256;
pub const MAX_HEAD_DIM: usize = 512;
/// Query heads per kv head that one task carries on its stack.
const MAX_GROUP: usize = 16;

#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: each task writes only its own (token, head group) slice of `out`.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// Through a method, so closures capture the `Send` wrapper, not its raw field.
    fn get(self) -> *mut f32 {
        self.0
    }
}

#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    q: &[f32],
    k_cache: &KvRows,
    v_cache: &KvRows,
    shape: &KvCacheShape,
    seqs: &[SeqAttention<'_>],
    num_heads: usize,
    out: &mut [f32],
) {
    let (hd, kv_heads, bs) = (shape.head_dim, shape.num_kv_heads, shape.block_size);
    let group = num_heads / kv_heads;
    assert!(
        bs <= MAX_BLOCK_SIZE && hd <= MAX_HEAD_DIM && group <= MAX_GROUP,
        "attention limits exceeded"
    );
    let q_width = num_heads * hd;
    let kv_dim = kv_heads * hd;
    let score_scale = 1.0 / (hd as f32).sqrt();
    let out_ptr = OutPtr(out.as_mut_ptr());
    let in_place = k_cache.as_f32().zip(v_cache.as_f32());
    seqs.par_iter().for_each(|seq| {
        // A task per (query token, kv head), its GQA group's heads served from each K/V row
        // it loads: in decode that is few tasks (3 for SmolLM2 on 2 threads), but a task
        // per query head re-read the group's K/V once per head, three times the traffic,
        // and was slower. A head's arithmetic is the same either way.
        (0..seq.num_query_tokens * kv_heads)
            .into_par_iter()
            .for_each(|task| {
                let (t, kvh) = (task / kv_heads, task % kv_heads);
                let heads = 0..group;
                let row = seq.query_start + t;
                // Causal: the query at context position p sees positions 0..=p.
                let num_visible = seq.num_context_tokens - seq.num_query_tokens + t + 1;
                let mut max = [f32::NEG_INFINITY; MAX_GROUP];
                let mut denom = [0f32; MAX_GROUP];
                SCRATCH.with_borrow_mut(|scratch| {
                    // Sized to the call, not to the limits: zeroing 48 KB of stack arrays per
                    // task cost more than a decode step's attention at short contexts.
                    let decoded = if in_place.is_some() { 0 } else { bs * hd };
                    let (acc, scores, k_block, v_block) =
                        scratch.split(group * hd, group * bs, decoded);
                    for (b, &block) in seq.block_table.iter().enumerate() {
                        let first = b * bs;
                        if first >= num_visible {
                            break;
                        }
                        let n = bs.min(num_visible - first);
                        // This block's rows of head kvh: where they lie, or decoded.
                        let (k_rows, v_rows, stride) = match in_place {
                            Some((k, v)) => {
                                let base = block as usize * bs * kv_dim + kvh * hd;
                                (&k[base..], &v[base..], kv_dim)
                            }
                            None => {
                                let slot = block as usize * bs;
                                k_cache.decode_block(slot, n, kvh, kv_heads, hd, k_block);
                                v_cache.decode_block(slot, n, kvh, kv_heads, hd, v_block);
                                (&k_block[..], &v_block[..], hd)
                            }
                        };
                        for g in heads.clone() {
                            let qh = kvh * group + g;
                            let qv = &q[row * q_width + qh * hd..row * q_width + (qh + 1) * hd];
                            let scores = &mut scores[g * bs..(g + 1) * bs];
                            let acc = &mut acc[g * hd..(g + 1) * hd];
                            let mut block_max = f32::NEG_INFINITY;
                            for s in 0..n {
                                let kv = &k_rows[s * stride..s * stride + hd];
                                let sc = dot(qv, kv) * score_scale;
                                scores[s] = sc;
                                block_max = block_max.max(sc);
                            }
                            let new_max = max[g].max(block_max);
                            let correction = (max[g] - new_max).exp();
                            denom[g] *= correction;
                            scale(acc, correction);
                            denom[g] += exp_shifted(&mut scores[..n], new_max);
                            accumulate_rows(acc, &scores[..n], v_rows, stride);
                            max[g] = new_max;
                        }
                    }
                    for g in heads {
                        let qh = kvh * group + g;
                        let inv = 1.0 / denom[g];
                        for (d, &a) in acc[g * hd..(g + 1) * hd].iter().enumerate() {
                            // SAFETY: (row, qh) belongs to this task alone and lies inside `out`.
                            unsafe { *out_ptr.get().add(row * q_width + qh * hd + d) = a * inv };
                        }
                    }
                });
            });
    });
}

/// A task's accumulators and scores, kept per thread.
#[derive(Default)]
struct Scratch(Vec<f32>);

impl Scratch {
    /// `acc` zeroed (`acc_len`), then `scores` (`scores_len`) and two blocks of decoded
    /// K and V rows (`block_len` each), stale: each is written before it is read.
    fn split(
        &mut self,
        acc_len: usize,
        scores_len: usize,
        block_len: usize,
    ) -> (&mut [f32], &mut [f32], &mut [f32], &mut [f32]) {
        self.0.resize(acc_len + scores_len + 2 * block_len, 0.0);
        let (acc, rest) = self.0.split_at_mut(acc_len);
        acc.fill(0.0);
        let (scores, rest) = rest.split_at_mut(scores_len);
        let (k, rest) = rest.split_at_mut(block_len);
        (acc, scores, k, &mut rest[..block_len])
    }
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
}
