//! Causal attention over the paged KV cache on the CPU.
//!
//! One task per (query token, kv head): the task walks the sequence's block table once
//! and serves every query head of the GQA group from each K/V row it loads, with an
//! online softmax per block, so no score buffer grows with the context and nothing is
//! allocated per step.

use rayon::prelude::*;

use super::simd::{axpy, dot};
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
    k_cache: &[f32],
    v_cache: &[f32],
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
    let scale = 1.0 / (hd as f32).sqrt();
    let out_ptr = OutPtr(out.as_mut_ptr());
    let threads = rayon::current_num_threads();
    seqs.par_iter().for_each(|seq| {
        // Few (token, kv head) tasks, as in decode, would leave threads idle: then each
        // query head gets its own task and re-reads its group's K/V (cheap at that size).
        let heads_per_task = if seq.num_query_tokens * kv_heads >= 4 * threads {
            group
        } else {
            1
        };
        let tasks_per_kv_head = group / heads_per_task;
        (0..seq.num_query_tokens * kv_heads * tasks_per_kv_head)
            .into_par_iter()
            .for_each(|task| {
                let sub = task % tasks_per_kv_head;
                let (t, kvh) = (
                    task / tasks_per_kv_head / kv_heads,
                    task / tasks_per_kv_head % kv_heads,
                );
                let heads = sub * heads_per_task..(sub + 1) * heads_per_task;
                let row = seq.query_start + t;
                // Causal: the query at context position p sees positions 0..=p.
                let num_visible = seq.num_context_tokens - seq.num_query_tokens + t + 1;
                let mut max = [f32::NEG_INFINITY; MAX_GROUP];
                let mut denom = [0f32; MAX_GROUP];
                let mut acc = [[0f32; MAX_HEAD_DIM]; MAX_GROUP];
                let mut scores = [[0f32; MAX_BLOCK_SIZE]; MAX_GROUP];
                for (b, &block) in seq.block_table.iter().enumerate() {
                    let first = b * bs;
                    if first >= num_visible {
                        break;
                    }
                    let n = bs.min(num_visible - first);
                    let base = block as usize * bs * kv_dim + kvh * hd;
                    for g in heads.clone() {
                        let qh = kvh * group + g;
                        let qv = &q[row * q_width + qh * hd..row * q_width + (qh + 1) * hd];
                        let mut block_max = f32::NEG_INFINITY;
                        for s in 0..n {
                            let kv = &k_cache[base + s * kv_dim..base + s * kv_dim + hd];
                            let sc = dot(qv, kv) * scale;
                            scores[g][s] = sc;
                            block_max = block_max.max(sc);
                        }
                        let new_max = max[g].max(block_max);
                        let correction = (max[g] - new_max).exp();
                        denom[g] *= correction;
                        for v in &mut acc[g][..hd] {
                            *v *= correction;
                        }
                        for s in 0..n {
                            let p = (scores[g][s] - new_max).exp();
                            denom[g] += p;
                            let vv = &v_cache[base + s * kv_dim..base + s * kv_dim + hd];
                            axpy(&mut acc[g][..hd], p, vv);
                        }
                        max[g] = new_max;
                    }
                }
                for g in heads {
                    let qh = kvh * group + g;
                    let inv = 1.0 / denom[g];
                    for (d, &a) in acc[g][..hd].iter().enumerate() {
                        // SAFETY: (row, qh) belongs to this task alone and lies inside `out`.
                        unsafe { *out_ptr.get().add(row * q_width + qh * hd + d) = a * inv };
                    }
                }
            });
    });
}
