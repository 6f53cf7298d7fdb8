//! Qwen2.5-VL against transformers (issue 64), on the generated checkpoints of
//! `scripts/make_vision_goldens.py`: the processor's pixels (its Pillow backend bit for bit,
//! its torchvision backend within a few 8-bit levels), the vision encoder's rows, the logits
//! of prompts with one to three images at every position (whole, and in chunks that split
//! an image's tokens, two prompts in one step), and greedy tokens after them.

mod common;

use std::path::{Path, PathBuf};

use safetensors::SafeTensors;
use serde_json::Value;
use troupe::api::{EngineRequest, PromptImage};
use troupe::engine::{Engine, EngineConfig};
use troupe::kernels::Backend;
use troupe::kernels::cpu::CpuBackend;
use troupe::model::llama::{LlamaModel, RowMedia, SeqStep};
use troupe::model::loader::SafetensorsSource;
use troupe::model::vision::{
    DecodeLimits, ImagePatches, ImageProcessorConfig, ImageSpan, RgbImage, VisionConfig,
    VisionEncoder,
};
use troupe::sampling::SamplingParams;

const CASES: [&str; 3] = ["a", "b", "c"];
const LOGIT_TOLERANCE: f32 = 1e-3;
const BLOCK: usize = 16;

fn case_dir(name: &str) -> PathBuf {
    common::goldens().join("qwen25vl").join(name)
}

struct Reference {
    bytes: Vec<u8>,
}

impl Reference {
    fn open(dir: &Path) -> Reference {
        Reference {
            bytes: std::fs::read(dir.join("reference.safetensors")).unwrap(),
        }
    }

    fn floats(&self, name: &str) -> Vec<f32> {
        let st = SafeTensors::deserialize(&self.bytes).unwrap();
        let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        t.data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }

    fn ints(&self, name: &str) -> Vec<u32> {
        let st = SafeTensors::deserialize(&self.bytes).unwrap();
        let t = st.tensor(name).unwrap();
        t.data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
            .collect()
    }
}

fn patches_of(dir: &Path, i: usize) -> ImagePatches {
    let cfg = ImageProcessorConfig::from_file(&dir.join("preprocessor_config.json")).unwrap();
    let bytes = std::fs::read(dir.join(format!("images/{i}.png"))).unwrap();
    let image = RgbImage::decode(&bytes, Some("image/png"), DecodeLimits::default()).unwrap();
    cfg.patches(&image).unwrap()
}

fn cases_json(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap()).unwrap()
}

#[test]
fn pixels_equal_the_processors() {
    for case in CASES {
        let dir = case_dir(case);
        let reference = Reference::open(&dir);
        let cases = cases_json(&dir);
        for (i, image) in cases["images"].as_array().unwrap().iter().enumerate() {
            let got = patches_of(&dir, i);
            let grid: Vec<usize> = image["grid"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as usize)
                .collect();
            assert_eq!(got.grid.to_vec(), grid, "case {case} image {i}: grid");
            let pil = reference.floats(&format!("pixel_values_pil_{i}"));
            assert_eq!(got.values.len(), pil.len(), "case {case} image {i}");
            let exact = got.values.iter().zip(&pil).filter(|(a, b)| a == b).count();
            assert_eq!(
                exact,
                pil.len(),
                "case {case} image {i}: {} of {} values differ from Pillow's",
                pil.len() - exact,
                pil.len()
            );
            // torchvision's uint8 resize rounds its own way: where it upscales several
            // times over, a value may land up to three 8-bit levels from Pillow's
            // (1 / (255 · std) ≤ 0.0151 a level); on average far less than one.
            let tv = reference.floats(&format!("pixel_values_tv_{i}"));
            let diffs: Vec<f32> = got
                .values
                .iter()
                .zip(&tv)
                .map(|(a, b)| (a - b).abs())
                .collect();
            let worst = diffs.iter().fold(0f32, |m, &d| m.max(d));
            let mean = diffs.iter().sum::<f32>() / diffs.len() as f32;
            assert!(
                worst < 3.0 * 0.0152 && mean < 0.004,
                "case {case} image {i}: torchvision off by {worst} at worst, {mean} on average"
            );
        }
    }
}

fn encoder(dir: &Path) -> VisionEncoder {
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let cfg = VisionConfig::from_hf_json(&json).unwrap();
    let src = SafetensorsSource::open_dir(dir).unwrap();
    VisionEncoder::load(cfg, &src).unwrap()
}

