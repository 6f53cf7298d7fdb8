//! The `troupe` command line. Errors print one line naming the problem and exit with 2.

use std::io::Write;
use std::path::{Path, PathBuf};

use clap::{Args, Parser, Subcommand};

use crate::engine::{
    Device, Engine, EngineConfig, EngineError, EngineRequest, FinishReason, RequestLimits,
    SpecAcceptance, SpecConfig, SpecMethod, SpecVerify,
};
use crate::error::{Result, TroupeError};
use crate::generate::DEFAULT_BLOCK_SIZE;
use crate::model::chat_template::ChatMessage;
use crate::model::{self, ModelText, hub};
use crate::protocol::conversation::{Conversation, Message, Role};
use crate::protocol::jsonl::{OutputLine, PromptLine, parse_prompts_file};
use crate::sampling::SamplingParams;

#[derive(Parser)]
#[command(name = "troupe", version, about = "An LLM inference engine")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text for one prompt or a file of prompts.
    Generate(Box<GenerateArgs>),
    /// Serve an OpenAI-compatible HTTP API.
    Serve(Box<ServeArgs>),
    /// Benchmark a running server: Poisson arrivals at each rate, TTFT / TPOT / ITL.
    BenchServe(crate::bench_serve::BenchServeArgs),
}

#[derive(Args)]
pub struct ServeArgs {
    /// A known model name, a GGUF file or an HF model directory; also the name clients
    /// send as `model`.
    #[arg(long, default_value = hub::DEFAULT_MODEL)]
    model: String,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    #[command(flatten)]
    engine: EngineFlags,
}

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
    /// Seeded random weights for the shape in the model directory's config.json (made on
    /// the device on a GPU): benchmarks of models whose weights are not at hand.
    #[arg(long)]
    dummy_weights: bool,
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
    fn config(&self, model_path: &Path) -> Result<EngineConfig> {
        // The CPU attention kernel holds one block's scores on the stack.
        if self.block_size == 0 || self.block_size > 256 {
            return Err(TroupeError::InvalidInput(format!(
                "--block-size must be in 1..=256, got {}",
                self.block_size
            )));
        }
        let mut cfg = EngineConfig::new(model_path);
        cfg.block_size = self.block_size;
        if !(self.gpu_memory_utilization > 0.0 && self.gpu_memory_utilization <= 1.0) {
            return Err(TroupeError::InvalidInput(format!(
                "--gpu-memory-utilization must be in (0, 1], got {}",
                self.gpu_memory_utilization
            )));
        }
        cfg.device = self.device;
        cfg.tensor_parallel_size = self.tensor_parallel_size;
        cfg.eplb = self.eplb_ranks.map(|num_ranks| crate::eplb::EplbSettings {
            num_ranks,
            num_redundant_experts: self.eplb_redundant_experts,
            window_steps: self.eplb_period_steps.max(1) as usize,
            period_steps: self.eplb_period_steps,
        });
        cfg.dummy_weights = self.dummy_weights;
        cfg.enforce_eager = self.enforce_eager;
        cfg.skip_warmup = self.skip_warmup;
        cfg.cpu_affinity = self.cpu_affinity;
        if self.dummy_weights && !model_path.join("config.json").is_file() {
            return Err(TroupeError::InvalidInput(format!(
                "--dummy-weights needs an HF model directory with a config.json; {} has none",
                model_path.display()
            )));
        }
        cfg.gpu_memory_utilization = self.gpu_memory_utilization;
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
}

/// The runtime the engine's actors live on (actix-web, when serving, runs its own).
fn engine_runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| TroupeError::InvalidInput(format!("cannot start the async runtime: {e}")))
}

