//! Qwen2.5-VL's vision encoder on the GPU (issue 64): the generated checkpoints' encoder
//! rows against transformers' (f32 references; the GPU's GEMMs take bf16 operands, so
//! within bf16's error), on the committed images and on images of drawn sizes against the
//! host encoder. Needs a GPU: run by the device scripts.
#![cfg(feature = "cuda")]

mod common;

use common::vision::{Reference, case_dir, encoder, patches_of};
use serde_json::Value;
use troupe::kernels::cuda::CudaBackend;
use troupe::model::loader::SafetensorsSource;
use troupe::model::vision::{ImageProcessorConfig, RgbImage, VisionConfig, VisionEncoder};

const CASES: [&str; 3] = ["a", "b", "c"];

fn gpu_encoder(dir: &std::path::Path) -> VisionEncoder<CudaBackend> {
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let cfg = VisionConfig::from_hf_json(&json).unwrap();
    let src = SafetensorsSource::open_dir(dir).unwrap();
    let gpu = CudaBackend::new(0, false, false).unwrap_or_else(|e| panic!("{e}"));
    VisionEncoder::load_on(cfg, &src, gpu).unwrap()
}

#[test]
fn gpu_encoder_rows_equal_transformers() {
    for case in CASES {
        let dir = case_dir(case);
        let reference = Reference::open(&dir);
        let gpu = gpu_encoder(&dir);
        let patches: Vec<_> = (0..4).map(|i| patches_of(&dir, i)).collect();
        for (i, p) in patches.iter().enumerate() {
            let got = gpu.encode(p);
            let want = reference.floats(&format!("image_embeds_{i}"));
            assert_eq!(got.len(), want.len());
            let err = common::relative_error(&got, &want);
            assert!(err < 2e-2, "case {case} image {i}: relative error {err}");
        }
        // The four as one batch, last first.
        let batch: Vec<(&[f32], [usize; 3])> = patches
            .iter()
            .rev()
            .map(|p| (&p.values[..], p.grid))
            .collect();
        for (i, got) in (0..4).rev().zip(gpu.encode_batch(&batch)) {
            let want = reference.floats(&format!("image_embeds_{i}"));
            let err = common::relative_error(&got, &want);
            assert!(
                err < 2e-2,
                "case {case} image {i} in a batch: relative error {err}"
            );
        }
    }
}

#[test]
fn gpu_encoder_equals_the_host_encoder_on_drawn_sizes() {
    let mut rng = common::Rng(640);
    for case in CASES {
        let dir = case_dir(case);
        let (host, gpu) = (encoder(&dir), gpu_encoder(&dir));
        let processor =
            ImageProcessorConfig::from_file(&dir.join("preprocessor_config.json")).unwrap();
        for _ in 0..3 {
            let (w, h) = (28 + rng.below(200), 28 + rng.below(200));
            let pixels: Vec<u8> = (0..w * h * 3).map(|_| rng.next() as u8).collect();
            let image = RgbImage {
                height: h,
                width: w,
                pixels,
            };
            let patches = processor.patches(&image).unwrap();
            let err = common::relative_error(&gpu.encode(&patches), &host.encode(&patches));
            assert!(err < 2e-2, "case {case} {w}x{h}: relative error {err}");
        }
    }
}

/// The segment attention kernels (tensor cores for the head dims they are built for, f32
/// for the rest) against the host's exact one, on drawn segments: one-row windows, windows
/// longer than a chunk of keys, tiles of rows straddling several windows, a row count off
/// every tile.
#[test]
fn gpu_segment_attention_equals_the_host_on_drawn_segments() {
    use troupe::kernels::Backend;
    use troupe::kernels::cpu::CpuBackend;
    let host = CpuBackend {
        exact_activations: true,
        ..CpuBackend::default()
    };
    let gpu = CudaBackend::new(0, false, false).unwrap_or_else(|e| panic!("{e}"));
    let mut rng = common::Rng(6400);
    for head_dim in [8, 16, 32, 64, 80, 128] {
        for _ in 0..3 {
            let heads = 1 + rng.below(3);
            let mut bounds = vec![0];
            while bounds.len() < 2 || rng.below(4) != 0 {
                let len = match rng.below(3) {
                    0 => 1 + rng.below(4),
                    1 => 1 + rng.below(64),
                    _ => 60 + rng.below(200),
                };
                bounds.push(bounds.last().unwrap() + len);
            }
            let rows = *bounds.last().unwrap();
            let n = rows * heads * head_dim;
            let draw = |rng: &mut common::Rng| -> Vec<f32> {
                (0..n)
                    .map(|_| (rng.next() % 2001) as f32 / 1000.0 - 1.0)
                    .collect()
            };
            let (q, k, v) = (draw(&mut rng), draw(&mut rng), draw(&mut rng));
            let mut want = host.alloc(n);
            let (hq, hk, hv) = (host.upload(&q), host.upload(&k), host.upload(&v));
            host.segment_attention(&hq, &hk, &hv, &bounds, heads, head_dim, &mut want);
            let mut got = gpu.alloc(n);
            let (gq, gk, gv) = (gpu.upload(&q), gpu.upload(&k), gpu.upload(&v));
            gpu.segment_attention(&gq, &gk, &gv, &bounds, heads, head_dim, &mut got);
            let (got, want) = (gpu.download(&got, n), host.download(&want, n));
            let err = common::relative_error(&got, &want);
            assert!(
                err < 2e-2,
                "head_dim {head_dim}, {heads} heads, bounds {bounds:?}: relative error {err}"
            );
        }
    }
}