#[test]
fn encoder_rows_equal_transformers() {
    for case in CASES {
        let dir = case_dir(case);
        let reference = Reference::open(&dir);
        let enc = encoder(&dir);
        for i in 0..4 {
            let patches = patches_of(&dir, i);
            let got = enc.encode(&patches);
            let want = reference.floats(&format!("image_embeds_{i}"));
            assert_eq!(got.len(), patches.num_tokens() * enc.cfg.out_hidden_size);
            let err = common::relative_error(&got, &want);
            assert!(err < 1e-4, "case {case} image {i}: relative error {err}");
        }
    }
}

/// A prompt of the goldens, its images' spans and encoder rows.
struct Prompt {
    ids: Vec<u32>,
    spans: Vec<ImageSpan>,
    embeds: Vec<Vec<f32>>,
}

fn prompts(dir: &Path, enc: &VisionEncoder) -> Vec<Prompt> {
    let cases = cases_json(dir);
    let image_token = cases["image_token_id"].as_u64().unwrap() as u32;
    let mut out = Vec::new();
    for p in cases["prompts"].as_array().unwrap() {
        let ids = common::ids(&p["ids"]);
        let which: Vec<usize> = p["images"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as usize)
            .collect();
        let mut spans = Vec::new();
        let mut embeds = Vec::new();
        let mut t = 0;
        for &i in &which {
            while ids[t] != image_token {
                t += 1;
            }
            let patches = patches_of(dir, i);
            let [gt, gh, gw] = patches.grid;
            let span = ImageSpan {
                start: t,
                grid: [gt, gh / 2, gw / 2],
            };
            assert!(
                ids[t..t + span.num_tokens()]
                    .iter()
                    .all(|&x| x == image_token)
            );
            t += span.num_tokens();
            spans.push(span);
            embeds.push(enc.encode(&patches));
        }
        out.push(Prompt { ids, spans, embeds });
    }
    out
}

/// The rows of `prompt`'s images that fall in tokens `[lo, hi)`, as the row replaces them.
fn media_for<'a>(
    row: usize,
    prompt: &'a Prompt,
    lo: usize,
    hi: usize,
    hidden: usize,
) -> RowMedia<'a> {
    let mut embeds = Vec::new();
    for (span, rows) in prompt.spans.iter().zip(&prompt.embeds) {
        let (s, e) = (span.start.max(lo), (span.start + span.num_tokens()).min(hi));
        if s < e {
            let first = s - span.start;
            embeds.push((s - lo, &rows[first * hidden..(first + e - s) * hidden]));
        }
    }
    RowMedia {
        row,
        spans: &prompt.spans,
        embeds,
    }
}

fn load_model(dir: &Path, backend: &CpuBackend) -> LlamaModel<CpuBackend> {
    common::load_on(dir, backend).model
}

fn exact() -> CpuBackend {
    CpuBackend {
        exact_activations: true,
        ..Default::default()
    }
}