fn run_serve(args: ServeArgs) -> Result<()> {
    let path = model::resolve_model_path(&args.model)?;
    let cfg = args.engine.config(&path)?;
    let runtime = engine_runtime()?;
    let engine = runtime.block_on(Engine::spawn(cfg)).map_err(engine_err)?;
    crate::protocol::server::serve(engine, args.model.clone(), &args.host, args.port).map_err(
        |e| TroupeError::InvalidInput(format!("cannot serve on {}:{}: {e}", args.host, args.port)),
    )?;
    drop(runtime);
    Ok(())
}

#[derive(Args)]
pub struct GenerateArgs {
    /// A known model name, a GGUF file or an HF model directory.
    #[arg(long, default_value = hub::DEFAULT_MODEL)]
    model: String,
    #[arg(long, group = "input")]
    prompt: Option<String>,
    /// Comma-separated token ids.
    #[arg(long, group = "input", value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    /// JSONL: one `{"prompt"|"prompt_ids", "max_tokens", "temperature", "seed", ...}` per line.
    #[arg(long, group = "input")]
    prompts_file: Option<PathBuf>,
    /// Render the prompt as one user turn through the model's chat template.
    #[arg(long)]
    chat: bool,
    /// A system turn before the user turn (implies --chat).
    #[arg(long)]
    system: Option<String>,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// 0 means greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    top_p: f32,
    /// 0 means no top-k cut.
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Seed of the sampler; drawn at random when left out.
    #[arg(long)]
    seed: Option<u64>,
    /// Report the K most likely tokens and their log-probabilities per generated token.
    #[arg(long, default_value_t = 0)]
    top_logprobs: usize,
    /// Print one JSON object per prompt, in input order.
    #[arg(long)]
    json: bool,
    /// Worker threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Generate past EOS / end-of-turn tokens until --max-tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Run statistics (throughput, steps, output tokens, elapsed seconds) as one JSON
    /// object: to stderr, or with a FILE, to that file.
    #[arg(long, num_args = 0..=1, default_missing_value = "-", value_name = "FILE")]
    stats: Option<PathBuf>,
    #[command(flatten)]
    engine: EngineFlags,
    /// Drop tokens below this fraction of the most likely token's probability.
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    frequency_penalty: f32,
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    presence_penalty: f32,
    /// Stop tokens are not sampled before this many tokens.
    #[arg(long, default_value_t = 0)]
    min_tokens: usize,
    /// A stop string (repeatable); not included in the output.
    #[arg(long)]
    stop: Vec<String>,
}

fn engine_err(e: EngineError) -> TroupeError {
    match e {
        EngineError::Model(m) => m,
        other => TroupeError::InvalidInput(other.to_string()),
    }
}

fn prompt_ids(
    args: &GenerateArgs,
    text: &ModelText,
    path: &Path,
    line: &PromptLine,
) -> Result<Vec<u32>> {
    let (prompt, ids) = (&line.prompt, &line.prompt_ids);
    if let Some(ids) = ids {
        return Ok(ids.clone());
    }
    let prompt = prompt
        .as_ref()
        .expect("parse_prompts_file rejects lines without a prompt");
    let tok = text.tokenizer.as_ref().ok_or_else(|| {
        TroupeError::InvalidInput(format!(
            "{} has no tokenizer: give prompts as token ids (--prompt-ids or `prompt_ids`)",
            path.display()
        ))
    })?;
    let system = line.system.as_ref().or(args.system.as_ref());
    if !(line.chat.unwrap_or(args.chat) || system.is_some()) {
        return tok.encode_prompt(prompt);
    }
    if text.deepseek_v4.is_some() {
        // DeepSeek-V4 has no Jinja template: its own encoding renders the turn.
        let mut messages = Vec::new();
        if let Some(sys) = system {
            messages.push(Message::new(Role::System, sys.as_str()));
        }
        messages.push(Message::new(Role::User, prompt.as_str()));
        return Conversation::from_messages(messages).to_prompt_ids(text);
    }
    let template = text.chat_template.as_ref().ok_or_else(|| {
        TroupeError::InvalidInput(format!(
            "{} has no chat template: drop --chat",
            path.display()
        ))
    })?;
    let mut messages = Vec::new();
    if let Some(sys) = system {
        messages.push(ChatMessage::new("system", sys));
    }
    messages.push(ChatMessage::new("user", prompt));
    tok.encode(&template.render(&messages, true)?)
}

