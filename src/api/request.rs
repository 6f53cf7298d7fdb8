//! A request and the outputs it streams back.

use crate::sampling::{MAX_TOP_LOGPROBS, SamplingParams, ScoredToken};
pub use crate::sched::FinishReason;
pub use crate::step::PromptImage;
use crate::structured::GrammarSpec;

use super::RequestError;

#[derive(Debug, Clone)]
pub struct EngineRequest {
    pub prompt_ids: Vec<u32>,
    pub max_tokens: usize,
    /// Stop tokens (EOS, end of turn) are not sampled before this many tokens.
    pub min_tokens: usize,
    pub params: SamplingParams,
    /// The seed; `params.seed` is not read by the engine. `None`: one is drawn at
    /// admission and reported in the final output, so the run can be reproduced.
    pub seed: Option<u64>,
    pub ignore_eos: bool,
    /// Stop strings, matched on the decoded text across token boundaries; the matched
    /// string and what follows it are not part of the output text.
    pub stop: Vec<String>,
    /// Token ids that end the request, besides the model's EOS / end-of-turn ids.
    pub stop_token_ids: Vec<u32>,
    /// Independent completions of the prompt; they share its KV blocks (the later ones
    /// start from the first one's cached prompt blocks) and are told apart by `index`.
    pub n: usize,
    /// Structured output: every completion matches this grammar.
    pub grammar: Option<GrammarSpec>,
    /// Whether control tokens are left out of the text (`None`: the model's way —
    /// DeepSeek-V4 keeps them, its replies are parsed from them; others skip them).
    pub skip_special_tokens: Option<bool>,
    /// Score the prompt: each prompt token's logprob under the model (and this many of the
    /// most likely ids at each position), reported once, with the first output.
    pub prompt_logprobs: Option<usize>,
    /// The prompt's images, in prompt order: each covers its placeholder tokens.
    pub images: Vec<PromptImage>,
}

/// The most completions one request may ask for.
pub const MAX_CHOICES: usize = 64;

/// The seed completion `index` of a request seeded `seed` draws with: completion 0 keeps
/// it, the others get their own, derived.
pub fn choice_seed(seed: u64, index: usize) -> u64 {
    if index == 0 {
        seed
    } else {
        crate::sampling::splitmix64(seed ^ index as u64)
    }
}

/// What a request is checked against.
#[derive(Debug, Clone, Copy)]
pub struct RequestLimits {
    pub vocab_size: usize,
    pub max_context_tokens: usize,
    /// The model returns every position's logits (`EngineRequest::prompt_logprobs`).
    pub scores_prompts: bool,
    /// A vision-language model: what its images must look like; `None`: it takes none.
    pub images: Option<ImageLimits>,
}

/// What a vision-language model's images must be.
#[derive(Debug, Clone, Copy)]
pub struct ImageLimits {
    /// The placeholder every token of an image is in the prompt.
    pub token_id: u32,
    /// Values per patch.
    pub patch_len: usize,
    /// Patches merged `merge × merge` into a token.
    pub merge: usize,
}

impl ImageLimits {
    /// A model's, where it takes images.
    pub fn of(text: &crate::model::ModelText) -> Option<ImageLimits> {
        text.vision.as_ref().map(|v| ImageLimits {
            token_id: v.image_token_id,
            patch_len: v.patch_len,
            merge: v.processor.merge_size,
        })
    }
}

impl EngineRequest {
    /// Everything about the request that can be checked without the scheduler's state.
    pub fn validate(&self, limits: RequestLimits) -> Result<(), RequestError> {
        if self.prompt_ids.is_empty() {
            return Err(RequestError::EmptyPrompt);
        }
        // Checked here, not in the kernels: a bad id would crash the rank worker on every
        // recompute and take the whole engine down with it.
        if let Some(&token_id) = self
            .prompt_ids
            .iter()
            .find(|&&t| t as usize >= limits.vocab_size)
        {
            return Err(RequestError::TokenOutOfRange {
                token_id,
                vocab_size: limits.vocab_size,
            });
        }
        if self.prompt_ids.len() >= limits.max_context_tokens {
            return Err(RequestError::PromptTooLong {
                num_prompt_tokens: self.prompt_ids.len(),
                max_context_tokens: limits.max_context_tokens,
            });
        }
        let message = |e: crate::error::TroupeError| match e {
            crate::error::TroupeError::InvalidSampling(m) => m,
            other => other.to_string(),
        };
        self.params
            .validate()
            .map_err(|e| RequestError::Sampling(message(e)))?;
        self.params
            .validate_for_vocab(limits.vocab_size)
            .map_err(|e| RequestError::LogitBias(message(e)))?;
        if self.n == 0 || self.n > MAX_CHOICES {
            return Err(RequestError::Choices(self.n));
        }
        self.validate_images(limits.images)?;
        if let Some(k) = self.prompt_logprobs {
            if !limits.scores_prompts {
                return Err(RequestError::PromptLogprobs(
                    "this model does not report prompt logprobs".into(),
                ));
            }
            if k > MAX_TOP_LOGPROBS {
                return Err(RequestError::PromptLogprobs(format!(
                    "at most {MAX_TOP_LOGPROBS} top ids per prompt position, got {k}"
                )));
            }
        }
        Ok(())
    }

