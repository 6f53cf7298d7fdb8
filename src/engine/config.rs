//! How an engine is built: `EngineConfig` and speculative decoding's settings.

use std::path::PathBuf;

use crate::kernels::Device;
use crate::runner::affinity::CpuAffinity;

/// Tokens a KV block holds unless `--block-size` says otherwise.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// A GGUF file or HF model directory (resolve names with `model::resolve_model_path`).
    pub model_path: PathBuf,
    pub block_size: usize,
    /// Memory for the paged KV cache; the number of blocks follows from the model's shape.
    /// 0 on a GPU: `gpu_memory_utilization` of the free memory, less the weights.
    pub kv_cache_bytes: usize,
    pub device: Device,
    /// Ranks in the tensor-parallel group: GPUs `device`, `device + 1`, ... (CPU ranks
    /// with in-process collectives on the CPU).
    pub tensor_parallel_size: usize,
    /// Share of the GPU's free memory troupe may take (weights, KV cache, activations).
    pub gpu_memory_utilization: f64,
    /// Seeded random weights from the model directory's `config.json` (benchmarks).
    pub dummy_weights: bool,
    /// A Jinja chat template used instead of the model's own (`--chat-template`).
    pub chat_template: Option<String>,
    /// Run every step eagerly: no CUDA graphs for decode steps (vLLM's `enforce_eager`).
    pub enforce_eager: bool,
    /// Start without a warm-up prefill of a step's most tokens (SGLang's
    /// `--skip-server-warmup`); profiles that should see one prefill use it.
    pub skip_warmup: bool,
    /// Whether rank threads are pinned to cores (a GPU's NUMA node; CPU ranks' shares).
    pub cpu_affinity: CpuAffinity,
    /// The longest context a request may have, prompt and output (`--max-model-len`;
    /// default: the model's own).
    pub max_model_len: Option<usize>,
    /// Threads of a CPU rank's kernels (`--threads`; default: every core it may use).
    pub cpu_threads: Option<usize>,
    pub max_num_seqs: usize,
    pub max_step_tokens: usize,
    pub step_time_budget_secs: f64,
    pub enable_prefix_cache: bool,
    /// Zero-overhead scheduling: plan step N+1 while step N runs.
    pub zero_overhead_scheduling: bool,
    /// Requests admitted to the engine at once; `generate` waits for a free place
    /// (back-pressure in front of ractor's unbounded mailboxes).
    pub max_pending_requests: usize,
    /// Rank worker and sampler restarts allowed within `rank_restart_window`; one more
    /// inside the window counts the failure as permanent. Restarts older than the window
    /// no longer count, so a fault once a day never uses the budget up.
    pub max_rank_restarts: usize,
    pub rank_restart_window: std::time::Duration,
    /// A request still waiting for admission this long after it was submitted ends with
    /// an error (`None`: it waits for as long as it takes).
    pub queue_timeout: Option<std::time::Duration>,
    /// End preempted requests (`FinishReason::Preempted`) instead of recomputing them.
    pub stop_preempted: bool,
    /// Kernels with a reduction order independent of the batch: a request's logits are
    /// bitwise the same alone or among others, in any prefill chunking.
    pub batch_invariant: bool,
    /// CPU: f32 activations against the quantized weights (the dequantized model's
    /// arithmetic) instead of 8-bit activations and integer dot products.
    pub exact_activations: bool,
    /// `--quantization fp8`: dense layer projections stored as per-channel FP8 at load.
    pub quantization: Option<crate::kernels::fp8::Quantization>,
    /// `--kv-cache-dtype`: what K and V entries are stored in (Llama family).
    pub kv_cache_dtype: crate::kernels::KvDtype,
    /// The prefix store below the device: host memory and a directory on disk.
    pub kv_store: crate::store::KvStoreConfig,
    /// `--swa-saved-states`: DeepSeek-V4 slot states saved at block boundaries with the
    /// prefix, so a hit resumes with no replay; `None`: up to 4 a slot within a quarter
    /// of the cache budget; 0: every hit replays.
    pub swa_saved_states: Option<usize>,
    /// Expert-parallel load balancing for MoE models (DeepSeek-V4): the EP group the
    /// placement is planned for, replicas, statistics window, rebalance period. `None`:
    /// off. Expert-parallel execution over several ranks is not built yet, so today this
    /// plans the map and reports `moe_lb` for the group it describes.
    pub eplb: Option<crate::eplb::EplbSettings>,
    /// DeepSeek-V4 on one device: which routed experts live in host memory and run on
    /// the CPU (`--cpu-moe`, `--n-cpu-moe N`; by default only what the device cannot hold).
    pub cpu_moe: crate::model::deepseek_v4::expert_placement::CpuMoe,
    /// Host experts copied to the device for steps whose rows make that faster than the
    /// CPU (`--stream-experts`; `expert_streaming.rs`).
    pub stream_experts: crate::model::deepseek_v4::expert_streaming::StreamExperts,
    /// Speculative decoding; `None`: off.
    pub speculative: Option<SpecConfig>,
    /// `--spec draft`: the draft model (same tokenizer and vocabulary as the model), run
    /// by the rank workers beside it.
    pub draft_model_path: Option<PathBuf>,
    /// Where measured decode latency curves are kept (confidence-scheduled verification);
    /// `None`: `$TROUPE_HOME/latency-curves`.
    pub latency_curve_dir: Option<PathBuf>,
}

