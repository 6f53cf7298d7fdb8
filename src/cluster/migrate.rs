//! `serve --drain-to PEER|auto`: an engine being stopped hands its unfinished requests to a
//! peer. Each request leaves the engine (`EngineHandle::detach_movable`), its blocks go to
//! the peer's prefix store as a prefill engine's do, and the peer continues it from its
//! prompt and generated tokens (`Continuation`); the peer's outputs come back to this
//! engine's agent (`MovedOutput`), which puts them on the caller's channel, so the
//! client's stream — held by this process — never breaks.

use serde::{Deserialize, Serialize};

use crate::engine::{Detached, EngineRequest, FinishReason, RequestOutput};
use crate::sampling::SamplingParams;

/// What the server's drain asks of its agent; JSON.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DrainAsk {
    /// `--drain-to`: a peer's name, `auto`, or none (nothing moves).
    pub target: Option<String>,
    /// After this long, moved requests still unfinished end with an error.
    pub cancel_after_secs: f64,
}

/// A request as a peer continues it; crosses the network as JSON.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Continuation {
    /// Which of the origin's moves this is.
    pub move_id: u64,
    /// The node whose agent gets the outputs.
    pub origin: String,
    /// The prompt and every token generated so far.
    pub prompt_ids: Vec<u32>,
    /// Tokens left to generate.
    pub max_tokens: usize,
    pub min_tokens: usize,
    pub seed: u64,
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub logit_bias: Vec<(u32, f32)>,
    pub num_top_logprobs: usize,
    pub raw_logprobs: bool,
    pub ignore_eos: bool,
    pub stop_token_ids: Vec<u32>,
}

impl Continuation {
    /// `d` as a peer continues it (stop strings stay with the origin, which decodes the
    /// text: it ends the stream at one).
    pub fn of(d: &Detached, origin: &str, move_id: u64) -> Self {
        let (r, p) = (&d.request, &d.request.params);
        let generated = d.generated.len();
        Continuation {
            move_id,
            origin: origin.to_string(),
            prompt_ids: r.prompt_ids.iter().chain(&d.generated).copied().collect(),
            max_tokens: r.max_tokens.saturating_sub(generated),
            min_tokens: r.min_tokens.saturating_sub(generated),
            seed: r.seed.unwrap_or_default(),
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            min_p: p.min_p,
            repetition_penalty: p.repetition_penalty,
            logit_bias: p.logit_bias.clone(),
            num_top_logprobs: p.num_top_logprobs,
            raw_logprobs: p.raw_logprobs,
            ignore_eos: r.ignore_eos,
            stop_token_ids: r.stop_token_ids.clone(),
        }
    }

    pub fn request(&self) -> EngineRequest {
        let params = SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            logit_bias: self.logit_bias.clone(),
            num_top_logprobs: self.num_top_logprobs,
            raw_logprobs: self.raw_logprobs,
            ..SamplingParams::default()
        };
        let mut r = EngineRequest::new(self.prompt_ids.clone(), self.max_tokens, params);
        r.min_tokens = self.min_tokens;
        r.seed = Some(self.seed);
        r.ignore_eos = self.ignore_eos;
        r.stop_token_ids = self.stop_token_ids.clone();
        r
    }
}

/// One output of a continued request, on its way back to the origin; JSON.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct MovedOutput {
    pub move_id: u64,
    pub token_ids: Vec<u32>,
    pub token_logprobs: Vec<f32>,
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    /// `stop`, `length`, `abort`; none before the last.
    pub finish_reason: Option<String>,
    pub error: Option<String>,
}

impl MovedOutput {
    pub fn of(move_id: u64, out: RequestOutput) -> Self {
        let finish_reason = out.finish_reason.map(|f| {
            match f {
                FinishReason::Stop => "stop",
                FinishReason::Length => "length",
                FinishReason::Abort | FinishReason::Preempted => "abort",
            }
            .to_string()
        });
        MovedOutput {
            move_id,
            token_ids: out.token_ids,
            token_logprobs: out.token_logprobs,
            top_logprobs: out.top_logprobs,
            finish_reason,
            error: out.error,
        }
    }

    pub fn is_final(&self) -> bool {
        self.finish_reason.is_some() || self.error.is_some()
    }

    /// As the origin's caller reads it: request `request_id`'s only completion, seeded
    /// `seed` (reported on the last output).
    pub fn into_output(self, request_id: u64, seed: u64) -> RequestOutput {
        let finish_reason = self.finish_reason.as_deref().map(|f| match f {
            "stop" => FinishReason::Stop,
            "length" => FinishReason::Length,
            _ => FinishReason::Abort,
        });
        let last = finish_reason.is_some() || self.error.is_some();
        RequestOutput {
            request_id,
            index: 0,
            token_ids: self.token_ids,
            token_logprobs: self.token_logprobs,
            top_logprobs: self.top_logprobs,
            seed: last.then_some(seed),
            finish_reason,
            error: self.error,
            ..RequestOutput::default()
        }
    }
}
