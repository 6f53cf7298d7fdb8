//! The CPU kernels against naive dense formulas.

use super::*;
use crate::kernels::paged_kv::{KvDtype, slot_of};

fn pseudo(i: usize, salt: usize) -> f32 {
    let h = crate::sampling::splitmix64((i * 1_000_003 + salt) as u64);
    (h >> 40) as f32 / (1u64 << 24) as f32 - 0.5
}

#[allow(clippy::too_many_arguments)]
/// Dense causal GQA attention for one sequence, the reference for the paged kernel.
fn dense_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n_q: usize,
    n_ctx: usize,
    heads: usize,
    kv_heads: usize,
    hd: usize,
) -> Vec<f32> {
    let mut out = vec![0f32; n_q * heads * hd];
    let group = heads / kv_heads;
    for t in 0..n_q {
        let visible = n_ctx - n_q + t + 1;
        for h in 0..heads {
            let kvh = h / group;
            let qv = &q[(t * heads + h) * hd..(t * heads + h + 1) * hd];
            let scores: Vec<f64> = (0..visible)
                .map(|p| {
                    let kv = &k[(p * kv_heads + kvh) * hd..(p * kv_heads + kvh + 1) * hd];
                    qv.iter()
                        .zip(kv)
                        .map(|(a, b)| (*a * *b) as f64)
                        .sum::<f64>()
                        / (hd as f64).sqrt()
                })
                .collect();
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let z: f64 = w.iter().sum();
            for d in 0..hd {
                let acc: f64 = (0..visible)
                    .map(|p| w[p] * v[(p * kv_heads + kvh) * hd + d] as f64)
                    .sum();
                out[(t * heads + h) * hd + d] = (acc / z) as f32;
            }
        }
    }
    out
}

/// What a cache of `dtype` holds for `values` (`[tokens, kv_heads, hd]`): bf16 rounded to
/// nearest even, or per (token, head) e4m3 of x / (amax / 448) times that scale.
fn stored(values: &[f32], hd: usize, dtype: KvDtype) -> Vec<f32> {
    use crate::kernels::fp8::{E4M3_MAX, e4m3_to_f32, f32_to_e4m3};
    match dtype {
        KvDtype::Auto => values.to_vec(),
        KvDtype::Bf16 => values
            .iter()
            .map(|&x| half::bf16::from_f32(x).to_f32())
            .collect(),
        KvDtype::Fp4 => unreachable!("the Llama cache takes no FP4"),
        KvDtype::Fp8 => values
            .chunks_exact(hd)
            .flat_map(|head| {
                let scale = head.iter().fold(0f32, |m, x| m.max(x.abs())) / E4M3_MAX;
                head.iter()
                    .map(move |&x| e4m3_to_f32(f32_to_e4m3(x / scale)) * scale)
            })
            .collect(),
    }
}

