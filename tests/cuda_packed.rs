//! Packed weights on the GPU against their dequantization (the `gguf`-checked GGML
//! dequantization, FP8's exact e4m3 values times the scale grid): the decode GEMVs that
//! dequantize in registers, the dequantize-to-bf16 GEMM of wider batches, the
//! batch-invariant kernel, stacked parts of mixed formats, embedding rows gathered from a
//! packed table, and `--quantization fp8`'s on-device quantization against the host's. On
//! generated shapes. Needs a GPU: it runs on the device machine (`scripts/gpu-tests.sh`);
//! CI compiles it.
#![cfg(feature = "cuda")]

mod common;

use common::packed::{fp8, ggml, mxfp4, reference};
use troupe::kernels::cuda::CudaBackend;
use troupe::kernels::fp8::{Fp8Matrix, e4m3_to_f32, f32_to_e4m3};
use troupe::kernels::quant::GgmlType;
use troupe::kernels::{Backend, HostData, HostMatrix};
use troupe::sampling::splitmix64;

/// The f32 GEMVs (up to 4 rows; GGML and FP8 of any block width).
const GEMV: (usize, f32) = (4, 1e-4);
/// With the tensor-core FP8 GEMV (up to 8 rows, K a multiple of 64 inside scale blocks; f16
/// activations): up to 8 rows within its bound.
const MMA: (usize, f32) = (8, 3e-3);

fn mma_eligible(cols: usize, block_cols: usize) -> bool {
    cols.is_multiple_of(64) && (block_cols.is_multiple_of(64) || block_cols >= cols)
}

/// The activation groups cuBLASLt's FP8 GEMM quantizes `w`'s input in, where it takes
/// `w` (`fp8_gemm.rs`): 0 — a scale per token — for per-channel weights, 128 for 128-square
/// blocks; None where the batch is dequantized for cuBLAS instead.
fn fp8_gemm_group(w: &HostMatrix) -> Option<usize> {
    let HostData::Fp8(f) = &w.data else {
        return None;
    };
    let fits = w.rows.is_multiple_of(4) && w.cols.is_multiple_of(16);
    match (f.block_rows, f.block_cols) {
        (1, c) if c >= w.cols && fits => Some(0),
        (128, 128) if fits && w.cols.is_multiple_of(512) => Some(128),
        _ => None,
    }
}

/// `x` as the FP8 GEMM sees it: each token's `group` columns (all of them for 0) scaled so
/// that the largest is 448, rounded to e4m3 (the host's torch-checked rounding), scaled back.
fn fp8_activations(x: &[f32], cols: usize, group: usize) -> Vec<f32> {
    let group = if group == 0 { cols } else { group };
    x.chunks(group)
        .flat_map(|g| {
            let amax = g.iter().fold(0f32, |m, v| m.max(v.abs()));
            let scale = if amax > 0.0 { amax / 448.0 } else { 1.0 };
            g.iter()
                .map(move |&v| e4m3_to_f32(f32_to_e4m3(v / scale)) * scale)
        })
        .collect()
}

/// FP8 activations cost a dot product up to ~2^-5 of its terms' magnitude: bound against
/// the unquantized product.
const FP8_GEMM_TOL: f32 = 6e-2;
/// The FP8 GEMM against the same e4m3 activations on the host.
const FP8_SUM_TOL: f32 = 1e-3;

fn gpu(invariant: bool) -> CudaBackend {
    CudaBackend::new(0, invariant, false).unwrap_or_else(|e| panic!("{e}"))
}