    /// Each image in order, over placeholders of its own, pixels of its grid's size.
    fn validate_images(&self, limits: Option<ImageLimits>) -> Result<(), RequestError> {
        if self.images.is_empty() {
            return Ok(());
        }
        let bad = |m: String| Err(RequestError::Images(m));
        let Some(limits) = limits else {
            return bad("this model takes no images".into());
        };
        if self.prompt_logprobs.is_some() {
            return bad("prompt_logprobs is not available for prompts with images".into());
        }
        let mut end = 0;
        for (i, image) in self.images.iter().enumerate() {
            let [t, h, w] = image.grid;
            if image.merge != limits.merge || t == 0 || h % image.merge != 0 || w % image.merge != 0
            {
                return bad(format!(
                    "image {i}: grid {:?} is not whole merged patches",
                    image.grid
                ));
            }
            if image.pixels.len() != t * h * w * limits.patch_len {
                return bad(format!(
                    "image {i}: {} pixel values for a {t}x{h}x{w} grid of {}-value patches",
                    image.pixels.len(),
                    limits.patch_len
                ));
            }
            if image.first_token < end || image.end_token() > self.prompt_ids.len() {
                return bad(format!(
                    "image {i}: tokens {}..{} overlap another image or pass the prompt's end",
                    image.first_token,
                    image.end_token()
                ));
            }
            if let Some(at) = self.prompt_ids[image.first_token..image.end_token()]
                .iter()
                .position(|&id| id != limits.token_id)
            {
                return bad(format!(
                    "image {i}: prompt token {} is not the image placeholder {}",
                    image.first_token + at,
                    limits.token_id
                ));
            }
            end = image.end_token();
        }
        Ok(())
    }

    pub fn new(prompt_ids: Vec<u32>, max_tokens: usize, params: SamplingParams) -> Self {
        EngineRequest {
            prompt_ids,
            max_tokens,
            min_tokens: 0,
            params,
            seed: None,
            ignore_eos: false,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            n: 1,
            grammar: None,
            skip_special_tokens: None,
            prompt_logprobs: None,
            images: Vec::new(),
        }
    }
}

/// One increment of a request's output. The last one carries `finish_reason` (or `error`).
#[derive(Debug, Clone, Default)]
pub struct RequestOutput {
    pub request_id: u64,
    /// Which of the request's `n` completions this belongs to.
    pub index: usize,
    pub token_ids: Vec<u32>,
    /// Text of `token_ids`, held back while it ends inside a multi-byte character.
    pub text: String,
    /// Per token in `token_ids`: its log-probability under the distribution it was
    /// sampled from (or the raw model's, with `raw_logprobs`).
    pub token_logprobs: Vec<f32>,
    /// Per token in `token_ids`: the most likely `(id, logprob)` pairs.
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    /// On the first output of a request asking for `prompt_logprobs`: per prompt token, its
    /// score (`None` for the first, which nothing precedes).
    pub prompt_logprobs: Option<Vec<Option<ScoredToken>>>,
    /// The seed the request ran with (set on the final output).
    pub seed: Option<u64>,
    pub finish_reason: Option<FinishReason>,
    /// On the final output: the stop string that ended the text, if one did.
    pub stop_string: Option<String>,
    pub error: Option<String>,
}

impl RequestOutput {
    pub fn is_final(&self) -> bool {
        self.finish_reason.is_some() || self.error.is_some()
    }
}
