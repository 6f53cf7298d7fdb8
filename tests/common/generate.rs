//! Offline generation over a batch of requests: every step runs all unfinished sequences
//! together (prefills first, then one decode token each) over one paged KV cache.
//!
//! The one-process reference loop the engine's scheduler replaced, kept for the tests
//! that compare the engine and the models against it (a list of `SeqStep`s a step).
#![allow(dead_code)]

use troupe::error::{Result, TroupeError};
use troupe::kernels::Backend;
use troupe::model::LoadedModel;
use troupe::model::llama::SeqStep;
use troupe::sampling::{Sampler, SamplingParams, top_logprobs};

pub const DEFAULT_BLOCK_SIZE: usize = troupe::engine::DEFAULT_BLOCK_SIZE;

#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt_ids: Vec<u32>,
    pub max_tokens: usize,
    pub params: SamplingParams,
    /// Keep generating past stop tokens (benchmarks need a fixed output length).
    pub ignore_eos: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token (EOS / end of turn) was produced; it is not part of the output.
    Stop,
    /// `max_tokens` or the context length was reached.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

#[derive(Debug, Clone)]
pub struct GenerateOutput {
    pub prompt_ids: Vec<u32>,
    pub token_ids: Vec<u32>,
    pub finish_reason: FinishReason,
    /// Per generated token, the most likely `(id, logprob)` pairs of the model's distribution.
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
}

struct SeqState {
    block_table: Vec<u32>,
    num_cached_tokens: usize,
    /// Tokens to feed next step: the prompt at first, then the last sampled token.
    pending: Vec<u32>,
    max_tokens: usize,
    output: GenerateOutput,
    done: bool,
}

/// Wall time split by step kind, for `--stats` and the benchmarks.
#[derive(Debug, Clone, Copy, Default)]
pub struct GenerateStats {
    pub num_prefill_tokens: usize,
    pub prefill_secs: f64,
    pub num_decode_tokens: usize,
    pub decode_secs: f64,
}

pub struct Generator<B: Backend> {
    pub backend: B,
    pub model: LoadedModel<B>,
    pub block_size: usize,
    /// What the KV cache stores (`KvDtype`).
    pub kv_dtype: troupe::kernels::KvDtype,
    cache: Option<B::KvCache>,
    num_cache_blocks: usize,
    sampler: Sampler,
    pub stats: GenerateStats,
}

impl<B: Backend> Generator<B> {
    pub fn new(backend: B, model: LoadedModel<B>, block_size: usize) -> Self {
        Generator {
            backend,
            model,
            block_size,
            kv_dtype: troupe::kernels::KvDtype::Auto,
            cache: None,
            num_cache_blocks: 0,
            sampler: Sampler::default(),
            stats: GenerateStats::default(),
        }
    }

    fn validate(&self, index: usize, req: &GenerateRequest) -> Result<()> {
        let cfg = &self.model.model.cfg;
        let prompt = format!("prompt {index}");
        if req.prompt_ids.is_empty() {
            return Err(TroupeError::EmptyPrompt { prompt });
        }
        if let Some(&bad) = req
            .prompt_ids
            .iter()
            .find(|&&t| t as usize >= cfg.vocab_size)
        {
            return Err(TroupeError::TokenOutOfRange {
                prompt,
                token_id: bad,
                vocab_size: cfg.vocab_size,
            });
        }
        if req.prompt_ids.len() >= cfg.max_context_tokens {
            return Err(TroupeError::PromptTooLong {
                prompt,
                num_prompt_tokens: req.prompt_ids.len(),
                max_context_tokens: cfg.max_context_tokens,
            });
        }
        req.params.validate()
    }