/// Short K and many rows: the tensor-core GEMV whose warps each take 16 rows over all of K
/// (`gemv_fp8_mma_rows`, from 16 384 rows at K ≤ 4 096), a generated row count past that
/// (a last block partly empty) and K, both scale layouts.
#[test]
fn the_fp8_gemv_over_many_rows_of_short_k_matches_its_dequantization() {
    let b = gpu(false);
    for seed in 0..3u64 {
        let rows = 16384 + (splitmix64(seed + 40) % 300) as usize;
        let cols = 64 * (1 + (splitmix64(seed + 41) % 16) as usize);
        let block = if seed % 2 == 0 { (128, 128) } else { (1, cols) };
        let w = fp8(rows, cols, block, seed + 50);
        let device = b.upload_matrix(w.clone());
        for m in [1, 3, 8] {
            let x = common::uniform(200 + m as u64, m * cols);
            let mut out = b.alloc(m * rows);
            b.matmul(&b.upload(&x), m, &device, None, &mut out);
            let err = common::relative_error(&b.download(&out, m * rows), &reference(&w, &x, m));
            assert!(
                err < MMA.1,
                "FP8 {block:?} [{rows}, {cols}] × {m} rows: error {err} (bound {})",
                MMA.1
            );
        }
    }
}

/// Every batch width through `w` on `b`: up to `gemv.0` rows (the GEMVs) within `gemv.1`,
/// wider ones (bf16 weights and activations into cuBLAS) within `gemm_tol`.
fn check(b: &CudaBackend, name: &str, w: HostMatrix, gemv: (usize, f32), gemm_tol: f32) {
    let (gemv_rows, gemv_tol) = gemv;
    let (rows, cols) = (w.rows, w.cols);
    let device = b.upload_matrix(w.clone());
    for m in [1, 2, 3, 4, 5, 8, 12, 16, 19, 130] {
        let x = common::uniform(100 + m as u64, m * cols);
        let xd = b.upload(&x);
        let mut out = b.alloc(m * rows);
        b.matmul(&xd, m, &device, None, &mut out);
        let got = b.download(&out, m * rows);
        let fp8_group = fp8_gemm_group(&w).filter(|_| m > gemv_rows && !b.batch_invariant);
        if let Some(group) = fp8_group {
            // cuBLASLt on e4m3 activations: against the same rounding, within what Hopper's
            // FP8 accumulation loses (a first run: 1.4e-4), 30× below the rounding's own
            // error; and within FP8's bound of the unquantized product.
            let quantized = reference(&w, &fp8_activations(&x, cols, group), m);
            let err = common::relative_error(&got, &quantized);
            assert!(
                err < FP8_SUM_TOL,
                "{name} [{rows}, {cols}] × {m} rows, FP8 GEMM: {err}"
            );
        }
        let err = common::relative_error(&got, &reference(&w, &x, m));
        let tol = if m <= gemv_rows && !b.batch_invariant {
            gemv_tol
        } else if fp8_group.is_some() {
            FP8_GEMM_TOL
        } else {
            gemm_tol
        };
        assert!(
            err < tol,
            "{name} [{rows}, {cols}] × {m} rows: error {err} (bound {tol})"
        );
    }
}

#[test]
fn every_packed_format_matches_its_dequantization_at_every_batch_width() {
    let b = gpu(false);
    let mut seed = 0;
    for t in [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q6K,
    ] {
        for _ in 0..3 {
            seed += 1;
            let rows = 1 + (splitmix64(seed) % 300) as usize;
            let cols = t.block_len() * (1 + (splitmix64(seed + 99) % 6) as usize);
            let gemv = if matches!(t, GgmlType::Q4K | GgmlType::Q4_1) {
                MMA
            } else {
                GEMV
            };
            check(&b, &format!("{t:?}"), ggml(t, rows, cols, seed), gemv, 2e-2);
        }
    }
    for _ in 0..6 {
        seed += 1;
        let rows = 1 + (splitmix64(seed) % 400) as usize;
        // Half the widths multiples of 64: the tensor-core GEMV's.
        let r = splitmix64(seed + 7) as usize;
        let cols = if seed % 2 == 0 {
            64 * (1 + r % 20)
        } else {
            16 * (1 + r % 40)
        };
        let block = match seed % 4 {
            0 => (128, 128),
            1 => (1, cols),
            2 => (64, 96),
            _ => (rows, cols),
        };
        check(
            &b,
            &format!("FP8 {block:?}"),
            fp8(rows, cols, block, seed),
            if mma_eligible(cols, block.1) {
                MMA
            } else {
                GEMV
            },
            2e-2,
        );
    }
}

