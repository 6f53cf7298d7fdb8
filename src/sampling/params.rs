//! Per-request sampling parameters and their validation. Every bound is checked before a
//! request is admitted, so the sampler itself never meets a value it cannot honour.

use crate::error::{Result, TroupeError};

/// The most `num_top_logprobs` a request may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;
/// The largest |bias| of a `logit_bias` entry (OpenAI's limit).
pub const MAX_LOGIT_BIAS: f32 = 100.0;
/// The largest |frequency_penalty| and |presence_penalty| (OpenAI's limit).
pub const MAX_PENALTY: f32 = 2.0;

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: usize,
    /// Smallest set of most likely tokens whose probability reaches `top_p`; 1 means off.
    pub top_p: f32,
    /// Drops tokens less likely than `min_p` × the most likely one; 0 means off.
    pub min_p: f32,
    /// vLLM / HF semantics over prompt + output tokens: a positive logit is divided by it, a
    /// negative one multiplied. 1 means off.
    pub repetition_penalty: f32,
    /// OpenAI semantics: subtracted once per occurrence of the token in the output so far.
    pub frequency_penalty: f32,
    /// OpenAI semantics: subtracted once if the token occurs in the output so far.
    pub presence_penalty: f32,
    /// `(token id, bias)` added to the raw logits; a repeated id adds each of its biases.
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: u64,
    /// How many of the most likely tokens to report with their log-probabilities.
    pub num_top_logprobs: usize,
    /// Report logprobs of the raw model distribution (log_softmax of the unprocessed
    /// logits) instead of the distribution actually sampled from.
    pub raw_logprobs: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: 0,
            num_top_logprobs: 0,
            raw_logprobs: false,
        }
    }
}

fn invalid(message: String) -> Result<()> {
    Err(TroupeError::InvalidSampling(message))
}

impl SamplingParams {
    /// Temperature 0: the token is the argmax of the processed logits, no draw.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// No processor changes the logits: the distribution is the raw logits' after
    /// temperature and the cuts, and nothing but the token is reported.
    pub fn has_no_processors(&self) -> bool {
        self.logit_bias.is_empty()
            && self.repetition_penalty == 1.0
            && self.frequency_penalty == 0.0
            && self.presence_penalty == 0.0
            && self.num_top_logprobs == 0
            && !self.raw_logprobs
    }

    /// Checks every parameter that does not depend on the model; the error names the
    /// parameter and the offending value.
    pub fn validate(&self) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return invalid(format!(
                "temperature must be a finite number ≥ 0, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return invalid(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return invalid(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !self.repetition_penalty.is_finite() || self.repetition_penalty <= 0.0 {
            return invalid(format!(
                "repetition_penalty must be a finite number > 0 (1 = off), got {}",
                self.repetition_penalty
            ));
        }
        for (name, value) in [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            if !(-MAX_PENALTY..=MAX_PENALTY).contains(&value) {
                return invalid(format!(
                    "{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value}"
                ));
            }
        }
        for &(token_id, bias) in &self.logit_bias {
            if !(-MAX_LOGIT_BIAS..=MAX_LOGIT_BIAS).contains(&bias) {
                return invalid(format!(
                    "logit_bias of token {token_id} must be in \
                     [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {bias}"
                ));
            }
        }
        if self.num_top_logprobs > MAX_TOP_LOGPROBS {
            return invalid(format!(
                "top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {}",
                self.num_top_logprobs
            ));
        }
        Ok(())
    }

