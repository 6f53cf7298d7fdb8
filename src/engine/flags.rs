//! The engine flags `generate`, `serve` and the Python package's `LLM(...)` share, into an
//! `EngineConfig`: the one place an engine is built from flags.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, Parser};

use crate::engine::{
    DEFAULT_BLOCK_SIZE, Device, EngineConfig, SpecAcceptance, SpecConfig, SpecMethod, SpecVerify,
};
use crate::error::{Result, TroupeError};
use crate::model;
use crate::store::KvStoreConfig;

fn parse_device(s: &str) -> std::result::Result<Device, String> {
    match s {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda(0)),
        _ => s
            .strip_prefix("cuda:")
            .and_then(|n| n.parse().ok())
            .map(Device::Cuda)
            .ok_or_else(|| format!("`{s}` is not a device: use cpu, cuda or cuda:N")),
    }
}

/// Tokens a step computes on a GPU by default: prompt chunks this long keep the tensor
/// cores busy and let every request of a large batch start decoding sooner.
const GPU_MAX_STEP_TOKENS: usize = 8192;

/// Engine settings `generate` and `serve` share.
#[derive(Args)]
pub struct EngineFlags {
    /// Tokens a KV-cache block holds (the prefix cache shares whole blocks).
    #[arg(long, default_value_t = DEFAULT_BLOCK_SIZE)]
    block_size: usize,
    /// Memory for the paged KV cache, in MiB (default: 1024 on the CPU; on a GPU, what
    /// `--gpu-memory-utilization` leaves after the weights).
    #[arg(long)]
    kv_cache_mib: Option<usize>,
    /// Where the model runs: `cpu`, `cuda` (GPU 0) or `cuda:N`.
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    device: Device,
    /// Ranks in the tensor-parallel group: GPUs N, N+1, ... from `--device cuda:N` (on the
    /// CPU, ranks joined by in-process collectives). A lost GPU shrinks the group.
    #[arg(long, visible_alias = "tp", default_value_t = 1)]
    tensor_parallel_size: usize,
    /// MoE models (DeepSeek-V4): plan the expert placement for an expert-parallel group of
    /// N ranks from the routed loads (EPLB) and report its `moe_lb` in `--stats`.
    #[arg(long)]
    eplb_ranks: Option<usize>,
    /// EPLB: extra expert replicas across the group (physical = logical + these).
    #[arg(long, default_value_t = 0)]
    eplb_redundant_experts: usize,
    /// EPLB: steps between rebalances (the first after a quarter), and of statistics.
    #[arg(long, default_value_t = 1000)]
    eplb_period_steps: u64,
    /// DeepSeek-V4: keep every routed expert in host memory and compute it on the CPU
    /// beside the device (attention, the shared expert and the router stay there).
    #[arg(long, conflicts_with = "n_cpu_moe")]
    cpu_moe: bool,
    /// DeepSeek-V4: keep the routed experts of the first N MoE layers in host memory and
    /// compute them on the CPU. Without either flag, experts go to the host only when the
    /// device cannot hold them with the KV cache (the first layers' first).
    #[arg(long, value_name = "N")]
    n_cpu_moe: Option<usize>,
    /// DeepSeek-V4 with experts in host memory: copy a layer's touched host experts to
    /// the device for a step when that is faster than the CPU computing them (auto: by
    /// times measured at load and since; always; never).
    #[arg(long, default_value = "auto", value_name = "auto|always|never")]
    stream_experts: crate::model::deepseek_v4::expert_streaming::StreamExperts,
    /// Seeded random weights for the shape in the model directory's config.json (made on
    /// the device on a GPU): benchmarks of models whose weights are not at hand.
    #[arg(long)]
    dummy_weights: bool,
    /// A Jinja chat template to render chats with instead of the model's own: a file, or
    /// the template itself.
    #[arg(long)]
    chat_template: Option<String>,
    /// The GGUF file of a hub repository or model directory that holds several (the same
    /// as a hub id's `:FILE` suffix).
    #[arg(long)]
    gguf_file: Option<String>,
    /// Share of the GPU's free memory troupe may take.
    #[arg(long, default_value_t = 0.9)]
    gpu_memory_utilization: f64,
    /// Run every step eagerly: no CUDA graphs for decode steps.
    #[arg(long)]
    enforce_eager: bool,
    /// Start without the warm-up prefill: the first request pays the first step's costs.
    #[arg(long)]
    skip_warmup: bool,
    /// Pin rank threads: `auto` puts a GPU rank on its GPU's NUMA node and CPU ranks of a
    /// group on disjoint cores (reported in --stats); `off` leaves placement to the OS.
    #[arg(long, default_value = "auto")]
    cpu_affinity: crate::runner::affinity::CpuAffinity,
    /// The longest context a request may have, prompt and output together, in tokens
    /// (default: the model's own; more is refused). The KV budget is sized for it.
    #[arg(long)]
    max_model_len: Option<usize>,
    /// Kernel threads of a CPU rank (default: every core it may use). Under
    /// `--cpu-affinity auto` they are pinned to the rank's share of the cores, and more
    /// threads than the share has cores are refused.
    #[arg(long)]
    threads: Option<usize>,
    /// Requests in a step, at most.
    #[arg(long, default_value_t = 256)]
    max_num_seqs: usize,
    /// Tokens a step computes, prompt chunks and decode rows together, at most (the step's
    /// time budget may cut a prompt chunk shorter). Default: 8192 on a GPU, 2048 on the CPU.
    #[arg(long)]
    max_num_batched_tokens: Option<usize>,
    /// Turn zero-overhead scheduling off (wait for each step before planning the next).
    #[arg(long)]
    no_zos: bool,
    /// Turn the prefix cache off (a prompt never reuses another's KV blocks).
    #[arg(long)]
    no_prefix_cache: bool,
    /// Batch-invariant kernels: a request's logits do not depend on what shares its batch.
    #[arg(long)]
    batch_invariant: bool,
    /// CPU: keep activations f32 against the quantized weights (the dequantized model's
    /// arithmetic, slower) instead of 8-bit activations and integer dot products.
    #[arg(long)]
    exact_activations: bool,
    /// Store a dense checkpoint's layer projections as per-channel FP8 e4m3 at load
    /// (`fp8`): half the bytes of bf16 on the GPU; the CPU runs them dequantized.
    #[arg(long)]
    quantization: Option<crate::kernels::fp8::Quantization>,
    /// KV cache entries: `auto` (CPU f32, GPU bf16), `bf16`, `fp8` (e4m3, a scale per token and head)
    #[arg(long, default_value = "auto")]
    kv_cache_dtype: crate::kernels::KvDtype,
    /// Prefix store in host memory: full KV blocks kept by prefix, bytes (`512M`, `4G`);
    /// 0: none
    #[arg(long, default_value = "0", value_parser = parse_bytes)]
    kv_host_cache_bytes: u64,
    /// Prefix store on disk: a directory (created; several engines may share it) that
    /// keeps full KV blocks across restarts
    #[arg(long)]
    kv_store_dir: Option<PathBuf>,
    /// The disk store's budget in bytes (`64G`; default 16G): least recently used blocks
    /// go first
    #[arg(long, value_parser = parse_bytes)]
    kv_store_bytes: Option<u64>,
    /// Blocks of the disk store unused this long are dropped (`3600`, `90m`, `12h`, `7d`)
    #[arg(long, value_parser = parse_duration)]
    kv_store_ttl: Option<std::time::Duration>,
    /// DeepSeek-V4: slot states saved at block boundaries with the cached prefix, so a
    /// hit resumes with no replay (default: up to 4 a sequence, within a quarter of the
    /// cache budget); 0: every hit replays the tokens before it
    #[arg(long)]
    swa_saved_states: Option<usize>,
    /// Speculative decoding: `ngram` (prompt lookup), `draft` (a draft model, with
    /// --draft-model) or `mtp` (the model's own MTP layer: DeepSeek-V4). Output is the same
    /// as without it, seeded sampling included.
    #[arg(long, value_parser = parse_spec_method)]
    spec: Option<SpecMethod>,
    /// The draft model of `--spec draft`: a smaller model with the same tokenizer (a known
    /// name, a GGUF file or an HF directory, as for --model).
    #[arg(long)]
    draft_model: Option<String>,
    /// Drafts per request per step, at most (with --spec).
    #[arg(long, default_value_t = 5)]
    num_speculative_tokens: usize,
    /// How many drafts a step verifies: `confidence` (those worth their cost, from the
    /// drafts' calibrated confidences and the fitted step cost) or `fixed` (all proposed).
    #[arg(long, default_value = "confidence", value_parser = parse_spec_verify)]
    spec_verify: SpecVerify,
    /// How sampled requests accept drafts: `coupled` (the tokens of plain decoding, seed
    /// for seed) or `rejection` (rejection sampling: more accepted, the same distribution,
    /// tokens that depend on the drafts).
    #[arg(long, default_value = "coupled", value_parser = parse_spec_acceptance)]
    spec_acceptance: SpecAcceptance,
}