/// Batches past the GEMV's 8 rows on FP8 tensor cores (cuBLASLt), for both scale layouts
/// it takes, on generated shapes: token counts off cuBLASLt's multiple of 4 included, and a
/// stack of per-channel parts (q, k, v) each writing its own columns of the output.
#[test]
fn wide_fp8_batches_run_on_fp8_tensor_cores_for_both_scale_layouts() {
    let b = gpu(false);
    for seed in 60..68u64 {
        let r = splitmix64(seed) as usize;
        let rows = 4 * (1 + r % 150);
        let (block, cols) = if seed % 2 == 0 {
            ((1, 0), 16 * (1 + (r >> 12) % 120))
        } else {
            ((128, 128), 512 * (1 + (r >> 12) % 4))
        };
        let block = if block.1 == 0 { (1, cols) } else { block };
        let w = fp8(rows, cols, block, seed);
        assert!(fp8_gemm_group(&w).is_some());
        let gemv = if mma_eligible(cols, block.1) {
            MMA
        } else {
            GEMV
        };
        check(&b, &format!("FP8 GEMM {block:?}"), w, gemv, 0.0);
    }
    // Per-channel and block parts do not merge: each part quantizes x its own way.
    let stacked = HostMatrix::concat_rows(vec![
        fp8(64, 512, (1, 512), 71),
        fp8(128, 512, (128, 128), 72),
        fp8(16, 512, (1, 512), 73),
    ]);
    let HostData::Stacked(parts) = &stacked.data else {
        panic!("per-channel and block parts stay apart");
    };
    let device = b.upload_matrix(stacked.clone());
    let (cols, rows) = (512, stacked.rows);
    for m in [9, 30] {
        let x = common::uniform(80 + m as u64, m * cols);
        let xd = b.upload(&x);
        let mut out = b.alloc(m * rows);
        b.matmul(&xd, m, &device, None, &mut out);
        let got = b.download(&out, m * rows);
        let mut want = vec![0f32; m * rows];
        let mut first = 0;
        for part in parts {
            let group = fp8_gemm_group(part).expect("each part takes the FP8 GEMM");
            let y = reference(part, &fp8_activations(&x, cols, group), m);
            for i in 0..m {
                want[i * rows + first..i * rows + first + part.rows]
                    .copy_from_slice(&y[i * part.rows..(i + 1) * part.rows]);
            }
            first += part.rows;
        }
        let err = common::relative_error(&got, &want);
        assert!(err < FP8_SUM_TOL, "stacked FP8 parts × {m}: {err}");
    }
}

/// DeepSeek-V4's MXFP4 experts kept packed (17 bytes a group of 32 on the device): the
/// GGML-style GEMV up to 4 rows, dequantized for cuBLAS past that, on generated shapes.
#[test]
fn mxfp4_matrices_match_their_dequantization_and_stay_packed() {
    let b = gpu(false);
    for seed in 90..96u64 {
        let r = splitmix64(seed) as usize;
        let (rows, cols) = (1 + r % 300, 32 * (1 + (r >> 16) % 40));
        let w = mxfp4(rows, cols, seed);
        let device = b.upload_matrix(w.clone());
        let (bytes, format) = b.matrix_footprint(&device);
        assert_eq!(format, "MXFP4");
        assert!(
            bytes <= rows * cols * 17 / 32 + 4,
            "{bytes} bytes for [{rows}, {cols}]"
        );
        check(&b, "MXFP4", w, GEMV, 2e-2);
    }
}

