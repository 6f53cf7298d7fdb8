//! What `Engine::spawn` builds an engine from, in the order it does: the configuration
//! refused by name before anything loads, then against the model's files; the KV budget;
//! the scheduler's configuration; the settings every rank starts from.

use super::pools::{self, Pools};
use super::speculation::speculative_tokens;
use super::{Device, EngineConfig, EngineError, SpecVerify};
use crate::model::config::ModelConfig;
use crate::model::{self, ModelText};
use crate::runner::RankSettings;
use crate::runner::decode_curve::CurveJob;
use crate::runner::fault::FaultPlan;
use crate::runner::image_encoder::ImageEncoder;
use crate::sched::SchedulerConfig;
use crate::store::KvStore;
use crate::sync::Shared;

/// What is wrong with `cfg` whatever the model.
pub(super) fn check_config(cfg: &EngineConfig) -> Result<(), EngineError> {
    if cfg.block_size == 0
        || cfg.max_num_seqs == 0
        || cfg.max_step_tokens == 0
        || cfg.max_pending_requests == 0
    {
        return Err(EngineError::Spawn(format!(
            "block_size ({}), max_num_seqs ({}), max_step_tokens ({}) and max_pending_requests ({}) must be positive",
            cfg.block_size, cfg.max_num_seqs, cfg.max_step_tokens, cfg.max_pending_requests
        )));
    }
    speculative_tokens(cfg.speculative)?;
    crate::runner::affinity::check_threads(
        cfg.cpu_threads,
        cfg.cpu_affinity,
        cfg.device,
        cfg.tensor_parallel_size,
    )
    .map_err(EngineError::Spawn)?;
    if cfg.exact_activations && cfg.device != Device::Cpu {
        return Err(EngineError::Spawn(
            "--exact-activations is for the CPU backend (the CUDA backend never quantizes activations)".into(),
        ));
    }
    Ok(())
}

/// What is wrong with `cfg` for the model `text` describes, named before any rank starts:
/// a rank's failed start reads far less clearly.
pub(super) fn check_model(cfg: &EngineConfig, text: &ModelText) -> Result<(), EngineError> {
    pools::kv_dtype_problem(cfg, text.deepseek_v4.is_some())
        .map_or(Ok(()), |p| Err(EngineError::Spawn(p)))?;
    if cfg.cpu_moe.is_explicit() {
        if text.deepseek_v4.is_none() {
            return Err(EngineError::Spawn(format!(
                "{}: this model has no routed experts to keep in host memory (DeepSeek-V4 has)",
                cfg.cpu_moe
            )));
        }
        if cfg.tensor_parallel_size > 1 {
            return Err(EngineError::Spawn(format!(
                "{} with --tensor-parallel-size {} is not built: host experts run beside one device",
                cfg.cpu_moe, cfg.tensor_parallel_size
            )));
        }
    }
    if cfg.stream_experts != Default::default() && text.deepseek_v4.is_none() {
        return Err(EngineError::Spawn(format!(
            "--stream-experts {}: this model has no routed experts in host memory to stream (DeepSeek-V4 has)",
            cfg.stream_experts
        )));
    }
    if cfg.quantization.is_some() && text.deepseek_v4.is_some() {
        return Err(EngineError::Spawn(
            "--quantization is for dense checkpoints: DeepSeek-V4's weights are FP8 / FP4 as shipped".into(),
        ));
    }
    if cfg.quantization.is_some() && cfg.model_path.is_file() {
        // A packed GGUF's projections stay as the file's blocks: FP8 would be silently
        // not applied (dense F32/F16/BF16 GGUF projections do take it).
        let gguf = crate::model::gguf::GgufFile::open(&cfg.model_path)?;
        let packed = gguf.tensors.iter().find(|t| {
            t.name.starts_with("blk.")
                && t.name.ends_with(".weight")
                && t.dims.len() == 2
                && !matches!(
                    t.ggml_type,
                    crate::kernels::quant::GgmlType::F32
                        | crate::kernels::quant::GgmlType::F16
                        | crate::kernels::quant::GgmlType::BF16
                )
        });
        if let Some(t) = packed {
            return Err(EngineError::Spawn(format!(
                "--quantization is for dense checkpoints: this GGUF's projections are already packed (`{}` is {:?})",
                t.name, t.ggml_type
            )));
        }
    }
    let dir = &cfg.model_path;
    if dir.is_dir()
        && !cfg.dummy_weights
        && !dir.join("model.safetensors").exists()
        && !dir.join("model.safetensors.index.json").exists()
    {
        return Err(EngineError::Spawn(format!(
            "{}: no model.safetensors or model.safetensors.index.json (--dummy-weights runs the config's shape without them)",
            dir.display()
        )));
    }
    // DeepSeek-V4's limits are `pools::size_pools`' to name.
    if text.deepseek_v4.is_none()
        && let Some(problem) =
            crate::model::tensor_parallel::tp_problem(&text.config, cfg.tensor_parallel_size)
    {
        return Err(EngineError::Spawn(problem));
    }
    Ok(())
}

/// The model's share of the KV cache's bytes: a draft model's cache has the model's
/// blocks, so the budget is shared in proportion to their KV widths.
pub(super) fn kv_budget(
    cfg: &EngineConfig,
    text: &ModelText,
    draft: Option<&ModelConfig>,
) -> Result<usize, EngineError> {
    let mcfg = &text.config;
    Ok(match draft {
        Some(d) => {
            let kv = |m: &ModelConfig| (m.num_layers * m.kv_dim()) as f64;
            (super::kv_cache_bytes(cfg, mcfg)? as f64 * kv(mcfg) / (kv(mcfg) + kv(d))) as usize
        }
        // DeepSeek-V4 on a GPU asks for a budget (`pools::size_pools` says so by name): the
        // estimate counts Llama-shaped weights.
        None if text.deepseek_v4.is_some() && cfg.device != Device::Cpu => cfg.kv_cache_bytes,
        None => super::kv_cache_bytes(cfg, mcfg)?,
    })
}