fn parse_spec_acceptance(s: &str) -> std::result::Result<SpecAcceptance, String> {
    match s {
        "coupled" => Ok(SpecAcceptance::Coupled),
        "rejection" => Ok(SpecAcceptance::Rejection),
        other => Err(format!(
            "unknown --spec-acceptance `{other}` (coupled or rejection)"
        )),
    }
}

fn parse_spec_method(s: &str) -> std::result::Result<SpecMethod, String> {
    match s {
        "ngram" => Ok(SpecMethod::Ngram),
        "draft" => Ok(SpecMethod::DraftModel),
        "mtp" => Ok(SpecMethod::Mtp),
        other => Err(format!("unknown --spec `{other}` (ngram, draft or mtp)")),
    }
}

fn parse_spec_verify(s: &str) -> std::result::Result<SpecVerify, String> {
    match s {
        "fixed" => Ok(SpecVerify::Fixed),
        "confidence" => Ok(SpecVerify::Confidence),
        other => Err(format!(
            "unknown --spec-verify `{other}` (fixed or confidence)"
        )),
    }
}

impl EngineFlags {
    /// `--model` resolved to a file or directory, `--gguf-file` applied.
    pub fn model_path(&self, model: &str) -> Result<PathBuf> {
        match &self.gguf_file {
            Some(file) => model::resolve_model_path(&model::hf_repo::with_gguf_file(model, file)?),
            None => model::resolve_model_path(model),
        }
    }

