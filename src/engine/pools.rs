//! Sizing the device pools from the cache budget: KV blocks for the Llama family;
//! blocks of compressed entries plus one state slot per sequence for DeepSeek-V4.

use super::{Device, EngineConfig, EngineError};
use crate::model::ModelText;
use crate::model::config::ModelConfig;
use crate::model::deepseek_v4::cache::{CacheFormats, DsV4Cache, lcm_rates};
use crate::model::deepseek_v4::config::DsV4Config;
use crate::model::deepseek_v4::saved_state::SavedStates;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Pools {
    pub block_size: usize,
    pub num_blocks: usize,
    /// `None`: the model keeps no per-sequence state.
    pub num_state_slots: Option<usize>,
    pub enable_prefix_cache: bool,
    /// Tokens before a prefix hit recomputed to rebuild a slot's state.
    pub num_replay_tokens: usize,
    /// Slot states saved with the prefix, so a hit resumes without the replay.
    pub num_saved_states: usize,
    /// Bytes of one block as the cache stores it (every layer's K and V).
    pub block_bytes: usize,
    /// Bytes of one saved per-sequence state as a store keeps it; 0: none.
    pub state_bytes: usize,
}

/// The pools `cfg` asks for within `cache_bytes`, or why it cannot have them.
pub(super) fn size_pools(
    cfg: &EngineConfig,
    text: &ModelText,
    cache_bytes: usize,
) -> Result<Pools, EngineError> {
    match &text.deepseek_v4 {
        Some(ds) => dsv4_pools(cfg, ds, text.config.max_context_tokens, cache_bytes),
        None => kv_pools(cfg, &text.config, cache_bytes),
    }
}

/// The Llama family's: KV blocks alone.
fn kv_pools(cfg: &EngineConfig, m: &ModelConfig, cache_bytes: usize) -> Result<Pools, EngineError> {
    if cfg.eplb.is_some() {
        return Err(EngineError::Spawn(
            "EPLB places MoE experts: this model has none (DeepSeek-V4 has)".into(),
        ));
    }
    if cfg.swa_saved_states.is_some() {
        return Err(EngineError::Spawn(
            "--swa-saved-states: this model keeps no sliding-window state (DeepSeek-V4 does)"
                .into(),
        ));
    }
    // The CUDA backend keeps K and V in bf16 outside the batch-invariant mode. The
    // pool is sized for a whole KV head set per rank, so a group that loses devices
    // and shrinks to one rank still holds every block the scheduler counts on.
    let auto_bytes = match cfg.device {
        Device::Cuda(_) if !cfg.batch_invariant => 2,
        _ => std::mem::size_of::<f32>(),
    };
    let bytes_per_head = cfg.kv_cache_dtype.bytes_per_head(m.head_dim, auto_bytes);
    let bytes_per_block = 2 * m.num_layers * cfg.block_size * m.num_kv_heads * bytes_per_head;
    Ok(Pools {
        block_size: cfg.block_size,
        num_blocks: (cache_bytes / bytes_per_block).max(1),
        num_state_slots: None,
        enable_prefix_cache: cfg.enable_prefix_cache,
        num_replay_tokens: 0,
        num_saved_states: 0,
        block_bytes: bytes_per_block,
        state_bytes: 0,
    })
}

