//! The CUDA backend's row norms and MLP activation against the CPU backend (the reference):
//! the register-resident norms (one round of 16-byte loads a row) and their strided
//! fallback, and the GEMV that writes silu(gate) · up straight from its sums, which must
//! equal the GEMV followed by `silu_mul` bit for bit. Needs a GPU: it runs on the device
//! machine (`scripts/gpu-tests.sh`); CI compiles it.
#![cfg(feature = "cuda")]

mod common;

use half::bf16;
use troupe::kernels::cpu::CpuBackend;
use troupe::kernels::cuda::CudaBackend;
use troupe::kernels::{Backend, HostData, HostMatrix};

fn backends() -> (CudaBackend, CpuBackend) {
    let gpu = CudaBackend::new(0, false, false).unwrap_or_else(|e| panic!("{e}"));
    (
        gpu,
        CpuBackend {
            batch_invariant: false,
            ..Default::default()
        },
    )
}

/// (out, residual after) of `add_rms_norm`, or `rms_norm`'s out when `add` is false.
fn norm<B: Backend>(b: &B, rows: usize, dim: usize, add: bool) -> (Vec<f32>, Vec<f32>) {
    let x = b.upload(&common::uniform(1, rows * dim));
    let w = b.upload(&common::uniform(2, dim));
    let mut out = b.alloc(rows * dim);
    if add {
        let mut residual = b.upload(&common::uniform(3, rows * dim));
        b.add_rms_norm(&mut residual, &x, &w, 1e-5, rows, dim, &mut out);
        (
            b.download(&out, rows * dim),
            b.download(&residual, rows * dim),
        )
    } else {
        b.rms_norm(&x, &w, 1e-5, rows, dim, &mut out);
        (b.download(&out, rows * dim), Vec::new())
    }
}

#[test]
fn row_norms_match_the_cpu_backend() {
    let (gpu, cpu) = backends();
    let mut failures = Vec::new();
    // Widths: head norms, SmolLM2, Llama-8B (one float4 a thread), not a multiple of 4,
    // wider than the registers hold (both strided).
    for dim in [64, 128, 576, 4096, 130, 20_000] {
        for rows in [1, 3, 17] {
            for add in [false, true] {
                let (got, got_res) = norm(&gpu, rows, dim, add);
                let (want, want_res) = norm(&cpu, rows, dim, add);
                let err = common::relative_error(&got, &want).max(if add {
                    common::relative_error(&got_res, &want_res)
                } else {
                    0.0
                });
                if err > 1e-5 {
                    failures.push(format!("dim {dim}, rows {rows}, add {add}: {err:.2e}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "norms differ: {failures:?}");
}

/// `[gate; up]` weights of `width` rows each over `k` columns, bf16-exact (so that the
/// CPU's f32 weights equal the GPU's bf16 ones).
fn gate_up_weights(width: usize, k: usize) -> HostMatrix {
    let data: Vec<bf16> = common::uniform(7, 2 * width * k)
        .into_iter()
        .map(|v| bf16::from_f32(v * 0.1))
        .collect();
    HostMatrix {
        rows: 2 * width,
        cols: k,
        data: HostData::Bf16(data),
    }
}

fn activation<B: Backend>(b: &B, rows: usize, width: usize, k: usize, fused: bool) -> Vec<f32> {
    let w = b.upload_matrix(gate_up_weights(width, k));
    let x = b.upload(&common::uniform(9 + rows as u64, rows * k));
    let mut gate_up = b.alloc(rows * 2 * width);
    let mut out = b.alloc(rows * width);
    if fused {
        b.gate_up_silu(&x, rows, &w, width, &mut gate_up, &mut out);
    } else {
        b.matmul(&x, rows, &w, None, &mut gate_up);
        b.silu_mul(&gate_up, rows, width, &mut out);
    }
    b.download(&out, rows * width)
}

#[test]
fn fused_mlp_activation_matches_the_cpu_backend_and_the_unfused_kernels() {
    let (gpu, cpu) = backends();
    let mut failures = Vec::new();
    // An odd width (the last block's partner columns past the end), and a Llama-like one.
    for (width, k) in [(1001, 512), (3584, 1024)] {
        // 1–4 rows take the GEMV (fused); 5 and 9 rows cuBLAS then silu_mul.
        for rows in [1, 2, 3, 4, 5, 9] {
            let got = activation(&gpu, rows, width, k, true);
            let unfused = activation(&gpu, rows, width, k, false);
            let want = activation(&cpu, rows, width, k, true);
            if got != unfused {
                failures.push(format!("width {width}, rows {rows}: fused ≠ unfused"));
            }
            // The GEMV keeps x in f32; cuBLAS rounds it to bf16.
            let tolerance = if rows <= 4 { 1e-4 } else { 2e-2 };
            let err = common::relative_error(&got, &want);
            if err > tolerance {
                failures.push(format!("width {width}, rows {rows}: {err:.2e} vs the CPU"));
            }
        }
    }
    assert!(failures.is_empty(), "activations differ: {failures:?}");
}

#[test]
fn a_gemm_after_a_norm_or_the_activation_reads_their_bf16_copy_bit_for_bit() {
    // The norm and silu·mul leave a bf16 copy of their output for cuBLAS (wide batches);
    // the GEMM must give what it gives when it converts the same values itself.
    let (gpu, _) = backends();
    let (rows, dim, width) = (9, 512, 1001);
    let w_in = gpu.upload_matrix(HostMatrix {
        rows: 2 * width,
        cols: dim,
        data: HostData::Bf16(
            common::uniform(21, 2 * width * dim)
                .into_iter()
                .map(bf16::from_f32)
                .collect(),
        ),
    });
    let w_down = gpu.upload_matrix(HostMatrix {
        rows: dim,
        cols: width,
        data: HostData::Bf16(
            common::uniform(22, dim * width)
                .into_iter()
                .map(bf16::from_f32)
                .collect(),
        ),
    });
    let mut residual = gpu.upload(&common::uniform(23, rows * dim));
    let x = gpu.upload(&common::uniform(24, rows * dim));
    let norm_w = gpu.upload(&common::uniform(25, dim));
    let mut normed = gpu.alloc(rows * dim);
    gpu.add_rms_norm(&mut residual, &x, &norm_w, 1e-5, rows, dim, &mut normed);
    let mut gate_up = gpu.alloc(rows * 2 * width);
    gpu.matmul(&normed, rows, &w_in, None, &mut gate_up);
    let mut act = gpu.alloc(rows * width);
    gpu.silu_mul(&gate_up, rows, width, &mut act);
    let mut down = gpu.alloc(rows * dim);
    gpu.matmul(&act, rows, &w_down, None, &mut down);
    // The same products from plain copies of the operands (no bf16 copy recorded).
    let normed_copy = gpu.upload(&gpu.download(&normed, rows * dim));
    let mut gate_up_copy = gpu.alloc(rows * 2 * width);
    gpu.matmul(&normed_copy, rows, &w_in, None, &mut gate_up_copy);
    let act_copy = gpu.upload(&gpu.download(&act, rows * width));
    let mut down_copy = gpu.alloc(rows * dim);
    gpu.matmul(&act_copy, rows, &w_down, None, &mut down_copy);
    assert_eq!(
        gpu.download(&gate_up, rows * 2 * width),
        gpu.download(&gate_up_copy, rows * 2 * width)
    );
    assert_eq!(
        gpu.download(&down, rows * dim),
        gpu.download(&down_copy, rows * dim)
    );
}
