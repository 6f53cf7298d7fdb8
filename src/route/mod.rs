//! Routing over engines (pure): which engine prefills a request and which decodes it, as a
//! function of what the router knows of each engine. The seed's rules (§2.3):
//!
//! - **Prefix first, on metadata.** The router hashes the prompt's full blocks as the
//!   engines' prefix caches do (`sched::prefix_cache::block_hash`, chained from
//!   `ROOT_HASH`) and matches them against each engine's published cached-block set, so the
//!   hit length on every engine is known before anything is sent.
//! - **Prefill by prompt-length bucket and remaining compute.** An engine's work ahead of
//!   the prompt is what it has queued for prefill plus the prompt's uncached tokens. Costs
//!   are compared by bucket (`RouteConfig::bucket_tokens`): within one bucket the longer
//!   prefix hit wins (its blocks stay warm), then the fewer running requests.
//! - **Decode by running requests and KV length.** The engine with the fewest running
//!   requests, then the least KV held, that has room for the request's KV.
//!
//! - **Disaggregated where prefill engines exist.** A prompt picked for a prefill-only
//!   engine is decoded by the decode engine `pick_decode` picks, its KV handed over,
//!   unless what is left to compute there (past that engine's own cached prefix) is at
//!   most a block or `RouteConfig::min_hand_off_tokens`, or it keeps no store to take the
//!   KV in (`pick_route`). With no engine alive that prefills, decode engines prefill.
//!
//! Engines not alive, or of the other role, are never picked.

use std::collections::HashSet;

use crate::sched::{ROOT_HASH, block_hash};

#[cfg(test)]
mod tests;

/// What an engine in a disaggregated deployment does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Prefill and decode (a data-parallel replica).
    Both,
    Prefill,
    Decode,
    /// A vision-language model's images only: never given a request to generate.
    Encode,
}

impl Role {
    pub fn prefills(self) -> bool {
        matches!(self, Role::Both | Role::Prefill)
    }

    pub fn decodes(self) -> bool {
        matches!(self, Role::Both | Role::Decode)
    }
}

/// The encode engine for a request's images, by the seed's rule: of those alive, the one
/// with the fewest image patches in flight (`patches_in_flight[i]` for engine `i`).
pub fn pick_encoder(engines: &[EngineLoad], patches_in_flight: &[usize]) -> Option<usize> {
    engines
        .iter()
        .enumerate()
        .filter(|(_, e)| e.alive && e.role == Role::Encode)
        .min_by_key(|&(i, _)| (patches_in_flight.get(i).copied().unwrap_or(0), i))
        .map(|(i, _)| i)
}

/// What the router knows of one engine, as the engine last reported it.
#[derive(Debug, Clone)]
pub struct EngineLoad {
    pub role: Role,
    /// Reported within the liveness window.
    pub alive: bool,
    pub num_running: usize,
    pub num_waiting: usize,
    /// Prompt tokens admitted or queued but not yet prefilled: its remaining compute.
    pub num_queued_prefill_tokens: usize,
    /// Tokens the running requests hold in its KV cache.
    pub num_kv_tokens: usize,
    /// Tokens its KV cache holds at most.
    pub kv_capacity_tokens: usize,
    pub block_size: usize,
    /// Chain hashes of the full blocks its prefix cache holds.
    pub cached_blocks: HashSet<u64>,
    /// It keeps a prefix store: a prefill engine's KV can be handed to it.
    pub takes_kv: bool,
}

/// The router's knobs.
#[derive(Debug, Clone, Copy)]
pub struct RouteConfig {
    /// Work ahead of a prompt (in tokens) is compared in buckets this wide: a longer
    /// prefix hit wins over a slightly shorter queue.
    pub bucket_tokens: usize,
    /// A prompt with no more than this many tokens left to compute on the decode engine
    /// is prefilled there: a hand-off costs a prefill engine's queue and a transfer,
    /// more than a short prefill beside the decode steps.
    pub min_hand_off_tokens: usize,
}

impl Default for RouteConfig {
    fn default() -> Self {
        RouteConfig {
            bucket_tokens: 512,
            min_hand_off_tokens: 256,
        }
    }
}

