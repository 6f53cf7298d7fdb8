//! A request as the Python package sends it (`{"prompt_token_ids", "params", "images"}`,
//! `params` being `troupe.SamplingParams` as a dict, `images` the encoded bytes of
//! `multi_modal_data`'s images) into an `EngineRequest`.

use base64::Engine as _;
use pyo3::PyResult;
use serde::Deserialize;
use serde_json::Value;
use troupe::engine::EngineRequest;
use troupe::model::ModelText;
use troupe::protocol::conversation::ImageInput;
use troupe::protocol::images::expand_inputs;
use troupe::sampling::SamplingParams;

use super::value_error;

/// `troupe.SamplingParams`, field for field (an unknown one is refused by name).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Params {
    n: usize,
    temperature: f32,
    top_p: f32,
    top_k: i64,
    min_p: f32,
    presence_penalty: f32,
    frequency_penalty: f32,
    repetition_penalty: f32,
    seed: Option<u64>,
    stop: Vec<String>,
    stop_token_ids: Vec<u32>,
    ignore_eos: bool,
    max_tokens: Option<usize>,
    min_tokens: usize,
    logprobs: Option<usize>,
    prompt_logprobs: Option<usize>,
    skip_special_tokens: bool,
    logit_bias: Vec<(u32, f32)>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Request {
    /// One placeholder (the model's image token) per image, as vLLM's prompts have them.
    prompt_token_ids: Vec<u32>,
    params: Params,
    /// Base64 of each image's file (PNG, JPEG, WebP or GIF), in prompt order.
    #[serde(default)]
    images: Vec<String>,
    /// The model's context, for `max_tokens: None` (the rest of it).
    max_context_tokens: usize,
}

/// The request, its prompt widened over its images as the server widens a chat's.
pub(crate) fn engine_request(v: &Value, text: &ModelText) -> PyResult<EngineRequest> {
    let mut r: Request = serde_json::from_value(v.clone()).map_err(value_error)?;
    let mut inputs = Vec::with_capacity(r.images.len());
    for (i, data) in r.images.iter().enumerate() {
        let field = format!("multi_modal_data image {i}");
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(data)
            .map_err(|e| value_error(format!("{field}: invalid base64: {e}")))?;
        inputs.push(ImageInput {
            bytes,
            url: None,
            mime: None,
            field,
        });
    }
    let ids = std::mem::take(&mut r.prompt_token_ids);
    let (ids, images) = expand_inputs(&inputs, "multi_modal_data", text, ids)
        .map_err(|e| value_error(format!("{}: {}", e.field, e.message)))?;
    r.prompt_token_ids = ids;
    let p = r.params;
    let top_k = match p.top_k {
        -1 | 0 => 0,
        k if k > 0 => k as usize,
        k => {
            return Err(value_error(format!(
                "top_k must be -1, 0 or positive, got {k}"
            )));
        }
    };
    let max_tokens = match p.max_tokens {
        Some(0) => return Err(value_error("max_tokens must be at least 1")),
        Some(n) => n,
        None => r
            .max_context_tokens
            .saturating_sub(r.prompt_token_ids.len())
            .max(1),
    };
    let params = SamplingParams {
        temperature: p.temperature,
        top_k,
        top_p: p.top_p,
        min_p: p.min_p,
        repetition_penalty: p.repetition_penalty,
        frequency_penalty: p.frequency_penalty,
        presence_penalty: p.presence_penalty,
        logit_bias: p.logit_bias,
        num_top_logprobs: p.logprobs.unwrap_or(0),
        ..Default::default()
    };
    // Ranges, ids and `n` are the engine's to check (`EngineRequest::validate`).
    let mut req = EngineRequest::new(r.prompt_token_ids, max_tokens, params);
    req.n = p.n;
    req.seed = p.seed;
    req.stop = p.stop;
    req.stop_token_ids = p.stop_token_ids;
    req.ignore_eos = p.ignore_eos;
    req.min_tokens = p.min_tokens;
    req.prompt_logprobs = p.prompt_logprobs;
    req.skip_special_tokens = Some(p.skip_special_tokens);
    req.images = images;
    Ok(req)
}