#[test]
fn logits_equal_transformers_whole_and_in_chunks() {
    let backend = exact();
    for case in CASES {
        let dir = case_dir(case);
        let reference = Reference::open(&dir);
        let enc = encoder(&dir);
        let mut model = load_model(&dir, &backend);
        let hidden = model.cfg.hidden_size;
        let vocab = model.cfg.vocab_size;
        let prompts = prompts(&dir, &enc);
        for (p, prompt) in prompts.iter().enumerate() {
            let want = reference.floats(&format!("logits_{p}"));
            let n = prompt.ids.len();
            let blocks = n.div_ceil(BLOCK);
            let table: Vec<u32> = (0..blocks as u32).rev().collect();
            // Whole.
            let mut cache = backend.alloc_kv_cache(model.kv_cache_shape(blocks, BLOCK));
            let step = SeqStep {
                token_ids: &prompt.ids,
                num_cached_tokens: 0,
                block_table: &table,
                num_logit_rows: n,
                state: None,
            };
            let media = [media_for(0, prompt, 0, n, hidden)];
            let got = model.forward_with_media(&backend, &mut cache, BLOCK, &[step], &media);
            let err = common::relative_error(&got, &want);
            assert!(
                err < LOGIT_TOLERANCE,
                "case {case} prompt {p}: relative error {err}"
            );
            // In three chunks, the cuts inside the first image.
            let first = prompt.spans[0];
            let cuts = [
                0,
                first.start + 1,
                first.start + first.num_tokens() / 2 + 1,
                n,
            ];
            let mut cache = backend.alloc_kv_cache(model.kv_cache_shape(blocks, BLOCK));
            for w in cuts.windows(2) {
                let (lo, hi) = (w[0], w[1]);
                let step = SeqStep {
                    token_ids: &prompt.ids[lo..hi],
                    num_cached_tokens: lo,
                    block_table: &table,
                    num_logit_rows: hi - lo,
                    state: None,
                };
                let media = [media_for(0, prompt, lo, hi, hidden)];
                let got = model.forward_with_media(&backend, &mut cache, BLOCK, &[step], &media);
                let err = common::relative_error(&got, &want[lo * vocab..hi * vocab]);
                assert!(
                    err < LOGIT_TOLERANCE,
                    "case {case} prompt {p}, chunk {lo}..{hi}: relative error {err}"
                );
            }
        }
        // Two prompts in one step, beside a text-only row.
        let text: Vec<u32> = (1..9).collect();
        let (a, b) = (&prompts[0], &prompts[2]);
        let blocks_a = a.ids.len().div_ceil(BLOCK);
        let blocks_b = b.ids.len().div_ceil(BLOCK);
        let total = blocks_a + blocks_b + 1;
        let mut cache = backend.alloc_kv_cache(model.kv_cache_shape(total, BLOCK));
        let ta: Vec<u32> = (0..blocks_a as u32).collect();
        let tb: Vec<u32> = (blocks_a as u32..(blocks_a + blocks_b) as u32).collect();
        let tt = vec![total as u32 - 1];
        let steps = [
            SeqStep {
                token_ids: &text,
                num_cached_tokens: 0,
                block_table: &tt,
                num_logit_rows: 1,
                state: None,
            },
            SeqStep {
                token_ids: &a.ids,
                num_cached_tokens: 0,
                block_table: &ta,
                num_logit_rows: 1,
                state: None,
            },
            SeqStep {
                token_ids: &b.ids,
                num_cached_tokens: 0,
                block_table: &tb,
                num_logit_rows: 1,
                state: None,
            },
        ];
        let media = [
            media_for(1, a, 0, a.ids.len(), hidden),
            media_for(2, b, 0, b.ids.len(), hidden),
        ];
        let got = model.forward_with_media(&backend, &mut cache, BLOCK, &steps, &media);
        for (row, (p, prompt)) in [(1, (0, a)), (2, (2, b))] {
            let want = reference.floats(&format!("logits_{p}"));
            let n = prompt.ids.len();
            let err = common::relative_error(
                &got[row * vocab..(row + 1) * vocab],
                &want[(n - 1) * vocab..n * vocab],
            );
            assert!(
                err < LOGIT_TOLERANCE,
                "case {case} batched prompt {p}: {err}"
            );
        }
    }
}

#[test]
fn greedy_tokens_equal_transformers() {
    let backend = exact();
    for case in CASES {
        let dir = case_dir(case);
        let reference = Reference::open(&dir);
        let enc = encoder(&dir);
        let mut model = load_model(&dir, &backend);
        for (p, prompt) in prompts(&dir, &enc).iter().enumerate() {
            let want = reference.ints(&format!("greedy_{p}"));
            let got = greedy_of(&mut model, &backend, prompt, want.len());
            assert_eq!(got, want, "case {case} prompt {p}");
        }
    }
}

/// A prompt of the goldens as an engine request: its images by their processor rows.
fn request(dir: &Path, p: &Value, image_token: u32, max_tokens: usize) -> EngineRequest {
    let ids = common::ids(&p["ids"]);
    let mut images = Vec::new();
    let mut t = 0;
    for i in p["images"].as_array().unwrap() {
        while ids[t] != image_token {
            t += 1;
        }
        let patches = patches_of(dir, i.as_u64().unwrap() as usize);
        let image = PromptImage::new(t, patches.grid, patches.merge_size, patches.values);
        t += image.num_tokens();
        images.push(image);
    }
    let mut r = EngineRequest::new(ids, max_tokens, SamplingParams::default());
    r.ignore_eos = true;
    r.images = images;
    r
}

