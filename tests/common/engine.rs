//! Helpers for the actor-engine scenarios: a tiny model, random greedy requests, and the
//! reference outputs of the synchronous `Generator` run one request at a time.
#![allow(dead_code)]

use troupe::engine::{EngineConfig, EngineRequest, RequestOutput};
use troupe::generate::{GenerateRequest, Generator};
use troupe::kernels::cpu::CpuBackend;
use troupe::sampling::{SamplingParams, splitmix64};

pub fn tiny_config(name: &str) -> EngineConfig {
    let mut cfg = EngineConfig::new(super::goldens().join(name));
    cfg.kv_cache_bytes = 64 << 20;
    cfg
}

/// `n` greedy requests with prompts of 3..40 tokens and 8..24 new tokens, from `seed`.
pub fn random_requests(n: usize, vocab: u32, seed: u64) -> Vec<EngineRequest> {
    (0..n)
        .map(|i| {
            let h = |k: u64| splitmix64(seed ^ splitmix64(i as u64 * 1000 + k));
            let len = 3 + (h(0) % 38) as usize;
            let prompt_ids = (0..len)
                .map(|j| 3 + (h(10 + j as u64) % (vocab as u64 - 3)) as u32)
                .collect();
            let max_tokens = 8 + (h(1) % 17) as usize;
            let mut r = EngineRequest::new(prompt_ids, max_tokens, SamplingParams::default());
            r.ignore_eos = true;
            r
        })
        .collect()
}

/// Each request alone through the synchronous reference loop.
pub fn reference_outputs(model: &str, requests: &[EngineRequest]) -> Vec<Vec<u32>> {
    let loaded = super::load(&super::goldens().join(model));
    let mut generator = Generator::new(CpuBackend::default(), loaded, 16);
    requests
        .iter()
        .map(|r| {
            let req = GenerateRequest {
                prompt_ids: r.prompt_ids.clone(),
                max_tokens: r.max_tokens,
                params: r.params.clone(),
                ignore_eos: r.ignore_eos,
            };
            generator
                .generate(&[req], |_| {})
                .unwrap()
                .remove(0)
                .token_ids
        })
        .collect()
}

pub fn tokens(outputs: &[RequestOutput]) -> Vec<Vec<u32>> {
    outputs.iter().map(|o| o.token_ids.clone()).collect()
}
