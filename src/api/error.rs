//! `EngineError`: why the engine refused or could not serve a request; `RequestError`:
//! what was wrong with a refused request, typed so that each front end names it its own
//! way (the CLI by prompt index, the HTTP APIs by field).

use super::MAX_CHOICES;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("request rejected: {0}")]
    Rejected(#[from] RequestError),
    #[error("engine unavailable: {0}")]
    Unavailable(String),
    /// An actor did not answer a call in time: a hung actor is an error, not a hang.
    #[error("engine unavailable: the {actor} did not answer within {waited_ms} ms")]
    Unresponsive { actor: &'static str, waited_ms: u64 },
    #[error("engine failed to start: {0}")]
    Spawn(String),
    #[error(transparent)]
    Model(#[from] crate::error::TroupeError),
}

/// Why a request was refused for good; checked once, by `EngineRequest::validate` (in
/// `EngineHandle::generate`), except what only the scheduler can know.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RequestError {
    #[error("the prompt is empty: nothing to condition on")]
    EmptyPrompt,
    #[error("prompt token id {token_id} is outside the vocabulary (size {vocab_size})")]
    TokenOutOfRange { token_id: u32, vocab_size: usize },
    #[error(
        "the prompt has {num_prompt_tokens} tokens but the model context is {max_context_tokens} tokens"
    )]
    PromptTooLong {
        num_prompt_tokens: usize,
        max_context_tokens: usize,
    },
    /// A sampling parameter out of its range (the message names it).
    #[error("invalid sampling parameter: {0}")]
    Sampling(String),
    /// A logit bias on a token outside the vocabulary.
    #[error("invalid sampling parameter: {0}")]
    LogitBias(String),
    #[error("n must be in 1..={MAX_CHOICES}, got {0}")]
    Choices(usize),
    #[error("prompt_logprobs: {0}")]
    PromptLogprobs(String),
    /// An image the model cannot take as given (the message names which and why).
    #[error("images: {0}")]
    Images(String),
    /// The grammar does not compile against the vocabulary, or structured output is
    /// unavailable.
    #[error("{0}")]
    Grammar(String),
    /// The scheduler cannot ever serve it (the pool is too small, no state slots, ...).
    #[error("{0}")]
    Unservable(String),
}

impl RequestError {
    /// The error as the CLI reports it: `prompt` names where the prompt came from (`the
    /// prompt`, `p.jsonl line 3`).
    pub fn for_prompt(self, prompt: String) -> crate::error::TroupeError {
        use crate::error::TroupeError;
        match self {
            RequestError::EmptyPrompt => TroupeError::EmptyPrompt { prompt },
            RequestError::TokenOutOfRange {
                token_id,
                vocab_size,
            } => TroupeError::TokenOutOfRange {
                prompt,
                token_id,
                vocab_size,
            },
            RequestError::PromptTooLong {
                num_prompt_tokens,
                max_context_tokens,
            } => TroupeError::PromptTooLong {
                prompt,
                num_prompt_tokens,
                max_context_tokens,
            },
            RequestError::Sampling(m) | RequestError::LogitBias(m) => {
                TroupeError::InvalidSampling(format!("{prompt}: {m}"))
            }
            other => TroupeError::InvalidInput(format!("{prompt}: {other}")),
        }
    }

    /// The request field at fault, as the OpenAI-style APIs name it.
    pub fn field(&self) -> &str {
        match self {
            RequestError::EmptyPrompt | RequestError::TokenOutOfRange { .. } => "prompt",
            RequestError::PromptTooLong { .. } => "messages",
            // `SamplingParams::validate`'s messages open with the parameter's name.
            RequestError::Sampling(m) => m
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .next()
                .filter(|w| !w.is_empty())
                .unwrap_or("sampling"),
            RequestError::LogitBias(_) => "logit_bias",
            RequestError::Choices(_) => "n",
            RequestError::PromptLogprobs(_) => "prompt_logprobs",
            RequestError::Images(_) => "messages",
            RequestError::Grammar(_) | RequestError::Unservable(_) => "request",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::RequestError;
    use crate::sampling::SamplingParams;

    /// An out-of-range sampling parameter is named as the field the client sent, the
    /// `param` of the HTTP error (it read `sampling` for all of them).
    #[test]
    fn a_bad_sampling_parameter_names_itself() {
        type Spoil = fn(&mut SamplingParams);
        let cases: [(&str, Spoil); 7] = [
            ("temperature", |p| p.temperature = -1.0),
            ("top_p", |p| p.top_p = 1.5),
            ("min_p", |p| p.min_p = 2.0),
            ("repetition_penalty", |p| p.repetition_penalty = 0.0),
            ("frequency_penalty", |p| p.frequency_penalty = 9.0),
            ("presence_penalty", |p| p.presence_penalty = -9.0),
            ("top_logprobs", |p| p.num_top_logprobs = 10_000),
        ];
        for (field, spoil) in cases {
            let mut p = SamplingParams::default();
            spoil(&mut p);
            let message = match p.validate().unwrap_err() {
                crate::error::TroupeError::InvalidSampling(m) => m,
                other => panic!("{other}"),
            };
            assert_eq!(RequestError::Sampling(message).field(), field);
        }
        assert_eq!(RequestError::Sampling("?".into()).field(), "sampling");
    }
}
