//! Speculation's configuration checked against the model before anything starts: how
//! many drafts a row may carry, whether an MTP layer drafts, the draft model's shape.

use super::{EngineConfig, EngineError, SpecConfig, SpecMethod};
use crate::model;

/// Drafts per row the scheduler may plan (0: speculation off), or why the configuration
/// cannot run.
pub(super) fn speculative_tokens(spec: Option<SpecConfig>) -> Result<usize, EngineError> {
    let Some(spec) = spec else {
        return Ok(0);
    };
    if !(1..=16).contains(&spec.num_speculative_tokens) {
        return Err(EngineError::Spawn(format!(
            "num_speculative_tokens must be in 1..=16, got {}",
            spec.num_speculative_tokens
        )));
    }
    Ok(spec.num_speculative_tokens)
}

/// `--spec mtp`: whether the model's MTP layer drafts (only DeepSeek-V4 has one here,
/// and it runs beside a lone rank).
pub(super) fn mtp_drafts(cfg: &EngineConfig, text: &model::ModelText) -> Result<bool, EngineError> {
    if cfg.speculative.is_none_or(|s| s.method != SpecMethod::Mtp) {
        return Ok(false);
    }
    let refuse = |why: String| Err(EngineError::Spawn(format!("--spec mtp: {why}")));
    if text.deepseek_v4.is_none() {
        return refuse(format!(
            "{} has no MTP layer (the Llama family has none; DeepSeek-V4 checkpoints ship one)",
            cfg.model_path.display()
        ));
    }
    if cfg.tensor_parallel_size > 1 {
        return refuse(format!(
            "the MTP layer runs on one rank; tensor_parallel_size is {}",
            cfg.tensor_parallel_size
        ));
    }
    Ok(true)
}

/// `--spec draft`'s draft model, checked against the model it drafts for: its shape, or
/// why the pair cannot run.
pub(super) fn draft_model(
    cfg: &EngineConfig,
    text: &model::ModelText,
) -> Result<Option<model::config::ModelConfig>, EngineError> {
    let wants = cfg
        .speculative
        .is_some_and(|s| s.method == SpecMethod::DraftModel);
    let path = match (&cfg.draft_model_path, wants) {
        (None, false) => return Ok(None),
        (Some(p), false) => {
            return Err(EngineError::Spawn(format!(
                "a draft model ({}) was given without --spec draft",
                p.display()
            )));
        }
        (None, true) => {
            return Err(EngineError::Spawn(
                "--spec draft needs --draft-model (a smaller model with the same tokenizer)".into(),
            ));
        }
        (Some(p), true) => p,
    };
    let refuse = |why: String| Err(EngineError::Spawn(format!("--spec draft: {why}")));
    if text.deepseek_v4.is_some() {
        return refuse(
            "DeepSeek-V4 models draft with --spec ngram or --spec mtp (their own MTP layer)".into(),
        );
    }
    if cfg.tensor_parallel_size > 1 {
        return refuse(format!(
            "the draft model runs on one rank; tensor_parallel_size is {}",
            cfg.tensor_parallel_size
        ));
    }
    let draft = model::load_text(path)?;
    if draft.deepseek_v4.is_some() {
        return refuse(format!(
            "{} is a DeepSeek-V4 model; drafts come from the Llama family",
            path.display()
        ));
    }
    let (want, got) = (text.config.vocab_size, draft.config.vocab_size);
    if want != got {
        return refuse(format!(
            "{} has a vocabulary of {got} tokens, the model {want}: a draft model must share the tokenizer",
            path.display()
        ));
    }
    Ok(Some(draft.config))
}