/// The paged kernel over every cache dtype against dense attention over what the cache
/// holds (bf16's rounding, fp8's codes and scales), and within the dtype's precision of
/// dense attention over the values written.
#[test]
fn paged_attention_matches_dense_attention_with_scattered_blocks() {
    let (heads, kv_heads, hd, bs) = (6, 2, 16, 4);
    for (dtype, precision) in [
        (KvDtype::Auto, 1e-5),
        (KvDtype::Bf16, 1e-2),
        (KvDtype::Fp8, 6e-2),
    ] {
        let shape = KvCacheShape {
            num_layers: 1,
            num_blocks: 16,
            block_size: bs,
            num_kv_heads: kv_heads,
            head_dim: hd,
            dtype,
        };
        let b = CpuBackend::default();
        let mut cache = b.alloc_kv_cache(shape);
        // Two sequences interleaved in the pool in scrambled block order: a 3-token prefill
        // chunk after 7 cached tokens, and a single decode token after 12 cached tokens.
        let tables: [Vec<u32>; 2] = [vec![9, 2, 14], vec![5, 0, 11, 7]];
        let (n_ctx, n_q) = ([10usize, 13], [3usize, 1]);
        let kv_dim = kv_heads * hd;
        let mut dense_kv = Vec::new();
        for s in 0..2 {
            let k: Vec<f32> = (0..n_ctx[s] * kv_dim).map(|i| pseudo(i, 10 + s)).collect();
            let v: Vec<f32> = (0..n_ctx[s] * kv_dim).map(|i| pseudo(i, 20 + s)).collect();
            let slots: Vec<u32> = (0..n_ctx[s]).map(|p| slot_of(&tables[s], bs, p)).collect();
            b.kv_write(&mut cache, 0, &k, &v, &slots);
            dense_kv.push((k, v));
        }
        let q: Vec<f32> = (0..4 * heads * hd).map(|i| pseudo(i, 30)).collect();
        let seqs = [
            SeqAttention {
                query_start: 0,
                num_query_tokens: n_q[0],
                num_context_tokens: n_ctx[0],
                block_table: &tables[0],
            },
            SeqAttention {
                query_start: 3,
                num_query_tokens: n_q[1],
                num_context_tokens: n_ctx[1],
                block_table: &tables[1],
            },
        ];
        let mut out = vec![f32::NAN; 4 * heads * hd];
        b.paged_attention(&q, &cache, 0, &seqs, heads, &mut out);
        let w = heads * hd;
        for s in 0..2 {
            let rows = seqs[s].query_start..seqs[s].query_start + n_q[s];
            let q = &q[rows.start * w..rows.end * w];
            let (k, v) = &dense_kv[s];
            let dense = |k: &[f32], v: &[f32]| {
                dense_attention(q, k, v, n_q[s], n_ctx[s], heads, kv_heads, hd)
            };
            let held = dense(&stored(k, hd, dtype), &stored(v, hd, dtype));
            let written = dense(k, v);
            let got = &out[rows.start * w..rows.end * w];
            for ((a, e), x) in got.iter().zip(&held).zip(&written) {
                assert!((a - e).abs() < 1e-5, "{dtype:?} seq {s}: {a} vs {e}");
                assert!((a - x).abs() < precision, "{dtype:?} seq {s}: {a} vs {x}");
            }
        }
    }
}

#[test]
fn rms_norm_and_fused_residual_add() {
    let b = CpuBackend::default();
    let x = vec![1.0, 2.0, 3.0, 4.0, -1.0, 0.0, 1.0, 0.0];
    let w = vec![1.0, 0.5, 2.0, 1.0];
    let mut out = vec![0.0; 8];
    b.rms_norm(&x, &w, 0.0, 2, 4, &mut out);
    let inv = 1.0 / (30.0f32 / 4.0).sqrt();
    assert!((out[2] - 3.0 * inv * 2.0).abs() < 1e-6);
    let mut residual = vec![0.0; 8];
    let mut fused = vec![0.0; 8];
    b.add_rms_norm(&mut residual, &x, &w, 0.0, 2, 4, &mut fused);
    assert_eq!(residual, x);
    assert_eq!(fused, out);
}

#[test]
fn rope_rotates_half_split_pairs() {
    let b = CpuBackend::default();
    // head_dim 4: pairs (0, 2) and (1, 3); table row = [cos0, cos1, sin0, sin1].
    let theta = [0.3f32, 1.1];
    let table: Vec<f32> = [0.0f32, 0.0, 1.0, 1.0]
        .iter()
        .copied()
        .chain([
            theta[0].cos(),
            theta[1].cos(),
            theta[0].sin(),
            theta[1].sin(),
        ])
        .collect();
    let mut x = vec![1.0, 2.0, 3.0, 4.0];
    b.rope(&mut x, &[1], 1, 4, &table);
    let want = [
        1.0 * theta[0].cos() - 3.0 * theta[0].sin(),
        2.0 * theta[1].cos() - 4.0 * theta[1].sin(),
        3.0 * theta[0].cos() + 1.0 * theta[0].sin(),
        4.0 * theta[1].cos() + 2.0 * theta[1].sin(),
    ];
    for (a, e) in x.iter().zip(want) {
        assert!((a - e).abs() < 1e-6);
    }
}

#[test]
fn silu_mul_matches_formula() {
    let b = CpuBackend::default();
    let g = [-2.0f32, 0.0, 1.5];
    let u = [3.0f32, 4.0, -1.0];
    let gate_up: Vec<f32> = g.iter().chain(&u).copied().collect();
    let mut out = vec![0.0; 3];
    b.silu_mul(&gate_up, 1, 3, &mut out);
    for i in 0..3 {
        let want = g[i] / (1.0 + (-g[i]).exp()) * u[i];
        assert!((out[i] - want).abs() < 1e-6);
    }
}