pub fn main() -> i32 {
    // Logs only when asked for: stderr carries one error line or the stats object, which
    // scripts read.
    if let Ok(filter) = tracing_subscriber::EnvFilter::try_from_env("RUST_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .init();
    }
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { 2 } else { 0 };
        }
    };
    let result = match cli.command {
        Command::Generate(args) => run_generate(*args),
        Command::Serve(args) => run_serve(*args),
        Command::BenchServe(args) => crate::bench_serve::run(args),
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            2
        }
    }
}

fn run_generate(args: GenerateArgs) -> Result<()> {
    if let Some(n) = args.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n.max(1))
            .build_global()
            .map_err(|e| TroupeError::InvalidInput(format!("--threads: {e}")))?;
    }
    let lines: Vec<PromptLine> = match (&args.prompt, &args.prompt_ids, &args.prompts_file) {
        (Some(p), _, _) => vec![PromptLine {
            prompt: Some(p.clone()),
            ..Default::default()
        }],
        (_, Some(ids), _) => vec![PromptLine {
            prompt_ids: Some(ids.clone()),
            ..Default::default()
        }],
        (_, _, Some(path)) => {
            let text = std::fs::read_to_string(path).map_err(|e| TroupeError::io(path, e))?;
            parse_prompts_file(&text, &path.display().to_string())?
        }
        _ => {
            return Err(TroupeError::InvalidInput(
                "nothing to generate from: pass --prompt, --prompt-ids or --prompts-file".into(),
            ));
        }
    };
    let path = model::resolve_model_path(&args.model)?;
    let text = model::load_text(&path)?;
    let mut requests = Vec::with_capacity(lines.len());
    for (index, line) in lines.iter().enumerate() {
        let prompt_ids = prompt_ids(&args, &text, &path, line)?;
        let params = SamplingParams {
            temperature: line.temperature.unwrap_or(args.temperature),
            top_k: line.top_k.unwrap_or(args.top_k),
            top_p: line.top_p.unwrap_or(args.top_p),
            min_p: line.min_p.unwrap_or(args.min_p),
            repetition_penalty: line.repetition_penalty.unwrap_or(args.repetition_penalty),
            frequency_penalty: line.frequency_penalty.unwrap_or(args.frequency_penalty),
            presence_penalty: line.presence_penalty.unwrap_or(args.presence_penalty),
            num_top_logprobs: line.top_logprobs.unwrap_or(args.top_logprobs),
            logit_bias: line.logit_bias_ids()?,
            ..Default::default()
        };
        let mut request = EngineRequest::new(
            prompt_ids,
            line.max_tokens.unwrap_or(args.max_tokens),
            params,
        );
        request.seed = line
            .seed
            .or(args.seed.map(|s| s.wrapping_add(index as u64)));
        request.min_tokens = line.min_tokens.unwrap_or(args.min_tokens);
        request.ignore_eos = args.ignore_eos;
        request.stop = line.stop.clone().unwrap_or_else(|| args.stop.clone());
        request.stop_token_ids = line.stop_token_ids.clone().unwrap_or_default();
        request.grammar = line.grammar()?;
        let limits = RequestLimits {
            vocab_size: text.config.vocab_size,
            max_context_tokens: text.config.max_context_tokens,
        };
        request.validate(limits).map_err(|e| e.for_prompt(index))?;
        requests.push(request);
    }
    let cfg = args.engine.config(&path)?;
    let runtime = engine_runtime()?;
    let started = std::time::Instant::now();
    // From the first request submitted to the last output: the engine's work without its
    // start (weights, kernels).
    let mut generate_s = 0.0;
    let (outputs, status) = runtime.block_on(async {
        let engine = Engine::spawn(cfg).await.map_err(engine_err)?;
        let submitted = std::time::Instant::now();
        let outputs = engine.generate_batch(requests.clone()).await;
        generate_s = submitted.elapsed().as_secs_f64();
        let status = engine.status().await.map_err(engine_err)?;
        engine.shutdown(false).await;
        Ok::<_, TroupeError>((outputs, status))
    })?;
    let elapsed_s = started.elapsed().as_secs_f64();
    if let Some(dest) = &args.stats {
        let output_tokens: usize = outputs.iter().flatten().map(|o| o.token_ids.len()).sum();
        let stats = serde_json::json!({
            "output_tokens": output_tokens,
            "elapsed_s": elapsed_s,
            "generate_s": generate_s,
            "prefill_tokens": status.num_prefill_tokens,
            "prefill_tokens_per_s": status.num_prefill_tokens as f64 / status.prefill_secs.max(1e-9),
            "decode_tokens": status.num_decode_tokens,
            "decode_tokens_per_s": status.num_decode_tokens as f64 / status.decode_secs.max(1e-9),
            "steps": status.num_steps,
            "tensor_parallel_size": status.tensor_parallel_size,
            "group_resets": status.num_resets.saturating_sub(1),
            "preemptions": status.num_preemptions,
            "moe_lb": status.moe_lb,
            "eplb_rebalances": status.num_eplb_rebalances,
            "worker_idle_secs": status.worker_idle_secs,
            "cpu_path": crate::kernels::cpu::simd::cpu_path().name(),
            "device_idle_secs": status.device_idle_secs,
            "prefix_cache_hit_blocks": status.num_prefix_hit_blocks,
            "prefix_cache_queried_blocks": status.num_prefix_queried_blocks,
            "spec_verify_rows": status.num_spec_verify_rows,
            "spec_draft_tokens": status.num_spec_draft_tokens,
            "spec_verified_tokens": status.num_spec_verified_tokens,
            "spec_accepted_tokens": status.num_spec_accepted_tokens,
            "spec_sat_out_rows": status.num_spec_sat_out_rows,
            "host_sampled_rows": status.num_host_sampled_rows,
            "cpu_affinity": status.cpu_affinity,
            "resident_weight_bytes": status.resident_weight_bytes,
            "checkpoint_bytes": crate::model::checkpoint_bytes(&path),
            "weight_card": status.weight_card,
        });
        if dest.as_os_str() == "-" {
            eprintln!("{stats}");
        } else {
            std::fs::write(dest, format!("{stats}\n")).map_err(|e| {
                TroupeError::InvalidInput(format!("--stats {}: {e}", dest.display()))
            })?;
        }
    }
    let tok = text.tokenizer.as_deref();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    for (i, result) in outputs.into_iter().enumerate() {
        let o = result.map_err(|e| TroupeError::InvalidInput(format!("prompt {i}: {e}")))?;
        if let Some(err) = &o.error {
            return Err(TroupeError::InvalidInput(format!("prompt {i}: {err}")));
        }
        // The streamed text: stop strings already cut off.
        let text = o.text.clone();
        let finish = o.finish_reason.map_or("length", |r| match r {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::Preempted => "preempted",
        });
        let written = if args.json {
            let line = OutputLine {
                prompt_ids: &requests[i].prompt_ids,
                token_ids: &o.token_ids,
                text,
                finish_reason: finish,
                top_logprobs: (requests[i].params.num_top_logprobs > 0)
                    .then(|| o.top_logprobs.clone()),
                seed: o.seed,
            };
            writeln!(
                out,
                "{}",
                serde_json::to_string(&line).expect("output serializes")
            )
        } else if tok.is_none() {
            writeln!(out, "{:?}", o.token_ids)
        } else {
            writeln!(out, "{text}")
        };
        // A closed pipe (`| head`) is not an error worth a message.
        if written.is_err() {
            break;
        }
    }
    Ok(())
}
