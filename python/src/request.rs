//! A request as the Python package sends it (`{"prompt_token_ids", "params"}`, `params`
//! being `troupe.SamplingParams` as a dict) into an `EngineRequest`.

use pyo3::PyResult;
use serde::Deserialize;
use serde_json::Value;
use troupe::engine::EngineRequest;
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
    prompt_token_ids: Vec<u32>,
    params: Params,
    /// The model's context, for `max_tokens: None` (the rest of it).
    max_context_tokens: usize,
}

pub(crate) fn engine_request(v: &Value) -> PyResult<EngineRequest> {
    let r: Request = serde_json::from_value(v.clone()).map_err(value_error)?;
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
    Ok(req)
}