/// DeepSeek-V4's: a state slot a sequence, saved states, blocks of compressed entries.
fn dsv4_pools(
    cfg: &EngineConfig,
    ds: &DsV4Config,
    max_context_tokens: usize,
    cache_bytes: usize,
) -> Result<Pools, EngineError> {
    let refuse = |what: &str| Err(EngineError::Spawn(format!("DeepSeek-V4: {what}")));
    if let Device::Cuda(_) = cfg.device {
        // The GPU pass dispatches experts on one device.
        if cfg.tensor_parallel_size > 1 {
            return refuse(
                "on CUDA runs on one GPU (expert parallelism over NCCL is not built; \
                 several CPU ranks form an expert-parallel group)",
            );
        }
        if cfg.kv_cache_bytes == 0 {
            return refuse(
                "on CUDA the cache budget is not derived from GPU memory yet: give \
                 kv_cache_bytes (--kv-cache-mib)",
            );
        }
    }
    // Several ranks form an expert-parallel group (attention replicated on each).
    if let Some(problem) = crate::model::deepseek_v4::expert_parallel::ep_problem(
        ds.num_routed_experts,
        cfg.tensor_parallel_size,
    ) {
        return refuse(&problem);
    }
    if let Some(settings) = cfg.eplb {
        settings
            .for_model(ds.num_layers, ds.num_routed_experts)
            .validate()
            .map_err(|e| EngineError::Spawn(format!("EPLB: {e}")))?;
    }
    // A block boundary must also be a window boundary of every compressor.
    let lcm = lcm_rates(ds);
    let block_size = cfg.block_size.div_ceil(lcm) * lcm;
    let num_state_slots = cfg.max_num_seqs;
    let formats = CacheFormats::for_dtype(cfg.kv_cache_dtype);
    if let Some(problem) = formats.problem(ds) {
        return refuse(&format!(
            "--kv-cache-dtype {}: {problem}",
            cfg.kv_cache_dtype.name()
        ));
    }
    let slot_bytes = num_state_slots * DsV4Cache::bytes_per_slot_in(ds, formats);
    let Some(left) = cache_bytes.checked_sub(slot_bytes) else {
        return refuse(&format!(
            "{num_state_slots} state slots take {slot_bytes} bytes, more than the cache budget of {cache_bytes}"
        ));
    };
    let (num_saved_states, left) = saved_states(cfg, ds, num_state_slots, left)?;
    // Layers that all slide keep nothing in blocks: the pool then only counts positions.
    let bytes_per_block = DsV4Cache::bytes_per_block_in(ds, block_size, formats).max(1);
    let blocks_for_every_seq = num_state_slots * max_context_tokens.div_ceil(block_size);
    Ok(Pools {
        block_size,
        num_blocks: (left / bytes_per_block).clamp(1, blocks_for_every_seq.max(1)),
        num_state_slots: Some(num_state_slots),
        enable_prefix_cache: cfg.enable_prefix_cache,
        num_replay_tokens: ds.num_replay_tokens(),
        num_saved_states,
        block_bytes: bytes_per_block,
        state_bytes: SavedStates::bytes_per_state_in(ds, formats),
    })
}

/// Saved states carved out of the `left` bytes after the slots: as many as asked
/// (`--swa-saved-states`), else up to 4 a slot within a quarter of `left`; none without a
/// prefix cache. Returns them and the bytes left for blocks.
fn saved_states(
    cfg: &EngineConfig,
    ds: &crate::model::deepseek_v4::config::DsV4Config,
    num_state_slots: usize,
    left: usize,
) -> Result<(usize, usize), EngineError> {
    let bytes = SavedStates::bytes_per_state_in(ds, CacheFormats::for_dtype(cfg.kv_cache_dtype));
    let num = match cfg.swa_saved_states {
        Some(num) if num > 0 && !cfg.enable_prefix_cache => {
            return Err(EngineError::Spawn(
                "--swa-saved-states with --no-prefix-cache: saved states are kept with \
                 cached prefixes"
                    .into(),
            ));
        }
        _ if !cfg.enable_prefix_cache => 0,
        Some(num) => num,
        None => (4 * num_state_slots).min(left / 4 / bytes.max(1)),
    };
    match num.checked_mul(bytes).and_then(|b| left.checked_sub(b)) {
        Some(rest) => Ok((num, rest)),
        None => Err(EngineError::Spawn(format!(
            "--swa-saved-states {num}: {num} saved states of {bytes} bytes do not fit the \
             {left} bytes of the cache budget left after the state slots"
        ))),
    }
}

/// Why `--kv-cache-dtype` cannot run with the rest of `cfg`, if it cannot.
pub(super) fn kv_dtype_problem(cfg: &EngineConfig, deepseek_v4: bool) -> Option<String> {
    let dtype = cfg.kv_cache_dtype;
    if dtype == crate::kernels::KvDtype::Auto {
        return None;
    }
    let name = dtype.name();
    if deepseek_v4 {
        return matches!(cfg.device, Device::Cuda(_)).then(|| {
            format!(
                "--kv-cache-dtype {name}: DeepSeek-V4's packed entries run on the CPU so far \
                 (only auto runs on CUDA)"
            )
        });
    }
    if dtype == crate::kernels::KvDtype::Fp4 {
        return Some(
            "--kv-cache-dtype fp4 is DeepSeek-V4's layout: the Llama family takes auto, bf16 \
             or fp8"
                .into(),
        );
    }
    (matches!(cfg.device, Device::Cuda(_)) && cfg.batch_invariant).then(|| {
        format!(
            "--kv-cache-dtype {name} with --batch-invariant on CUDA: the invariant kernels \
             read an f32 cache (only auto runs)"
        )
    })
}