/// Who proposes draft tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecMethod {
    /// Prompt lookup: the continuation of the latest earlier match of the last n tokens.
    Ngram,
    /// A smaller model with the same tokenizer (`--draft-model`).
    DraftModel,
    /// The model's own next-n layers.
    Mtp,
}

/// How many drafts a step verifies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecVerify {
    /// Every draft the drafter proposes, up to `num_speculative_tokens`.
    Fixed,
    /// A global budget chosen from the drafts' confidences and the step's cost (DSpark).
    Confidence,
}

/// How a sampled (temperature > 0) request's drafts are accepted; greedy requests accept
/// while the draft is the argmax either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecAcceptance {
    /// Each position's token is what the sampler draws there with the accepted drafts as
    /// history: output (and logprobs) of plain decoding, whatever the verify lengths.
    Coupled,
    /// Accept a draft with probability p(draft) (n-gram drafts are certain: q = 1), else
    /// draw from the residual: the target's distribution, more drafts accepted, but the
    /// tokens depend on the drafts. Rows with penalties, bias, bans or top logprobs stay
    /// coupled.
    Rejection,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecConfig {
    pub method: SpecMethod,
    /// Drafts per request per step, at most.
    pub num_speculative_tokens: usize,
    pub verify: SpecVerify,
    pub acceptance: SpecAcceptance,
}

impl EngineConfig {
    pub fn new(model_path: impl Into<PathBuf>) -> Self {
        EngineConfig {
            model_path: model_path.into(),
            block_size: DEFAULT_BLOCK_SIZE,
            kv_cache_bytes: 1 << 30,
            device: Device::Cpu,
            tensor_parallel_size: 1,
            gpu_memory_utilization: 0.9,
            dummy_weights: false,
            chat_template: None,
            enforce_eager: false,
            skip_warmup: false,
            cpu_affinity: CpuAffinity::Auto,
            cpu_threads: None,
            max_model_len: None,
            max_num_seqs: 256,
            max_step_tokens: 2048,
            step_time_budget_secs: 0.25,
            enable_prefix_cache: true,
            zero_overhead_scheduling: true,
            max_pending_requests: 4096,
            max_rank_restarts: 8,
            rank_restart_window: std::time::Duration::from_secs(600),
            queue_timeout: None,
            stop_preempted: false,
            batch_invariant: false,
            exact_activations: false,
            quantization: None,
            kv_cache_dtype: crate::kernels::KvDtype::Auto,
            kv_store: Default::default(),
            swa_saved_states: None,
            eplb: None,
            cpu_moe: Default::default(),
            stream_experts: Default::default(),
            speculative: None,
            draft_model_path: None,
            latency_curve_dir: None,
        }
    }
}