pub(super) fn scheduler_config(
    cfg: &EngineConfig,
    text: &ModelText,
    pools: &Pools,
    draft: Option<&ModelConfig>,
    mtp: bool,
) -> Result<SchedulerConfig, EngineError> {
    let mcfg = &text.config;
    // A verify row's continuation learns on the rank what that row kept: from its picks
    // (read from the device once made, or made on the host) or, for rows the sampler
    // verifies, from the sampler. A lone rank only: a group's ranks would each read their
    // own picks. A model with per-sequence state rewinds it to a verify row's snapshot and
    // runs the accepted drafts again: its rows cannot move back.
    let continue_verify_rows = cfg.zero_overhead_scheduling
        && cfg.tensor_parallel_size == 1
        && pools.num_state_slots.is_none();
    Ok(SchedulerConfig {
        block_size: pools.block_size,
        num_blocks: pools.num_blocks,
        num_state_slots: pools.num_state_slots,
        num_replay_tokens: pools.num_replay_tokens,
        num_saved_states: pools.num_saved_states,
        max_num_seqs: cfg.max_num_seqs,
        max_step_tokens: cfg.max_step_tokens,
        step_time_budget_secs: cfg.step_time_budget_secs,
        enable_prefix_cache: pools.enable_prefix_cache,
        max_context_tokens: draft.map_or(mcfg.max_context_tokens, |d| {
            d.max_context_tokens.min(mcfg.max_context_tokens)
        }),
        stop_preempted: cfg.stop_preempted,
        num_speculative_tokens: speculative_tokens(cfg.speculative)?,
        confidence_verify: cfg
            .speculative
            .is_some_and(|s| s.verify == SpecVerify::Confidence),
        model_drafts: draft.is_some() || mtp,
        verify_skips_next_step: cfg.zero_overhead_scheduling,
        continue_verify_rows,
    })
}

/// Confidence-scheduled verification prices steps with a measured decode curve: the rank
/// worker measures it at start (or loads it), up to the largest batch a step may have (16
/// rows on the CPU, where each measured step costs real time). DeepSeek-V4's host rank is
/// priced by the fitted cost model alone: timing it needs sequences with state slots.
fn decode_curve(cfg: &EngineConfig, text: &ModelText) -> Option<CurveJob> {
    let mcfg = &text.config;
    cfg.speculative
        .filter(|s| s.verify == SpecVerify::Confidence && text.deepseek_v4.is_none())
        .map(|_| CurveJob {
            store_dir: cfg
                .latency_curve_dir
                .clone()
                .unwrap_or_else(|| model::hub::troupe_home().join("latency-curves")),
            model_key: format!(
                "{mcfg:?} block {} invariant {} eager {} exact {} quantization {:?} kv {}",
                cfg.block_size,
                cfg.batch_invariant,
                cfg.enforce_eager,
                cfg.exact_activations,
                cfg.quantization,
                cfg.kv_cache_dtype.name()
            ),
            max_rows: match cfg.device {
                Device::Cpu => cfg.max_num_seqs.min(16),
                Device::Cuda(_) => cfg.max_num_seqs,
            },
        })
}

/// What every rank starts from; `draft`: a draft model runs beside the model (from
/// `cfg.draft_model_path`), `mtp`: DeepSeek-V4's MTP layer drafts.
pub(super) fn rank_settings(
    cfg: &EngineConfig,
    text: &ModelText,
    pools: &Pools,
    (faults, kv_store, images): (
        FaultPlan,
        Option<Shared<KvStore>>,
        Option<Shared<ImageEncoder>>,
    ),
    (draft, mtp, num_speculative_tokens): (bool, bool, usize),
) -> RankSettings {
    let mcfg = &text.config;
    RankSettings {
        model_path: cfg.model_path.clone(),
        num_kv_blocks: pools.num_blocks,
        num_state_slots: pools.num_state_slots.unwrap_or(0),
        num_saved_states: pools.num_saved_states,
        block_size: pools.block_size,
        eplb: cfg.eplb,
        cpu_moe: cfg.cpu_moe,
        stream_experts: cfg.stream_experts,
        faults,
        batch_invariant: cfg.batch_invariant,
        exact_activations: cfg.exact_activations,
        quantization: cfg.quantization,
        kv_dtype: cfg.kv_cache_dtype,
        kv_store,
        images,
        model_config: mcfg.clone(),
        devices: (0..cfg.tensor_parallel_size)
            .map(|i| match cfg.device {
                Device::Cpu => Device::Cpu,
                Device::Cuda(first) => Device::Cuda(first + i),
            })
            .collect(),
        dummy_weights: cfg.dummy_weights,
        enforce_eager: cfg.enforce_eager,
        cpu_affinity: cfg.cpu_affinity,
        cpu_threads: cfg.cpu_threads,
        decode_curve: decode_curve(cfg, text),
        warmup_tokens: match cfg.skip_warmup {
            true => 0,
            false => cfg.max_step_tokens.min(mcfg.max_context_tokens),
        },
        graph_tokens: match cfg.skip_warmup {
            true => 0,
            false => (cfg.max_num_seqs * (1 + num_speculative_tokens)).min(cfg.max_step_tokens),
        },
        num_routed_experts: text.deepseek_v4.as_ref().map(|d| d.num_routed_experts),
        draft_model_path: draft.then(|| {
            cfg.draft_model_path
                .clone()
                .expect("checked by draft_model")
        }),
        mtp,
    }
}
