//! The generated Qwen2.5-VL checkpoints of `scripts/make_vision_goldens.py` (issue 64): their
//! references, the processor's patches of their images, prompts as the model and the engine
//! take them, and greedy decoding through the model alone.

use std::path::{Path, PathBuf};

use safetensors::SafeTensors;
use serde_json::Value;
use troupe::api::{EngineRequest, PromptImage};
use troupe::kernels::Backend;
use troupe::kernels::cpu::CpuBackend;
use troupe::model::llama::{LlamaModel, RowMedia, SeqStep};
use troupe::model::loader::SafetensorsSource;
use troupe::model::vision::{
    DecodeLimits, ImagePatches, ImageProcessorConfig, ImageSpan, RgbImage, VisionConfig,
    VisionEncoder,
};
use troupe::sampling::SamplingParams;

/// Block size of the model-only passes.
pub const BLOCK: usize = 16;

pub fn case_dir(name: &str) -> PathBuf {
    super::goldens().join("qwen25vl").join(name)
}

pub struct Reference {
    bytes: Vec<u8>,
}

impl Reference {
    pub fn open(dir: &Path) -> Reference {
        Reference {
            bytes: std::fs::read(dir.join("reference.safetensors")).unwrap(),
        }
    }

    pub fn floats(&self, name: &str) -> Vec<f32> {
        let st = SafeTensors::deserialize(&self.bytes).unwrap();
        let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        t.data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }

    pub fn ints(&self, name: &str) -> Vec<u32> {
        let st = SafeTensors::deserialize(&self.bytes).unwrap();
        let t = st.tensor(name).unwrap();
        t.data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
            .collect()
    }
}

pub fn patches_of(dir: &Path, i: usize) -> ImagePatches {
    let cfg = ImageProcessorConfig::from_file(&dir.join("preprocessor_config.json")).unwrap();
    let bytes = std::fs::read(dir.join(format!("images/{i}.png"))).unwrap();
    let image = RgbImage::decode(&bytes, Some("image/png"), DecodeLimits::default()).unwrap();
    cfg.patches(&image).unwrap()
}

pub fn cases_json(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap()).unwrap()
}

pub fn encoder(dir: &Path) -> VisionEncoder {
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let cfg = VisionConfig::from_hf_json(&json).unwrap();
    let src = SafetensorsSource::open_dir(dir).unwrap();
    VisionEncoder::load(cfg, &src).unwrap()
}

/// A prompt of the goldens, its images' spans and encoder rows.
pub struct Prompt {
    pub ids: Vec<u32>,
    pub spans: Vec<ImageSpan>,
    pub embeds: Vec<Vec<f32>>,
}

pub fn prompts(dir: &Path, enc: &VisionEncoder) -> Vec<Prompt> {
    let cases = cases_json(dir);
    let image_token = cases["image_token_id"].as_u64().unwrap() as u32;
    let mut out = Vec::new();
    for p in cases["prompts"].as_array().unwrap() {
        let ids = super::ids(&p["ids"]);
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
pub fn media_for<'a>(
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

pub fn load_model(dir: &Path, backend: &CpuBackend) -> LlamaModel<CpuBackend> {
    super::load_on(dir, backend).model
}

pub fn exact() -> CpuBackend {
    CpuBackend {
        exact_activations: true,
        ..Default::default()
    }
}

/// A prompt of the goldens as an engine request: its images by their processor rows.
pub fn request(dir: &Path, p: &Value, image_token: u32, max_tokens: usize) -> EngineRequest {
    let ids = super::ids(&p["ids"]);
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

/// `n` greedy tokens after `prompt`, one decode step at a time.
pub fn greedy_of(
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