    pub fn config(&self, model_path: &Path) -> Result<EngineConfig> {
        self.check(model_path)?;
        let mut cfg = EngineConfig::new(model_path);
        cfg.block_size = self.block_size;
        cfg.device = self.device;
        cfg.tensor_parallel_size = self.tensor_parallel_size;
        cfg.eplb = self.eplb_ranks.map(|num_ranks| crate::eplb::EplbSettings {
            num_ranks,
            num_redundant_experts: self.eplb_redundant_experts,
            window_steps: self.eplb_period_steps.max(1) as usize,
            period_steps: self.eplb_period_steps,
        });
        cfg.cpu_moe = match (self.cpu_moe, self.n_cpu_moe) {
            (true, _) => crate::model::deepseek_v4::expert_placement::CpuMoe::All,
            (false, Some(n)) => crate::model::deepseek_v4::expert_placement::CpuMoe::FirstLayers(n),
            (false, None) => Default::default(),
        };
        cfg.stream_experts = self.stream_experts;
        cfg.dummy_weights = self.dummy_weights;
        cfg.chat_template = self
            .chat_template
            .as_deref()
            .map(read_template)
            .transpose()?;
        cfg.enforce_eager = self.enforce_eager;
        cfg.skip_warmup = self.skip_warmup;
        cfg.cpu_affinity = self.cpu_affinity;
        cfg.cpu_threads = self.threads;
        cfg.max_model_len = self.max_model_len;
        cfg.gpu_memory_utilization = self.gpu_memory_utilization;
        cfg.max_num_seqs = self.max_num_seqs;
        cfg.max_step_tokens = match (self.max_num_batched_tokens, self.device) {
            (Some(tokens), _) => tokens,
            (None, Device::Cpu) => cfg.max_step_tokens,
            (None, Device::Cuda(_)) => GPU_MAX_STEP_TOKENS,
        };
        cfg.kv_cache_bytes = match (self.kv_cache_mib, self.device) {
            (Some(mib), _) => mib << 20,
            (None, Device::Cpu) => 1024 << 20,
            (None, Device::Cuda(_)) => 0,
        };
        cfg.zero_overhead_scheduling = !self.no_zos;
        cfg.enable_prefix_cache = !self.no_prefix_cache;
        cfg.batch_invariant = self.batch_invariant;
        cfg.exact_activations = self.exact_activations;
        cfg.quantization = self.quantization;
        cfg.kv_cache_dtype = self.kv_cache_dtype;
        cfg.kv_store = KvStoreConfig {
            host_bytes: self.kv_host_cache_bytes as usize,
            dir: self.kv_store_dir.clone(),
            disk_bytes: self.kv_store_bytes.unwrap_or(DEFAULT_KV_STORE_BYTES),
            ttl: self.kv_store_ttl,
        };
        cfg.swa_saved_states = self.swa_saved_states;
        cfg.draft_model_path = self
            .draft_model
            .as_deref()
            .map(model::resolve_model_path)
            .transpose()?;
        cfg.speculative = self.spec.map(|method| SpecConfig {
            method,
            num_speculative_tokens: self.num_speculative_tokens,
            verify: self.spec_verify,
            acceptance: self.spec_acceptance,
        });
        Ok(cfg)
    }