/// Through the engine: the image prompts of a case beside text-only requests, prefills
/// cut into chunks of 7 tokens (through images), then again for prefix hits — greedy
/// tokens equal transformers'. The same placeholders over another image of the same grid
/// take no hit from the first: they give that image's tokens.
#[test]
fn the_engine_serves_images_beside_text() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        tokio::time::timeout(std::time::Duration::from_secs(120), async {
            let dir = case_dir("a");
            let reference = Reference::open(&dir);
            let cases = cases_json(&dir);
            let image_token = cases["image_token_id"].as_u64().unwrap() as u32;
            let mut cfg = EngineConfig::new(dir.clone());
            cfg.kv_cache_bytes = 8 << 20;
            cfg.max_step_tokens = 7;
            // Blocks of 4: an image's placeholders fill whole blocks, which could be hits.
            cfg.block_size = 4;
            cfg.exact_activations = true;
            let engine = Engine::spawn(cfg).await.unwrap();
            let prompts = cases["prompts"].as_array().unwrap();
            let want: Vec<Vec<u32>> = (0..prompts.len())
                .map(|p| reference.ints(&format!("greedy_{p}")))
                .collect();
            for round in 0..2 {
                let mut requests: Vec<EngineRequest> = prompts
                    .iter()
                    .map(|p| request(&dir, p, image_token, 8))
                    .collect();
                let mut text = EngineRequest::new((1..30).collect(), 8, SamplingParams::default());
                text.ignore_eos = true;
                requests.push(text);
                let out = common::engine::ok_outputs(&engine, requests).await;
                for (p, want) in want.iter().enumerate() {
                    assert_eq!(&out[p].token_ids, want, "round {round}, prompt {p}");
                }
            }
            let status = engine.status().await.unwrap();
            assert!(status.num_prefix_hit_blocks > 0, "{status:?}");
            // Images 1 and 3 of case "a" share a grid: the same prompt ids over either.
            let enc = encoder(&dir);
            let backend = exact();
            let mut model = load_model(&dir, &backend);
            for image in [1usize, 3] {
                let p = serde_json::json!({"ids": prompts[0]["ids"], "images": [image]});
                let r = request(&dir, &p, image_token, 4);
                assert_eq!(r.images[0].grid, patches_of(&dir, 1).grid);
                let got = common::engine::ok_outputs(&engine, vec![r.clone()]).await;
                // The model's own pass, checked against transformers above.
                let prompt = Prompt {
                    ids: r.prompt_ids.clone(),
                    spans: vec![ImageSpan {
                        start: r.images[0].first_token,
                        grid: r.images[0].token_grid(),
                    }],
                    embeds: vec![enc.encode(&patches_of(&dir, image))],
                };
                let want = greedy_of(&mut model, &backend, &prompt, 4);
                assert_eq!(got[0].token_ids, want, "image {image}");
            }
            engine.shutdown(true).await;
        })
        .await
        .expect("the engine answered within 120 s");
    });
}

/// `n` greedy tokens after `prompt`, one decode step at a time.
fn greedy_of(
    model: &mut LlamaModel<CpuBackend>,
    backend: &CpuBackend,
    prompt: &Prompt,
    n: usize,
) -> Vec<u32> {
    let hidden = model.cfg.hidden_size;
    let total = prompt.ids.len() + n;
    let blocks = total.div_ceil(BLOCK);
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut cache = backend.alloc_kv_cache(model.kv_cache_shape(blocks, BLOCK));
    let mut tokens = prompt.ids.clone();
    let mut cached = 0;
    let mut got = Vec::new();
    while got.len() < n {
        let step = SeqStep {
            token_ids: &tokens[cached..],
            num_cached_tokens: cached,
            block_table: &table,
            num_logit_rows: 1,
            state: None,
        };
        let media = [media_for(0, prompt, cached, tokens.len(), hidden)];
        let logits = model.forward_with_media(backend, &mut cache, BLOCK, &[step], &media);
        let next = logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0 as u32;
        cached = tokens.len();
        tokens.push(next);
        got.push(next);
    }
    got
}

/// What a request's images must be, each refusal naming the image and the problem.
#[test]
fn bad_images_are_refused_by_name() {
    use troupe::api::{ImageLimits, RequestLimits};
    let dir = case_dir("a");
    let text = troupe::model::load_text(&dir).unwrap();
    let cases = cases_json(&dir);
    let image_token = cases["image_token_id"].as_u64().unwrap() as u32;
    let limits = RequestLimits {
        vocab_size: text.config.vocab_size,
        max_context_tokens: text.config.max_context_tokens,
        scores_prompts: true,
        images: ImageLimits::of(&text),
    };
    let good = request(&dir, &cases["prompts"][1], image_token, 4);
    good.validate(limits).unwrap();
    let refused = |r: &EngineRequest, limits: RequestLimits, says: &str| {
        let err = r.validate(limits).unwrap_err().to_string();
        assert!(err.starts_with("images: ") && err.contains(says), "{err}");
    };
    let no_vision = RequestLimits {
        images: None,
        ..limits
    };
    refused(&good, no_vision, "this model takes no images");
    let mut r = good.clone();
    r.images[0].first_token -= 1;
    refused(&r, limits, "is not the image placeholder");
    let mut r = good.clone();
    r.images.swap(0, 1);
    refused(&r, limits, "overlap another image");
    let mut r = good.clone();
    r.images[1].pixels = vec![0.0; 7].into();
    refused(&r, limits, "image 1: 7 pixel values");
    let mut r = good.clone();
    r.prompt_logprobs = Some(1);
    refused(&r, limits, "prompt_logprobs");
}
