//! The vision encoder on the CPU or the GPU: images per second of a Qwen2.5-VL checkpoint's encoder
//! at the given sizes, from the processor's patches of seeded noise images (the pixels
//! matter not: every image of a size runs the same work).
//!
//! `VISION_DIR=... cargo bench --bench vision_encoder`; `VISION_SIZES` (`448,1024`: square
//! images, pixels a side), `VISION_REPS` (3), `VISION_DEVICE` (`cpu`, or `cuda` in a build
//! with the `cuda` feature), `VISION_BATCH` (images a pass, 1). `scripts/bench_vision_encoder.py` makes the
//! checkpoint and times transformers' encoder beside it. Prints one JSON line a size.

use std::time::Instant;

use troupe::kernels::Backend;
use troupe::model::loader::SafetensorsSource;
use troupe::model::vision::{ImageProcessorConfig, RgbImage, VisionConfig, VisionEncoder};

fn main() {
    let dir = std::path::PathBuf::from(std::env::var("VISION_DIR").expect("VISION_DIR"));
    let sizes: Vec<u32> = std::env::var("VISION_SIZES")
        .unwrap_or_else(|_| "448,1024".into())
        .split(',')
        .map(|s| s.trim().parse().expect("VISION_SIZES: pixels a side"))
        .collect();
    let reps: usize =
        std::env::var("VISION_REPS").map_or(3, |s| s.parse().expect("VISION_REPS: a count"));
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let cfg = VisionConfig::from_hf_json(&json).unwrap();
    let src = SafetensorsSource::open_dir(&dir).unwrap();
    let processor = ImageProcessorConfig::from_file(&dir.join("preprocessor_config.json")).unwrap();
    match std::env::var("VISION_DEVICE").as_deref() {
        Ok("cpu") | Err(_) => run(
            &VisionEncoder::load(cfg, &src).unwrap(),
            &processor,
            &sizes,
            reps,
        ),
        #[cfg(feature = "cuda")]
        Ok("cuda") => {
            let gpu = troupe::kernels::cuda::CudaBackend::new(0, false, false).unwrap();
            run(
                &VisionEncoder::load_on(cfg, &src, gpu).unwrap(),
                &processor,
                &sizes,
                reps,
            )
        }
        Ok(other) => panic!("VISION_DEVICE={other}: cpu, or cuda in a build with the cuda feature"),
    }
}

/// Images a pass encodes (`VISION_BATCH`, 1): the same image that many times.
fn batch_size() -> usize {
    std::env::var("VISION_BATCH").map_or(1, |s| s.parse().expect("VISION_BATCH: a count"))
}

fn run<B: Backend>(
    encoder: &VisionEncoder<B>,
    processor: &ImageProcessorConfig,
    sizes: &[u32],
    reps: usize,
) {
    for &side in sizes {
        let mut state = 0x5eedu64;
        let pixels: Vec<u8> = (0..side * side * 3)
            .map(|_| {
                state = troupe::sampling::splitmix64(state);
                state as u8
            })
            .collect();
        let image = RgbImage {
            height: side as usize,
            width: side as usize,
            pixels,
        };
        let patches = processor.patches(&image).unwrap();
        let batch = vec![(&patches.values[..], patches.grid); batch_size()];
        // One run to warm the caches and the thread pool.
        encoder.encode_batch(&batch);
        let started = Instant::now();
        for _ in 0..reps {
            std::hint::black_box(encoder.encode_batch(&batch));
        }
        let secs = started.elapsed().as_secs_f64() / (reps * batch.len()) as f64;
        println!(
            "{}",
            serde_json::json!({"side": side, "grid": patches.grid, "batch": batch.len(),
                "secs_per_image": secs,
                "images_per_sec": 1.0 / secs})
        );
    }
}
