//! The CUDA backend's attention kernels against the CPU backend (the reference, f32
//! throughout): decode rows (grouped kernel, splits), prefill chunks (flash tiles) and both
//! in one batch, over every head layout the kernels are compiled for. Needs a GPU: it runs
//! on the device machine (`scripts/gpu-tests.sh`); CI compiles it.
#![cfg(feature = "cuda")]

use troupe::kernels::cpu::CpuBackend;
use troupe::kernels::cuda::CudaBackend;
use troupe::kernels::{Backend, KvCacheShape, KvDtype, QkvHeads, SeqAttention};
use troupe::sampling::splitmix64;

fn random(seed: u64, n: usize) -> Vec<f32> {
    (0..n as u64)
        .map(|i| (splitmix64(seed ^ splitmix64(i)) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0)
        .collect()
}

/// One batch: per sequence (context tokens after the step, query tokens).
fn run<B: Backend>(
    b: &B,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    seqs: &[(usize, usize)],
    seed: u64,
    dtype: KvDtype,
) -> Vec<f32> {
    let block_size = 16;
    let blocks: Vec<usize> = seqs.iter().map(|s| s.0.div_ceil(block_size)).collect();
    let shape = KvCacheShape {
        num_layers: 1,
        num_blocks: blocks.iter().sum::<usize>() + 1,
        block_size,
        num_kv_heads: kv_heads,
        head_dim,
        dtype,
    };
    let mut cache = b.alloc_kv_cache(shape);
    // Blocks handed out back to front so that tables are not the identity.
    let mut next = shape.num_blocks as u32;
    let tables: Vec<Vec<u32>> = blocks
        .iter()
        .map(|&n| {
            (0..n)
                .map(|_| {
                    next -= 1;
                    next
                })
                .collect()
        })
        .collect();
    let kv_dim = kv_heads * head_dim;
    let mut slots = Vec::new();
    for (s, &(ctx, _)) in seqs.iter().enumerate() {
        for p in 0..ctx {
            slots.push(tables[s][p / block_size] * block_size as u32 + (p % block_size) as u32);
        }
    }
    let k = b.upload(&random(seed, slots.len() * kv_dim));
    let v = b.upload(&random(seed + 1, slots.len() * kv_dim));
    b.kv_write(&mut cache, 0, &k, &v, &slots);
    let num_rows: usize = seqs.iter().map(|s| s.1).sum();
    let q = b.upload(&random(seed + 2, num_rows * heads * head_dim));
    let mut views = Vec::new();
    let mut start = 0;
    for (s, &(ctx, rows)) in seqs.iter().enumerate() {
        views.push(SeqAttention {
            query_start: start,
            num_query_tokens: rows,
            num_context_tokens: ctx,
            block_table: &tables[s],
        });
        start += rows;
    }
    let mut out = b.alloc(num_rows * heads * head_dim);
    b.paged_attention(&q, &cache, 0, &views, heads, &mut out);
    b.download(&out, num_rows * heads * head_dim)
}

#[test]
fn cuda_attention_matches_the_cpu_backend() {
    // The invariant mode: its own split count over an f32 cache.
    let gpus = [false, true]
        .map(|invariant| CudaBackend::new(0, invariant, false).unwrap_or_else(|e| panic!("{e}")));
    let cpu = CpuBackend {
        batch_invariant: false,
        ..Default::default()
    };
    let batches: [&[(usize, usize)]; 4] = [
        // decode rows: short, across chunk boundaries, long (several splits)
        &[(1, 1), (63, 1), (64, 1), (65, 1), (700, 1), (3000, 1)],
        // one decode row alone: the most splits
        &[(1500, 1)],
        // prefill chunks (flash tiles), a continuing chunk, and decode rows together
        &[(150, 150), (300, 37), (90, 1), (77, 1)],
        // many decode rows (fewer splits)
        &[(200, 1); 300],
    ];
    let mut failures = Vec::new();
    for (heads, kv_heads, head_dim) in [
        (16, 8, 128),
        (32, 8, 128),
        (9, 3, 64),
        (8, 8, 64),
        (32, 4, 128),
        (12, 2, 128),
    ] {
        for (i, seqs) in batches.iter().enumerate() {
            let seed = 1000 * i as u64 + heads as u64;
            let want = run(&cpu, heads, kv_heads, head_dim, seqs, seed, KvDtype::Auto);
            for gpu in &gpus {
                let got = run(gpu, heads, kv_heads, head_dim, seqs, seed, KvDtype::Auto);
                // bf16 keys and values on the GPU: errors of a few parts in a thousand.
                let worst = want
                    .iter()
                    .zip(&got)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                // f32::max skips NaN: a NaN output is a failure of its own.
                if got.iter().any(|x| x.is_nan()) || worst >= 1e-2 {
                    failures.push(format!(
                        "heads {heads}/{kv_heads} dim {head_dim} batch {i} invariant {}: \
                     max abs error {worst}",
                        gpu.batch_invariant
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// q/k/v from a stacked projection into attention: the CPU backend's separate ops, or the
/// CUDA backend's fused kernel; then decode attention over what landed in the cache.
fn qkv_then_attention<B: Backend>(
    b: &B,
    head_dim: usize,
    qk_norm: bool,
    fused: bool,
    dtype: KvDtype,
) -> Vec<f32> {
    let (heads, kv_heads, tokens, block_size) = (8, 2, 40, 16);
    let (qd, kvd) = (heads * head_dim, kv_heads * head_dim);
    let shape = KvCacheShape {
        num_layers: 1,
        num_blocks: 4,
        block_size,
        num_kv_heads: kv_heads,
        head_dim,
        dtype,
    };
    let mut cache = b.alloc_kv_cache(shape);
    let qkv = b.upload(&random(7, tokens * (qd + 2 * kvd)));
    let positions: Vec<u32> = (0..tokens as u32).collect();
    // Slots of one sequence whose table is [3, 1, 0].
    let table = [3u32, 1, 0];
    let slots: Vec<u32> = positions
        .iter()
        .map(|&p| table[p as usize / block_size] * block_size as u32 + p % block_size as u32)
        .collect();
    let cos_sin = b.upload(
        &(0..tokens * head_dim)
            .map(|i| {
                let (p, d) = (i / head_dim, i % head_dim);
                let angle = p as f32 * 0.1 / (1 + d % (head_dim / 2)) as f32;
                if d < head_dim / 2 {
                    angle.cos()
                } else {
                    angle.sin()
                }
            })
            .collect::<Vec<f32>>(),
    );
    let qn = b.upload(
        &random(8, head_dim)
            .iter()
            .map(|x| 1.0 + 0.5 * x)
            .collect::<Vec<_>>(),
    );
    let kn = b.upload(
        &random(9, head_dim)
            .iter()
            .map(|x| 1.0 + 0.5 * x)
            .collect::<Vec<_>>(),
    );
    let norms = qk_norm.then_some((&qn, &kn, 1e-6f32));
    let mut q = b.alloc(tokens * qd);
    let heads_layout = QkvHeads {
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
    };
    if fused {
        assert!(b.qkv_into_cache(
            &qkv,
            heads_layout,
            norms,
            &positions,
            &cos_sin,
            &mut cache,
            0,
            &slots,
            &mut q
        ));
    } else {
        let (mut k, mut v) = (b.alloc(tokens * kvd), b.alloc(tokens * kvd));
        b.copy_columns(&qkv, qd + 2 * kvd, 0, qd, tokens, &mut q);
        b.copy_columns(&qkv, qd + 2 * kvd, qd, kvd, tokens, &mut k);
        b.copy_columns(&qkv, qd + 2 * kvd, qd + kvd, kvd, tokens, &mut v);
        if let Some((qn, kn, eps)) = norms {
            let (mut q2, mut k2) = (b.alloc(tokens * qd), b.alloc(tokens * kvd));
            b.rms_norm(&q, qn, eps, tokens * heads, head_dim, &mut q2);
            b.rms_norm(&k, kn, eps, tokens * kv_heads, head_dim, &mut k2);
            (q, k) = (q2, k2);
        }
        b.rope(&mut q, &positions, heads, head_dim, &cos_sin);
        b.rope(&mut k, &positions, kv_heads, head_dim, &cos_sin);
        b.kv_write(&mut cache, 0, &k, &v, &slots);
    }
    // The whole sequence as one prefill chunk: every key and value is read.
    let views = [SeqAttention {
        query_start: 0,
        num_query_tokens: tokens,
        num_context_tokens: tokens,
        block_table: &table,
    }];
    let mut out = b.alloc(tokens * qd);
    b.paged_attention(&q, &cache, 0, &views, heads, &mut out);
    let mut all = b.download(&q, tokens * qd);
    all.extend(b.download(&out, tokens * qd));
    all
}

#[test]
fn fused_qkv_into_cache_matches_the_cpu_backends_separate_ops() {
    let gpu = CudaBackend::new(0, false, false).unwrap_or_else(|e| panic!("{e}"));
    let cpu = CpuBackend {
        batch_invariant: false,
        ..Default::default()
    };
    for head_dim in [64, 128] {
        for qk_norm in [false, true] {
            let want = qkv_then_attention(&cpu, head_dim, qk_norm, false, KvDtype::Auto);
            let got = qkv_then_attention(&gpu, head_dim, qk_norm, true, KvDtype::Auto);
            let worst = want
                .iter()
                .zip(&got)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(
                !got.iter().any(|x| x.is_nan()) && worst < 2e-2,
                "head_dim {head_dim}, q/k norm {qk_norm}: max abs error {worst}"
            );
        }
    }
}

/// An fp8 cache (`--kv-cache-dtype fp8`): the GPU's codes and scales, written by the plain
/// and the fused writes, and its attention over them (the tensor-core decode kernel; the
/// split kernel for prefill rows and the layouts it does not take) against the CPU
/// backend's fp8 cache, which `kernels::cpu`'s tests hold to dense attention.
#[test]
fn cuda_fp8_cache_matches_the_cpu_backends() {
    let gpu = CudaBackend::new(0, false, false).unwrap_or_else(|e| panic!("{e}"));
    let cpu = CpuBackend {
        batch_invariant: false,
        ..Default::default()
    };
    let batches: [&[(usize, usize)]; 3] = [
        &[(1, 1), (63, 1), (64, 1), (65, 1), (700, 1), (3000, 1)],
        &[(150, 150), (300, 37), (90, 1), (77, 1)],
        &[(200, 1); 300],
    ];
    let mut failures = Vec::new();
    let mut check = |what: String, want: &[f32], got: &[f32], bound: f32| {
        let worst = want
            .iter()
            .zip(got)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        if got.iter().any(|x| x.is_nan()) || worst >= bound {
            failures.push(format!("{what}: max abs error {worst}"));
        }
    };
    for (heads, kv_heads, head_dim) in [(16, 8, 128), (9, 3, 64), (32, 4, 128), (8, 8, 64)] {
        for (i, seqs) in batches.iter().enumerate() {
            let seed = 7000 + 1000 * i as u64 + heads as u64;
            let want = run(&cpu, heads, kv_heads, head_dim, seqs, seed, KvDtype::Fp8);
            let got = run(&gpu, heads, kv_heads, head_dim, seqs, seed, KvDtype::Fp8);
            // The same codes; the GPU rounds code × scale, q and p to bf16 for its mma.
            check(
                format!("heads {heads}/{kv_heads} dim {head_dim} batch {i}"),
                &want,
                &got,
                1e-2,
            );
        }
    }
    for head_dim in [64, 128] {
        for qk_norm in [false, true] {
            let want = qkv_then_attention(&cpu, head_dim, qk_norm, false, KvDtype::Fp8);
            let got = qkv_then_attention(&gpu, head_dim, qk_norm, true, KvDtype::Fp8);
            check(
                format!("fused, dim {head_dim}, norm {qk_norm}"),
                &want,
                &got,
                2e-2,
            );
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