#[test]
fn stacked_parts_of_mixed_formats_write_their_own_rows() {
    let b = gpu(false);
    let stacked = HostMatrix::concat_rows(vec![
        ggml(GgmlType::Q4K, 96, 512, 1),
        ggml(GgmlType::Q6K, 40, 512, 2),
        ggml(GgmlType::Q4K, 7, 512, 3),
    ]);
    assert!(matches!(stacked.data, HostData::Stacked(_)));
    // Up to 4 rows the Q4_K parts take the tensor-core GEMV (f16 weights: its bound), the
    // Q6_K one the f32 GEMV; past that Q6_K has no GEMV and the whole stack goes to cuBLAS.
    check(&b, "Q4_K+Q6_K", stacked, (4, MMA.1), 2e-2);
    // 100 rows of 64-row blocks: the next part starts inside a block, so the parts stay apart.
    let fp8_parts =
        HostMatrix::concat_rows(vec![fp8(100, 256, (64, 64), 4), fp8(64, 256, (64, 64), 5)]);
    assert!(matches!(fp8_parts.data, HostData::Stacked(_)));
    check(&b, "FP8 parts", fp8_parts, MMA, 2e-2);
}

/// The tensor-core GEMV carries activations as f16 scaled by 2^-4, staged in shared memory
/// or not: activations past f16's 65 504 stay finite and exact to its bound, and tiny ones
/// keep their share of the sum.
#[test]
fn the_tensor_core_gemv_holds_large_and_tiny_activations() {
    let b = gpu(false);
    let rows = 48;
    // 8 rows of 3072 overflow the shared memory x is staged in: the unstaged kernel.
    for cols in [1024, 3072] {
        let w = fp8(rows, cols, (1, cols), 21);
        let device = b.upload_matrix(w.clone());
        // 1e-4 lies below 2^-10, among f16 subnormals once scaled: a looser relative bound.
        for (scale, seed, bound) in [(3.0e5f32, 1u64, MMA.1), (1.0e-4, 2, 2e-2), (1.0, 3, MMA.1)] {
            for m in [1, 8] {
                let x: Vec<f32> = common::uniform(seed + m as u64, m * cols)
                    .iter()
                    .map(|v| v * scale)
                    .collect();
                let xd = b.upload(&x);
                let mut out = b.alloc(m * rows);
                b.matmul(&xd, m, &device, None, &mut out);
                let got = b.download(&out, m * rows);
                let err = common::relative_error(&got, &reference(&w, &x, m));
                assert!(
                    err < bound,
                    "activations × {scale}, {m}×{cols}: error {err}"
                );
            }
        }
    }
}

/// The Q4_K GEMV on tensor cores over model-sized rows: every warp several batches deep
/// (K = 14 336), x staged for 1 to 8 rows while it fits and the fallback past that.
#[test]
fn the_tensor_core_q4k_gemv_matches_its_dequantization_at_model_widths() {
    let b = gpu(false);
    for (rows, cols, seed) in [(40, 4096, 41u64), (24, 14336, 42)] {
        let w = ggml(GgmlType::Q4K, rows, cols, seed);
        let device = b.upload_matrix(w.clone());
        for m in [1, 2, 5, 8] {
            let x = common::uniform(seed + m as u64, m * cols);
            let xd = b.upload(&x);
            let mut out = b.alloc(m * rows);
            b.matmul(&xd, m, &device, None, &mut out);
            let got = b.download(&out, m * rows);
            let err = common::relative_error(&got, &reference(&w, &x, m));
            // Past 40 KB of staged x (8 × 4096, 2 × 14 336 and up): dequantized for cuBLAS.
            let tol = if m * cols * 2 <= 40960 { MMA.1 } else { 2e-2 };
            assert!(
                err < tol,
                "Q4_K [{rows}, {cols}] × {m}: error {err} (bound {tol})"
            );
        }
    }
}

