//! CPU matmul in the shapes of SmolLM2-135M (hidden 576, intermediate 1536): decode rows
//! (m = 1) and a prefill chunk (m = 64), for each weight layout the backend keeps.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use troupe::kernels::cpu::CpuMatrix;
use troupe::kernels::cpu::matmul::matmul;
use troupe::kernels::quant::GgmlType;
use troupe::kernels::{HostData, HostMatrix};

fn matrix(ty: GgmlType, rows: usize, cols: usize) -> CpuMatrix {
    let n = rows * cols;
    let data = if ty == GgmlType::F32 {
        HostData::F32((0..n).map(|i| ((i % 97) as f32 - 48.0) / 97.0).collect())
    } else {
        let bb = ty.block_bytes();
        let mut bytes: Vec<u8> = (0..n / ty.block_len() * bb)
            .map(|i| (i * 131 % 251) as u8)
            .collect();
        for blk in bytes.chunks_exact_mut(bb) {
            blk[..2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
            if ty == GgmlType::Q4_1 {
                blk[2..4].copy_from_slice(&half::f16::from_f32(-0.05).to_le_bytes());
            }
        }
        HostData::Quantized {
            ggml_type: ty,
            bytes,
        }
    };
    CpuMatrix::from_host(HostMatrix { rows, cols, data })
}

/// The same weights in `--exact-activations`' layout (Q4_1 / Q8_0 expanded in the dot).
fn exact(ty: GgmlType, rows: usize, cols: usize) -> CpuMatrix {
    let CpuMatrix::Packed { bytes, .. } = matrix(ty, rows, cols) else {
        unreachable!("quantized test weights stay packed")
    };
    CpuMatrix::from_host_exact(HostMatrix {
        rows,
        cols,
        data: HostData::Quantized {
            ggml_type: ty,
            bytes,
        },
    })
}

fn bench(c: &mut Criterion) {
    let (rows, cols) = (1536, 576);
    let mut group = c.benchmark_group("matmul_1536x576");
    let mut cases = vec![("F32".to_string(), matrix(GgmlType::F32, rows, cols))];
    for ty in [GgmlType::Q8_0, GgmlType::Q4_1] {
        cases.push((format!("{ty:?}-exact"), exact(ty, rows, cols)));
    }
    for ty in [GgmlType::Q8_0, GgmlType::Q4_1, GgmlType::Q4K, GgmlType::Q6K] {
        cases.push((format!("{ty:?}"), matrix(ty, rows, cols)));
    }
    for (name, w) in &cases {
        for m in [1usize, 4, 64] {
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

criterion_group!(benches, bench);
criterion_main!(benches);
