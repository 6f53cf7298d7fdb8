//! The CUDA backend's kernels one at a time, against the device's own limits measured in
//! the same run: device-to-device copy bandwidth for what streams memory (decode
//! attention, GEMV, sampling), bf16 tensor-core GEMM through cuBLAS for what computes.
//! Run on the device machine:
//!   cargo bench --features cuda --bench cuda_kernels --no-run   (here; carry the binary)
//!   <binary> [--quick]                                           (there)
//! Prints one line per kernel: µs per call, achieved rate, fraction of the limit.

use std::time::Instant;

use cudarc::driver::CudaContext;
use troupe::kernels::cuda::CudaBackend;
use troupe::kernels::{Backend, HostData, HostMatrix, KvCacheShape, PickRow, SeqAttention};
use troupe::sampling::SamplingParams;

/// Seconds per call of `f`, after a warm-up, synchronised by `sync`.
fn time(iters: usize, mut f: impl FnMut(), sync: impl Fn()) -> f64 {
    f();
    sync();
    let t = Instant::now();
    for _ in 0..iters {
        f();
    }
    sync();
    t.elapsed().as_secs_f64() / iters as f64
}

fn copy_bandwidth() -> f64 {
    let ctx = CudaContext::new(0).expect("a GPU");
    let stream = ctx.default_stream();
    let n = 1usize << 29; // 1 GiB of bf16-sized words
    let src = stream.alloc_zeros::<u16>(n).expect("alloc");
    let mut dst = stream.alloc_zeros::<u16>(n).expect("alloc");
    let secs = time(
        10,
        || stream.memcpy_dtod(&src, &mut dst).expect("copy"),
        || stream.synchronize().expect("sync"),
    );
    // A copy reads and writes every byte.
    2.0 * (2 * n) as f64 / secs
}

struct Line {
    name: String,
    micros: f64,
    rate: String,
    fraction: f64,
}