/// The MLP's fused activation over a stacked FP8 [gate; up] (per channel and 128-square
/// blocks, one part): silu(gate) · up of the dequantized product, up to 8 rows.
#[test]
fn the_fused_fp8_mlp_activation_matches_silu_of_the_dequantized_product() {
    let b = gpu(false);
    for (seed, block) in [(31u64, (1usize, 0usize)), (32, (128, 128))] {
        let width = 8 + (splitmix64(seed) % 200) as usize;
        let cols = 64 * (1 + (splitmix64(seed + 1) % 40) as usize);
        let block = if block.1 == 0 { (1, cols) } else { block };
        let w = fp8(2 * width, cols, block, seed);
        let device = b.upload_matrix(w.clone());
        for m in [1, 3, 8] {
            let x = common::uniform(seed + 10 * m as u64, m * cols);
            let xd = b.upload(&x);
            let mut gate_up = b.alloc(m * 2 * width);
            let mut out = b.alloc(m * width);
            b.gate_up_silu(&xd, m, &device, width, &mut gate_up, &mut out);
            let got = b.download(&out, m * width);
            let product = reference(&w, &x, m);
            let want: Vec<f32> = (0..m * width)
                .map(|e| {
                    let (i, n) = (e / width, e % width);
                    let (g, u) = (
                        product[i * 2 * width + n],
                        product[i * 2 * width + width + n],
                    );
                    g / (1.0 + (-g).exp()) * u
                })
                .collect();
            let err = common::relative_error(&got, &want);
            assert!(
                err < MMA.1,
                "{block:?} [{width}×2, {cols}] × {m}: error {err}"
            );
        }
    }
}

#[test]
fn the_batch_invariant_mode_dequantizes_packed_weights_for_its_kernel() {
    let b = gpu(true);
    check(
        &b,
        "Q4_K invariant",
        ggml(GgmlType::Q4K, 70, 512, 9),
        GEMV,
        1e-2,
    );
    check(&b, "FP8 invariant", fp8(70, 272, (128, 128), 9), GEMV, 1e-2);
}

#[test]
fn embedding_rows_come_dequantized_from_a_packed_table() {
    let b = gpu(false);
    for (name, table) in [
        ("Q8_0", ggml(GgmlType::Q8_0, 50, 96, 11)),
        ("Q4_K", ggml(GgmlType::Q4K, 50, 256, 12)),
        ("Q6_K", ggml(GgmlType::Q6K, 50, 512, 13)),
        ("FP8", fp8(50, 80, (16, 32), 14)),
    ] {
        let (rows, cols) = (table.rows, table.cols);
        let dense = table.data.clone().into_f32(rows * cols);
        let device = b.upload_matrix(table);
        let ids: Vec<u32> = (0..9)
            .map(|i| (splitmix64(i + 5) % rows as u64) as u32)
            .collect();
        let mut out = b.alloc(ids.len() * cols);
        b.embedding(&device, &ids, &[], &mut out);
        let got = b.download(&out, ids.len() * cols);
        let want: Vec<f32> = ids
            .iter()
            .flat_map(|&id| dense[id as usize * cols..(id as usize + 1) * cols].to_vec())
            .collect();
        assert!(
            common::relative_error(&got, &want) < 1e-6,
            "{name} embedding"
        );
    }
}

