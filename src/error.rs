//! The one error type at the library boundary. Every variant names what was wrong and,
//! where there is one, what the user can do about it; the CLI prints it and exits 2.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum TroupeError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a valid GGUF file: {reason}")]
    Gguf { path: PathBuf, reason: String },
    #[error("{path}: {reason}")]
    ModelFormat { path: PathBuf, reason: String },
    #[error("unsupported architecture `{0}` (supported: llama, mistral, smollm2, qwen2, qwen3)")]
    UnsupportedArchitecture(String),
    #[error("tensor `{name}`: {reason}")]
    Tensor { name: String, reason: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// `prompt` names it as the user gave it: `the prompt`, or a line of `--prompts-file`.
    #[error(
        "{prompt} has {num_prompt_tokens} tokens but the model context is {max_context_tokens} tokens"
    )]
    PromptTooLong {
        prompt: String,
        num_prompt_tokens: usize,
        max_context_tokens: usize,
    },
    #[error("{prompt} is empty: nothing to condition on")]
    EmptyPrompt { prompt: String },
    #[error("token id {token_id} in {prompt} is outside the vocabulary (size {vocab_size})")]
    TokenOutOfRange {
        prompt: String,
        token_id: u32,
        vocab_size: usize,
    },
    #[error("invalid sampling parameter: {0}")]
    InvalidSampling(String),
    #[error("{0}")]
    InvalidInput(String),
    #[error("cannot fetch the model `{name}`: {reason}")]
    Fetch { name: String, reason: String },
}

pub type Result<T, E = TroupeError> = std::result::Result<T, E>;

impl TroupeError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        TroupeError::Io {
            path: path.into(),
            source,
        }
    }
}