/// The chain hashes of `tokens`' full blocks, as a prefix cache of `block_size`-token
/// blocks keys them (no salt).
pub fn prompt_block_hashes(tokens: &[u32], block_size: usize) -> Vec<u64> {
    let mut parent = ROOT_HASH;
    tokens
        .chunks_exact(block_size.max(1))
        .map(|block| {
            parent = block_hash(parent, block, 0);
            parent
        })
        .collect()
}

/// Prompt tokens `engine` holds in its prefix cache: its leading blocks that are cached.
/// The last prompt token is never a hit (it is computed to sample the next one).
pub fn hit_tokens(engine: &EngineLoad, block_hashes: &[u64], num_prompt_tokens: usize) -> usize {
    let num_blocks = block_hashes
        .iter()
        .take_while(|h| engine.cached_blocks.contains(h))
        .count();
    (num_blocks * engine.block_size).min(num_prompt_tokens.saturating_sub(1))
}

/// The engine to prefill a prompt of `num_prompt_tokens` tokens whose full blocks hash to
/// `block_hashes` (each engine's block size must be the one they were hashed with).
pub fn pick_prefill(
    cfg: &RouteConfig,
    engines: &[EngineLoad],
    block_hashes: &[u64],
    num_prompt_tokens: usize,
) -> Option<usize> {
    let bucket = cfg.bucket_tokens.max(1);
    engines
        .iter()
        .enumerate()
        .filter(|(_, e)| e.alive && e.role.prefills())
        .map(|(i, e)| {
            let hit = hit_tokens(e, block_hashes, num_prompt_tokens);
            let work = e.num_queued_prefill_tokens + num_prompt_tokens - hit;
            // Ascending: less work (by bucket), a longer hit, fewer running, lower index.
            let key = (
                work / bucket,
                usize::MAX - hit,
                e.num_running + e.num_waiting,
                i,
            );
            (key, i)
        })
        .min()
        .map(|(_, i)| i)
}

/// The engine to decode a request whose KV will hold `num_kv_tokens` tokens: among those
/// with room for it, the fewest running requests, then the least KV held.
pub fn pick_decode(engines: &[EngineLoad], num_kv_tokens: usize) -> Option<usize> {
    engines
        .iter()
        .enumerate()
        .filter(|(_, e)| {
            e.alive && e.role.decodes() && e.num_kv_tokens + num_kv_tokens <= e.kv_capacity_tokens
        })
        .min_by_key(|(i, e)| (e.num_running + e.num_waiting, e.num_kv_tokens, *i))
        .map(|(i, _)| i)
}

/// Where a request goes: the engine that answers it, and the engine that prefills its
/// prompt first and hands the KV over (`None`: the answering engine prefills).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    pub target: usize,
    pub prefill_from: Option<usize>,
}

/// The route of a request whose prompt is `prompt` (hashed as `block_hashes`; `None`:
/// the router cannot read the request's prompt, and it goes by load to an engine that
/// decodes).
pub fn pick_route(
    cfg: &RouteConfig,
    engines: &[EngineLoad],
    prompt: Option<(&[u64], usize)>,
) -> Option<Route> {
    let direct = |target| Route {
        target,
        prefill_from: None,
    };
    let Some((block_hashes, num_prompt_tokens)) = prompt else {
        return pick_decode(engines, 0).map(direct);
    };
    // No engine alive that prefills: the decode engines prefill themselves.
    let Some(prefill) = pick_prefill(cfg, engines, block_hashes, num_prompt_tokens) else {
        return pick_decode(engines, num_prompt_tokens).map(direct);
    };
    if engines[prefill].role != Role::Prefill {
        return Some(direct(prefill));
    }
    let target = pick_decode(engines, num_prompt_tokens)?;
    let decode = &engines[target];
    let left = num_prompt_tokens - hit_tokens(decode, block_hashes, num_prompt_tokens);
    let worth_it = left > decode.block_size.max(cfg.min_hand_off_tokens);
    let prefill_from = (worth_it && decode.takes_kv).then_some(prefill);
    Some(Route {
        target,
        prefill_from,
    })
}