/// `--quantization fp8` quantizes on the device exactly as the host does: narrow rows make
/// every element's rounding visible in its dot product.
#[test]
fn on_device_fp8_quantization_equals_the_hosts_and_is_what_the_footprint_says() {
    let b = gpu(false);
    // Widths off the tensor-core GEMV's multiples of 64: f32 activations, so that one byte
    // rounded differently shows.
    for (rows, cols, seed) in [(33, 16, 1), (5, 48, 2), (300, 1008, 3)] {
        let dense = common::uniform(seed, rows * cols);
        let host = Fp8Matrix::quantize_rows(&dense, cols);
        let want = HostMatrix {
            rows,
            cols,
            data: HostData::Fp8(host),
        };
        let to_fp8 = HostMatrix {
            rows,
            cols,
            data: HostData::F32(dense),
        }
        .quantized(Some(troupe::kernels::fp8::Quantization::Fp8));
        let device = b.upload_matrix(to_fp8);
        let (bytes, format) = b.matrix_footprint(&device);
        assert_eq!(
            (bytes, format.as_str()),
            (rows * cols + 4 * rows, "FP8 e4m3 per channel")
        );
        let x = common::uniform(seed + 50, cols);
        let xd = b.upload(&x);
        let mut out = b.alloc(rows);
        b.matmul(&xd, 1, &device, None, &mut out);
        let err = common::relative_error(&b.download(&out, rows), &reference(&want, &x, 1));
        assert!(err < 1e-5, "[{rows}, {cols}]: {err}");
    }
}

/// The tiny FP8 checkpoints (both layouts), `--quantization fp8` of tiny-llama and the
/// K-quant GGUF (Q4_K embedding, Q6_K output and attention output kept packed) on the GPU
/// against transformers on the dequantized weights: greedy tokens equal up to the
/// first step whose top-2 margin is within reach of the bf16 KV cache and prefill GEMMs
/// (0.15: a first run diverged at a margin of 0.077), and at least 5 tokens a model checked.
#[test]
fn fp8_models_generate_transformers_greedy_tokens_on_the_gpu() {
    use common::generate::{GenerateRequest, Generator};
    let goldens = common::goldens();
    let quantize = Some(troupe::kernels::fp8::Quantization::Fp8);
    for (model, reference, quantization, packed_as) in [
        (
            "fp8/tiny-fp8-block",
            "fp8/tiny-fp8-block/reference.json",
            None,
            "FP8",
        ),
        (
            "fp8/tiny-fp8-channel",
            "fp8/tiny-fp8-channel/reference.json",
            None,
            "FP8",
        ),
        (
            "tiny-llama",
            "fp8/tiny-llama-quantized.reference.json",
            quantize,
            "FP8",
        ),
        (
            "tiny-llama-kquants.gguf",
            "tiny-llama-kquants.reference.json",
            None,
            "Q6K",
        ),
    ] {
        let make = || {
            let mut b = gpu(false);
            b.quantization = quantization;
            b
        };
        let mut loaded = troupe::model::load(&goldens.join(model), &make()).unwrap();
        loaded.text.stop_ids.clear();
        let packed = loaded.model.weights.footprint(&make()).card();
        assert!(packed.contains(packed_as), "{model}: {packed}");
        let mut generator = Generator::new(make(), loaded, 16);
        let text = std::fs::read_to_string(goldens.join(reference)).unwrap();
        let reference: serde_json::Value = serde_json::from_str(&text).unwrap();
        let mut checked = 0;
        for case in reference["cases"].as_array().unwrap() {
            let ids = |v: &serde_json::Value| -> Vec<u32> {
                v.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap() as u32)
                    .collect()
            };
            let want = ids(&case["greedy"]);
            let margins: Vec<f64> = case["greedy_margins"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap())
                .collect();
            let request = GenerateRequest {
                prompt_ids: ids(&case["prompt_ids"]),
                max_tokens: want.len(),
                params: Default::default(),
                ignore_eos: true,
            };
            let got = generator
                .generate(&[request], |_| {})
                .unwrap()
                .remove(0)
                .token_ids;
            let sure = margins.iter().take_while(|&&m| m > 0.15).count();
            checked += sure;
            assert_eq!(
                got[..sure],
                want[..sure],
                "{model}: greedy tokens (margins {margins:?})"
            );
        }
        assert!(
            checked >= 5,
            "{model}: only {checked} tokens had a clear margin"
        );
    }
}
