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
    /// The grammar does not compile against the vocabulary, or structured output is
    /// unavailable.
    #[error("{0}")]
    Grammar(String),
    /// The scheduler cannot ever serve it (the pool is too small, no state slots, ...).
    #[error("{0}")]
    Unservable(String),
}

impl RequestError {
    /// The error as the CLI reports it: named by the prompt's place in the input.
    pub fn for_prompt(self, index: usize) -> crate::error::TroupeError {
        use crate::error::TroupeError;
        match self {
            RequestError::EmptyPrompt => TroupeError::EmptyPrompt { index },
            RequestError::TokenOutOfRange {
                token_id,
                vocab_size,
            } => TroupeError::TokenOutOfRange {
                index,
                token_id,
                vocab_size,
            },
            RequestError::PromptTooLong {
                num_prompt_tokens,
                max_context_tokens,
            } => TroupeError::PromptTooLong {
                index,
                num_prompt_tokens,
                max_context_tokens,
            },
            RequestError::Sampling(m) | RequestError::LogitBias(m) => {
                TroupeError::InvalidSampling(m)
            }
            other => TroupeError::InvalidInput(format!("prompt {index}: {other}")),
        }
    }

    /// The request field at fault, as the OpenAI-style APIs name it.
    pub fn field(&self) -> &'static str {
        match self {
            RequestError::EmptyPrompt | RequestError::TokenOutOfRange { .. } => "prompt",
            RequestError::PromptTooLong { .. } => "messages",
            RequestError::Sampling(_) => "sampling",
            RequestError::LogitBias(_) => "logit_bias",
            RequestError::Choices(_) => "n",
            RequestError::PromptLogprobs(_) => "prompt_logprobs",
            RequestError::Grammar(_) | RequestError::Unservable(_) => "request",
        }
    }
}