fn random_matrix(rows: usize, cols: usize, seed: u64) -> HostMatrix {
    HostMatrix {
        rows,
        cols,
        data: HostData::Random {
            seed,
            mean: 0.0,
            half_width: 0.02,
        },
    }
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let iters = if quick { 3 } else { 20 };
    let bandwidth = copy_bandwidth();
    let b = CudaBackend::new(0, false, false).unwrap_or_else(|e| panic!("{e}"));
    let sync = |b: &CudaBackend| {
        let probe = b.alloc(1);
        let _ = b.download(&probe, 1);
    };
    let mut lines = Vec::new();

    // Decode attention: (name, heads, kv heads, head_dim, sequences, context).
    for (name, heads, kv_heads, head_dim, seqs, ctx) in [
        ("qwen3-0.6b", 16, 8, 128, 256, 1024),
        // The same bytes with one KV head: each block's keys lie contiguous in the cache.
        ("qwen3-0.6b one kv head", 2, 1, 128, 2048, 1024),
        ("llama-8b", 32, 8, 128, 64, 2048),
        ("smollm2-135m", 9, 3, 64, 256, 1024),
        ("llama-8b batch 1", 32, 8, 128, 1, 512),
    ] {
        let block_size = 16;
        let blocks_per_seq = ctx / block_size;
        let shape = KvCacheShape {
            num_layers: 1,
            num_blocks: seqs * blocks_per_seq,
            block_size,
            num_kv_heads: kv_heads,
            head_dim,
            dtype: Default::default(),
        };
        let cache = b.alloc_kv_cache(shape);
        let q = b.upload(&vec![0.01; seqs * heads * head_dim]);
        let mut out = b.alloc(seqs * heads * head_dim);
        let tables: Vec<Vec<u32>> = (0..seqs)
            .map(|s| ((s * blocks_per_seq) as u32..((s + 1) * blocks_per_seq) as u32).collect())
            .collect();
        let views: Vec<SeqAttention<'_>> = tables
            .iter()
            .enumerate()
            .map(|(s, t)| SeqAttention {
                query_start: s,
                num_query_tokens: 1,
                num_context_tokens: ctx,
                block_table: t,
            })
            .collect();
        let secs = time(
            iters,
            || b.paged_attention(&q, &cache, 0, &views, heads, &mut out),
            || sync(&b),
        );
        let bytes = (seqs * ctx * kv_heads * head_dim * 2 * 2) as f64;
        lines.push(Line {
            name: format!("decode attention {name}, {seqs}×{ctx}"),
            micros: secs * 1e6,
            rate: format!("{:.0} GB/s", bytes / secs / 1e9),
            fraction: bytes / secs / bandwidth,
        });
    }

    // Prefill attention, one sequence of 2048 tokens, Qwen3-0.6B heads.
    {
        let (heads, kv_heads, head_dim, len, block_size) = (16, 8, 128, 2048, 16);
        let shape = KvCacheShape {
            num_layers: 1,
            num_blocks: len / block_size,
            block_size,
            num_kv_heads: kv_heads,
            head_dim,
            dtype: Default::default(),
        };
        let cache = b.alloc_kv_cache(shape);
        let q = b.upload(&vec![0.01; len * heads * head_dim]);
        let mut out = b.alloc(len * heads * head_dim);
        let table: Vec<u32> = (0..(len / block_size) as u32).collect();
        let views = [SeqAttention {
            query_start: 0,
            num_query_tokens: len,
            num_context_tokens: len,
            block_table: &table,
        }];
        let secs = time(
            iters,
            || b.paged_attention(&q, &cache, 0, &views, heads, &mut out),
            || sync(&b),
        );
        // QKᵀ and PV over the causal half.
        let flops = 4.0 * (heads * head_dim) as f64 * (len * len) as f64 / 2.0;
        lines.push(Line {
            name: format!("prefill attention qwen3-0.6b, 1×{len}"),
            micros: secs * 1e6,
            rate: format!("{:.1} TFLOP/s", flops / secs / 1e12),
            fraction: f64::NAN,
        });
    }

    // Matrix products: (name, rows of x, n, k).
    for (name, m, n, k) in [
        ("8b qkv", 1, 6144, 4096),
        ("8b gate_up", 1, 28672, 4096),
        ("8b down", 1, 4096, 14336),
        ("8b lm_head", 1, 128_256, 4096),
        ("8b gate_up", 4, 28672, 4096),
        ("qwen3 gate_up", 256, 6144, 1024),
        ("qwen3 lm_head", 256, 151_936, 1024),
        ("qwen3 gate_up", 2048, 6144, 1024),
    ] {
        let w = b.upload_matrix(random_matrix(n, k, 7));
        let x = b.upload(&vec![0.5; m * k]);
        let mut y = b.alloc(m * n);
        let secs = time(iters, || b.matmul(&x, m, &w, None, &mut y), || sync(&b));
        let bytes = (n * k * 2) as f64;
        let flops = 2.0 * (m * n * k) as f64;
        lines.push(Line {
            name: format!("matmul {name}, {m}×{n}×{k}"),
            micros: secs * 1e6,
            rate: format!(
                "{:.0} GB/s of weights, {:.1} TFLOP/s",
                bytes / secs / 1e9,
                flops / secs / 1e12
            ),
            fraction: bytes / secs / bandwidth,
        });
    }

    // Sampling 256 rows of Qwen3's vocabulary: greedy, and top-p with temperature.
    {
        let (rows, vocab) = (256, 151_936);
        let logits: Vec<f32> = (0..rows * vocab)
            .map(|i| ((i * 2_654_435_761) % 1000) as f32 / 200.0)
            .collect();
        let logits_d = b.upload(&logits);
        for (label, params) in [
            ("greedy", SamplingParams::default()),
            (
                "t=0.7 top_p=0.9",
                SamplingParams {
                    temperature: 0.7,
                    top_p: 0.9,
                    seed: 1,
                    ..SamplingParams::default()
                },
            ),
        ] {
            let picks: Vec<PickRow<'_>> = (0..rows)
                .map(|row| PickRow {
                    row,
                    params: &params,
                    position: row as u64,
                    verified_row: None,
                    draft: None,
                    mask: None,
                })
                .collect();
            let secs = time(
                iters,
                || {
                    // Waits for the picks' copy: the pinned slot must not be freed in flight.
                    let _ = b.pick_rows(&logits_d, vocab, &picks)();
                },
                || sync(&b),
            );
            let bytes = (rows * vocab * 4) as f64;
            lines.push(Line {
                name: format!("sample {label}, {rows}×{vocab}"),
                micros: secs * 1e6,
                rate: format!("{:.0} GB/s of logits", bytes / secs / 1e9),
                fraction: bytes / secs / bandwidth,
            });
        }
    }

    println!("copy bandwidth: {:.0} GB/s", bandwidth / 1e9);
    println!(
        "{:<52} {:>10}  {:<36} {:>8}",
        "kernel", "µs", "rate", "of copy"
    );
    for l in lines {
        println!(
            "{:<52} {:>10.1}  {:<36} {:>8.2}",
            l.name, l.micros, l.rate, l.fraction
        );
    }
}