    /// Runs all requests to completion; outputs come back in request order.
    pub fn generate(
        &mut self,
        reqs: &[GenerateRequest],
        mut on_token: impl FnMut(usize),
    ) -> Result<Vec<GenerateOutput>> {
        for (i, r) in reqs.iter().enumerate() {
            self.validate(i, r)?;
        }
        let ctx = self.model.model.cfg.max_context_tokens;
        let bs = self.block_size;
        let mut next_block = 0u32;
        let mut seqs: Vec<SeqState> = reqs
            .iter()
            .map(|r| {
                let max_tokens = r.max_tokens.min(ctx - r.prompt_ids.len());
                // The last sampled token is never fed back, so it needs no slot.
                let num_slots = r.prompt_ids.len() + max_tokens.saturating_sub(1);
                let num_blocks = num_slots.div_ceil(bs).max(1) as u32;
                let block_table = (next_block..next_block + num_blocks).collect();
                next_block += num_blocks;
                SeqState {
                    block_table,
                    num_cached_tokens: 0,
                    pending: r.prompt_ids.clone(),
                    max_tokens,
                    output: GenerateOutput {
                        prompt_ids: r.prompt_ids.clone(),
                        token_ids: Vec::new(),
                        finish_reason: FinishReason::Length,
                        top_logprobs: Vec::new(),
                    },
                    done: max_tokens == 0,
                }
            })
            .collect();
        self.ensure_cache(next_block as usize);
        let cache = self.cache.as_mut().expect("ensured above");
        let vocab = self.model.model.cfg.vocab_size;
        loop {
            let active: Vec<usize> = (0..seqs.len()).filter(|&i| !seqs[i].done).collect();
            if active.is_empty() {
                break;
            }
            let steps: Vec<SeqStep<'_>> = active
                .iter()
                .map(|&i| SeqStep {
                    token_ids: &seqs[i].pending,
                    num_cached_tokens: seqs[i].num_cached_tokens,
                    block_table: &seqs[i].block_table,
                    num_logit_rows: 1,
                    state: None,
                })
                .collect();
            let num_step_tokens: usize = steps.iter().map(|s| s.token_ids.len()).sum();
            let is_decode = num_step_tokens == steps.len();
            let started = std::time::Instant::now();
            let logits = self.model.model.forward(&self.backend, cache, bs, &steps);
            for (row, &i) in active.iter().enumerate() {
                let s = &mut seqs[i];
                let r = &reqs[i];
                let row_logits = &logits[row * vocab..(row + 1) * vocab];
                s.num_cached_tokens += s.pending.len();
                let position = s.num_cached_tokens as u64;
                let token = self.sampler.sample(row_logits, &r.params, position);
                if !r.ignore_eos && self.model.text.stop_ids.contains(&token) {
                    s.output.finish_reason = FinishReason::Stop;
                    s.done = true;
                    continue;
                }
                if r.params.num_top_logprobs > 0 {
                    s.output
                        .top_logprobs
                        .push(top_logprobs(row_logits, r.params.num_top_logprobs));
                }
                s.output.token_ids.push(token);
                on_token(i);
                if s.output.token_ids.len() >= s.max_tokens {
                    s.done = true;
                }
                s.pending.clear();
                s.pending.push(token);
            }
            let secs = started.elapsed().as_secs_f64();
            if is_decode {
                self.stats.num_decode_tokens += num_step_tokens;
                self.stats.decode_secs += secs;
            } else {
                self.stats.num_prefill_tokens += num_step_tokens;
                self.stats.prefill_secs += secs;
            }
        }
        Ok(seqs.into_iter().map(|s| s.output).collect())
    }

    fn ensure_cache(&mut self, num_blocks: usize) {
        if self.cache.is_none() || self.num_cache_blocks < num_blocks {
            self.cache = None; // free the old pool before allocating the larger one
            let shape = self
                .model
                .model
                .kv_cache_shape(num_blocks, self.block_size)
                .with_dtype(self.kv_dtype);
            self.cache = Some(self.backend.alloc_kv_cache(shape));
            self.num_cache_blocks = num_blocks;
        }
    }
}
