//! CPU matmul in the shapes of SmolLM2-135M: gate/up (1536 × 576) and down (576 × 1536,
//! the one a K-quant file keeps in K-quants), decode rows (m = 1, 4) and a prefill chunk
//! (m = 64), for each weight layout the backend keeps: f32, `--exact-activations`' Q4_1 /
//! Q8_0, and the packed formats with 8-bit activations; and a DeepSeek-V4-Flash expert's
//! MXFP4 gate.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use troupe::kernels::cpu::CpuMatrix;
use troupe::kernels::cpu::matmul::matmul;
use troupe::kernels::quant::GgmlType;
use troupe::kernels::{HostData, HostMatrix};

fn host(ty: GgmlType, rows: usize, cols: usize) -> HostMatrix {
    let n = rows * cols;
    let data = if ty == GgmlType::F32 {
        HostData::F32((0..n).map(|i| ((i % 97) as f32 - 48.0) / 97.0).collect())
    } else {
        let bb = ty.block_bytes();
        let mut bytes: Vec<u8> = (0..n / ty.block_len() * bb)
            .map(|i| (i * 131 % 251) as u8)
            .collect();
        // Finite scales where each format keeps them.
        let scales: &[usize] = match ty {
            GgmlType::Q4_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
            GgmlType::Q6K => &[208],
            _ => &[0],
        };
        for blk in bytes.chunks_exact_mut(bb) {
            for &at in scales {
                blk[at..at + 2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
            }
        }
        HostData::Quantized {
            ggml_type: ty,
            bytes,
        }
    };
    HostMatrix { rows, cols, data }
}

fn bench(c: &mut Criterion) {
    let shapes = [
        (
            "gate_up_1536x576",
            1536,
            576,
            vec![GgmlType::Q8_0, GgmlType::Q4_1, GgmlType::Q5_0],
        ),
        (
            "down_576x1536",
            576,
            1536,
            vec![GgmlType::Q4K, GgmlType::Q6K, GgmlType::Q8_0],
        ),
        // A DeepSeek-V4-Flash routed expert's gate (MXFP4 in host memory, `--cpu-moe`).
        ("expert_2048x4096", 2048, 4096, vec![GgmlType::MXFP4]),
    ];
    for (shape, rows, cols, types) in shapes {
        let mut group = c.benchmark_group(format!("matmul_{shape}"));
        let mut cases = vec![(
            "F32".to_string(),
            CpuMatrix::from_host(host(GgmlType::F32, rows, cols)),
        )];
        for &ty in &types {
            cases.push((
                format!("{ty:?}"),
                CpuMatrix::from_host(host(ty, rows, cols)),
            ));
            if matches!(ty, GgmlType::Q4_1 | GgmlType::Q8_0) {
                let exact = CpuMatrix::from_host_exact(host(ty, rows, cols));
                cases.push((format!("{ty:?}-exact"), exact));
            }
        }
        for (name, w) in &cases {
            for m in [1usize, 4, 64, 256] {
                let x: Vec<f32> = (0..m * cols)
                    .map(|i| ((i % 13) as f32 - 6.0) / 13.0)
                    .collect();
                let mut out = vec![0f32; m * rows];
                group.throughput(Throughput::Elements((2 * m * rows * cols) as u64));
                group.bench_with_input(BenchmarkId::new(name, m), &m, |b, &m| {
                    b.iter(|| matmul(&x, m, w, &mut out, false))
                });
            }
        }
        group.finish();
    }
}

/// A decode row through many distinct MXFP4 expert gates, as host experts read them: the
/// weights (`STREAM_EXPERTS` × 4.5 MB) do not fit any cache, so with every thread this is
/// the kernel against the host's memory bandwidth, and with `RAYON_NUM_THREADS=1` (against
/// `matmul_expert_2048x4096/MXFP4/1`, in cache) one core's compute rate.
fn stream(c: &mut Criterion) {
    const STREAM_EXPERTS: usize = 64;
    let (rows, cols) = (2048, 4096);
    let experts: Vec<CpuMatrix> = (0..STREAM_EXPERTS)
        .map(|_| CpuMatrix::from_host(host(GgmlType::MXFP4, rows, cols)))
        .collect();
    let bytes = (rows * cols / 32 * GgmlType::MXFP4.block_bytes()) as u64;
    let x: Vec<f32> = (0..cols).map(|i| ((i % 13) as f32 - 6.0) / 13.0).collect();
    let mut out = vec![0f32; rows];
    let mut group = c.benchmark_group("mxfp4_stream");
    group.throughput(Throughput::Bytes(bytes));
    let mut next = 0;
    group.bench_function("expert_2048x4096_m1", |b| {
        b.iter(|| {
            next = (next + 1) % STREAM_EXPERTS;
            matmul(&x, 1, &experts[next], &mut out, false)
        })
    });
    group.finish();
}

criterion_group!(benches, bench, stream);
criterion_main!(benches);