    /// `validate`, plus the checks that need the model: every `logit_bias` id must name a
    /// token of a vocabulary of `vocab_size`.
    pub fn validate_for_vocab(&self, vocab_size: usize) -> Result<()> {
        self.validate()?;
        for &(token_id, _) in &self.logit_bias {
            if token_id as usize >= vocab_size {
                return invalid(format!(
                    "logit_bias names token {token_id}, outside the vocabulary \
                     (size {vocab_size}, ids 0..={})",
                    vocab_size.saturating_sub(1)
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_parameters_are_valid_and_greedy() {
        let p = SamplingParams::default();
        assert!(p.validate().is_ok() && p.validate_for_vocab(1).is_ok());
        assert!(p.is_greedy());
        assert!(
            !SamplingParams {
                temperature: 0.1,
                ..p
            }
            .is_greedy()
        );
        let edges = SamplingParams {
            temperature: 2.0,
            top_p: 1.0,
            min_p: 1.0,
            repetition_penalty: 0.01,
            frequency_penalty: -2.0,
            presence_penalty: 2.0,
            logit_bias: vec![(0, -100.0), (9, 100.0)],
            num_top_logprobs: 20,
            ..Default::default()
        };
        assert!(edges.validate_for_vocab(10).is_ok());
    }

    #[test]
    fn each_invalid_parameter_is_named_with_its_value() {
        fn check(set: impl Fn(&mut SamplingParams), name: &str, value: &str) {
            let mut params = SamplingParams::default();
            set(&mut params);
            let message = params.validate().unwrap_err().to_string();
            assert!(
                message.contains(name) && message.contains(value),
                "{params:?}: `{message}` should name {name} and {value}"
            );
            assert!(params.validate_for_vocab(1 << 20).is_err());
        }
        check(|p| p.temperature = -1.0, "temperature", "-1");
        check(|p| p.temperature = f32::NAN, "temperature", "NaN");
        check(|p| p.temperature = f32::INFINITY, "temperature", "inf");
        check(|p| p.top_p = 0.0, "top_p", "got 0");
        check(|p| p.top_p = 1.5, "top_p", "1.5");
        check(|p| p.top_p = f32::NAN, "top_p", "NaN");
        check(|p| p.min_p = -0.1, "min_p", "-0.1");
        check(|p| p.min_p = 1.01, "min_p", "1.01");
        check(|p| p.min_p = f32::NAN, "min_p", "NaN");
        check(
            |p| p.repetition_penalty = 0.0,
            "repetition_penalty",
            "got 0",
        );
        check(
            |p| p.repetition_penalty = -1.5,
            "repetition_penalty",
            "-1.5",
        );
        check(
            |p| p.repetition_penalty = f32::INFINITY,
            "repetition_penalty",
            "inf",
        );
        check(
            |p| p.repetition_penalty = f32::NAN,
            "repetition_penalty",
            "NaN",
        );
        check(|p| p.frequency_penalty = 2.5, "frequency_penalty", "2.5");
        check(|p| p.frequency_penalty = -3.0, "frequency_penalty", "-3");
        check(
            |p| p.frequency_penalty = f32::NAN,
            "frequency_penalty",
            "NaN",
        );
        check(|p| p.presence_penalty = 2.1, "presence_penalty", "2.1");
        check(|p| p.presence_penalty = -2.1, "presence_penalty", "-2.1");
        check(
            |p| p.logit_bias = vec![(3, 1.0), (7, 150.0)],
            "logit_bias of token 7",
            "150",
        );
        check(
            |p| p.logit_bias = vec![(7, -100.5)],
            "logit_bias of token 7",
            "-100.5",
        );
        check(
            |p| p.logit_bias = vec![(7, f32::NAN)],
            "logit_bias of token 7",
            "NaN",
        );
        check(|p| p.num_top_logprobs = 21, "top_logprobs", "21");
    }

    #[test]
    fn logit_bias_ids_are_checked_against_the_vocabulary() {
        let p = SamplingParams {
            logit_bias: vec![(9, 1.0), (10, 1.0)],
            ..Default::default()
        };
        assert!(p.validate().is_ok(), "ids need the vocabulary");
        let message = p.validate_for_vocab(10).unwrap_err().to_string();
        assert!(
            message.contains("logit_bias")
                && message.contains("token 10")
                && message.contains("size 10")
        );
        assert!(p.validate_for_vocab(11).is_ok());
    }
}