    /// The values no engine can take, refused by name before anything is built.
    fn check(&self, model_path: &Path) -> Result<()> {
        // The CPU attention kernel holds one block's scores on the stack.
        if self.block_size == 0 || self.block_size > 256 {
            return Err(TroupeError::InvalidInput(format!(
                "--block-size must be in 1..=256, got {}",
                self.block_size
            )));
        }
        if !(self.gpu_memory_utilization > 0.0 && self.gpu_memory_utilization <= 1.0) {
            return Err(TroupeError::InvalidInput(format!(
                "--gpu-memory-utilization must be in (0, 1], got {}",
                self.gpu_memory_utilization
            )));
        }
        if self.dummy_weights && !model_path.join("config.json").is_file() {
            return Err(TroupeError::InvalidInput(format!(
                "--dummy-weights needs an HF model directory with a config.json; {} has none",
                model_path.display()
            )));
        }
        for (flag, value) in [
            ("--max-num-seqs", Some(self.max_num_seqs)),
            ("--max-num-batched-tokens", self.max_num_batched_tokens),
        ] {
            if value == Some(0) {
                return Err(TroupeError::InvalidInput(format!(
                    "{flag} must be positive"
                )));
            }
        }
        for (flag, given) in [
            ("--kv-store-ttl", self.kv_store_ttl.is_some()),
            ("--kv-store-bytes", self.kv_store_bytes.is_some()),
        ] {
            if given && self.kv_store_dir.is_none() {
                return Err(TroupeError::InvalidInput(format!(
                    "{flag} is for the disk store: give --kv-store-dir"
                )));
            }
        }
        Ok(())
    }
}

/// `--kv-store-bytes` when a disk store is given without it.
const DEFAULT_KV_STORE_BYTES: u64 = 16 << 30;

/// `4096`, `512K`, `64M`, `16G`, `1T` (powers of 1024).
fn parse_bytes(s: &str) -> std::result::Result<u64, String> {
    let (digits, shift) = match s.char_indices().last() {
        Some((i, 'K' | 'k')) => (&s[..i], 10),
        Some((i, 'M' | 'm')) => (&s[..i], 20),
        Some((i, 'G' | 'g')) => (&s[..i], 30),
        Some((i, 'T' | 't')) => (&s[..i], 40),
        _ => (s, 0),
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(1 << shift))
        .ok_or_else(|| format!("`{s}` is not a byte count (like 4096, 512M, 16G)"))
}

/// `3600` (seconds), `45s`, `90m`, `12h`, `7d`.
pub fn parse_duration(s: &str) -> std::result::Result<Duration, String> {
    let (digits, unit) = match s.char_indices().last() {
        Some((i, 's')) => (&s[..i], 1),
        Some((i, 'm')) => (&s[..i], 60),
        Some((i, 'h')) => (&s[..i], 3600),
        Some((i, 'd')) => (&s[..i], 86_400),
        _ => (s, 1),
    };
    digits
        .parse::<u64>()
        .ok()
        .filter(|&n| n > 0)
        .and_then(|n| n.checked_mul(unit))
        .map(Duration::from_secs)
        .ok_or_else(|| format!("`{s}` is not a positive duration (like 3600, 90m, 12h, 7d)"))
}

/// `--chat-template`: a file's contents, or the argument itself when it is a template.
fn read_template(arg: &str) -> Result<String> {
    let path = Path::new(arg);
    if path.is_file() {
        return std::fs::read_to_string(path).map_err(|e| TroupeError::io(path, e));
    }
    if arg.contains("{{") || arg.contains("{%") {
        return Ok(arg.to_string());
    }
    Err(TroupeError::InvalidInput(format!(
        "--chat-template `{arg}`: no such file, and not a Jinja template"
    )))
}

/// Only the engine's flags: what the Python package's `LLM(model, **engine_args)` takes.
#[derive(Parser)]
#[command(name = "troupe.LLM", no_binary_name = true)]
struct EngineArgs {
    #[command(flatten)]
    engine: EngineFlags,
}

/// The engine `generate --model MODEL FLAGS..` would build: `model` resolved as `--model`
/// is (fetched when it is a hub id), `flags` as `generate` reads its engine flags.
pub fn engine_config(model: &str, flags: &[String]) -> Result<EngineConfig> {
    let args = EngineArgs::try_parse_from(flags).map_err(|e| {
        // clap's first line names the argument; its usage lines speak of a command line.
        let rendered = e.render().to_string();
        let first = rendered.lines().next().unwrap_or_default();
        TroupeError::InvalidInput(format!(
            "{} (engine arguments are the engine flags of `troupe generate --help`, `-` as `_`)",
            first.trim_start_matches("error: ")
        ))
    })?;
    let path = args.engine.model_path(model)?;
    args.engine.config(&path)
}

/// The long names of the engine flags `engine_config` takes (`kv-cache-mib`, ...).
pub fn engine_flag_names() -> Vec<String> {
    use clap::CommandFactory;
    EngineArgs::command()
        .get_arguments()
        .filter_map(|a| a.get_long().map(str::to_string))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_counts_and_durations_parse_or_are_named() {
        assert_eq!(parse_bytes("512M"), Ok(512 << 20));
        assert_eq!(parse_bytes("3"), Ok(3));
        assert_eq!(parse_bytes("2g"), Ok(2 << 30));
        assert!(parse_bytes("1.5G").unwrap_err().contains("1.5G"));
        assert!(parse_bytes("99999999999T").is_err(), "overflow");
        assert_eq!(parse_duration("90m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("3600"), Ok(Duration::from_secs(3600)));
        assert!(parse_duration("0").is_err());
        assert!(parse_duration("soon").unwrap_err().contains("soon"));
    }
}
