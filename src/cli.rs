//! The `troupe` command line. Errors print one line naming the problem and exit with 2.

use std::io::Write;
use std::path::{Path, PathBuf};

use clap::{Args, Parser, Subcommand};

use crate::engine::{Engine, EngineError, EngineRequest, FinishReason, RequestLimits};
use crate::error::{Result, TroupeError};
use crate::model::chat_template::ChatMessage;
use crate::model::{self, ModelText, hub};
use crate::protocol::conversation::{Conversation, Message, Role};
use crate::protocol::jsonl::{OutputLine, PromptLine, parse_prompts_file};
use crate::sampling::SamplingParams;

mod api_keys;
mod router;
mod serve;
mod telemetry;

pub use crate::engine::flags::EngineFlags;
pub use serve::ServeArgs;

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
    BenchServe(Box<crate::bench_serve::BenchServeArgs>),
    /// Serve the HTTP APIs for a cluster of engines (`serve --cluster`), routing each
    /// request to one by its prompt's cached prefix and the engines' loads.
    Router(Box<router::RouterArgs>),
}

/// The runtime the engine's actors live on (actix-web, when serving, runs its own).
fn engine_runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| TroupeError::InvalidInput(format!("cannot start the async runtime: {e}")))
}

#[derive(Args)]
pub struct GenerateArgs {
    /// A known model name, a GGUF file or an HF model directory.
    #[arg(long, default_value = hub::DEFAULT_MODEL)]
    model: String,
    /// The prompt text (one of --prompt, --prompt-ids, --prompts-file).
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
    /// Tokens to generate at most (fewer where a stop token or string comes first).
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// 0 means greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f32,
    /// Sample from the most likely tokens whose probabilities sum to this (1: all).
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
    /// Penalise tokens already in the prompt or output: a positive logit is divided by
    /// this, a negative one multiplied (1: off).
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// Subtract this times a token's count in the output so far from its logit.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    frequency_penalty: f32,
    /// Subtract this from the logit of every token the output already holds.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    presence_penalty: f32,
    /// Stop tokens are not sampled before this many tokens.
    #[arg(long, default_value_t = 0)]
    min_tokens: usize,
    /// Stop strings (`--stop A B`, or the flag repeated); not included in the output.
    #[arg(long, num_args = 1..)]
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

/// The ids of the flags the user gave (on the command line or in the environment), not
/// left at their defaults.
fn given_flags(m: &clap::ArgMatches) -> Vec<String> {
    use clap::parser::ValueSource;
    m.ids()
        .filter(|id| {
            matches!(
                m.value_source(id.as_str()),
                Some(ValueSource::CommandLine | ValueSource::EnvVariable)
            )
        })
        .map(|id| id.to_string())
        .collect()
}

pub fn main() -> i32 {
    main_from(std::env::args_os())
}

/// The command line `args` (the program's name first), as `main` runs it: what the Python
/// package's `troupe` entry point calls with its `sys.argv`.
pub fn main_from(args: impl IntoIterator<Item = std::ffi::OsString>) -> i32 {
    // Logs only when asked for: stderr carries one error line or the stats object, which
    // scripts read.
    use clap::{CommandFactory, FromArgMatches};
    let parsed = Cli::command()
        .try_get_matches_from(args)
        .and_then(|m| Cli::from_arg_matches(&m).map(|cli| (cli, m)));
    let (mut cli, matches) = match parsed {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { 2 } else { 0 };
        }
    };
    if let (Command::Serve(args), Some(("serve", m))) = (&mut cli.command, matches.subcommand()) {
        args.given = given_flags(m);
    }
    // Held to the end: dropping it flushes the spans still buffered.
    let _telemetry = match init_logs(&cli.command) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            return 2;
        }
    };
    let result = match cli.command {
        Command::Generate(args) => run_generate(*args),
        Command::Serve(args) => serve::run_serve(*args),
        Command::BenchServe(args) => crate::bench_serve::run(*args),
        Command::Router(args) => router::run_router(*args),
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            2
        }
    }
}

/// Logs go to stderr, filtered by RUST_LOG; a server logs warnings and errors (a failed
/// engine's reason among them) even without it.
fn init_logs(command: &Command) -> Result<Option<telemetry::Telemetry>> {
    use tracing_subscriber::Layer;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let (default_filter, json, otlp) = match command {
        Command::Serve(args) => (
            Some("warn"),
            args.log_format == serve::LogFormat::Json,
            args.otlp_traces_endpoint.as_deref(),
        ),
        _ => (None, false, None),
    };
    crate::notice::use_json(json);
    let filter = tracing_subscriber::EnvFilter::try_from_env("RUST_LOG")
        .ok()
        .or_else(|| default_filter.map(tracing_subscriber::EnvFilter::new));
    let logs = filter.map(|filter| {
        let logs = tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(false);
        if json {
            logs.json().with_filter(filter).boxed()
        } else {
            logs.with_filter(filter).boxed()
        }
    });
    let (spans, telemetry) = match otlp {
        Some(endpoint) => {
            let (layer, t) = telemetry::otlp_layer(endpoint)?;
            (Some(layer), Some(t))
        }
        None => (None, None),
    };
    let layers: Vec<_> = logs.into_iter().chain(spans).collect();
    if !layers.is_empty() {
        tracing_subscriber::registry().with(layers).init();
    }
    Ok(telemetry)
}

fn run_generate(args: GenerateArgs) -> Result<()> {
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
    let path = args.engine.model_path(&args.model)?;
    let cfg = args.engine.config(&path)?;
    let mut text = model::load_text(&path)?;
    if let Some(tokens) = cfg.max_model_len {
        text.cap_context(tokens)?;
    }
    if let Some(source) = &cfg.chat_template {
        text.set_chat_template(source)
            .map_err(|e| TroupeError::InvalidInput(format!("--chat-template: {e}")))?;
    }
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
            logit_bias: line.logit_bias_ids().map_err(|e| {
                TroupeError::InvalidInput(format!(
                    "{}: {e}",
                    line.label(args.prompts_file.as_deref())
                ))
            })?,
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
            scores_prompts: text.scores_prompts(),
            images: crate::api::ImageLimits::of(&text),
        };
        let label = line.label(args.prompts_file.as_deref());
        request.validate(limits).map_err(|e| e.for_prompt(label))?;
        requests.push(request);
    }
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
            "eplb_moved_experts": status.num_eplb_moved_experts,
            "moe_lb_measured": status.measured_moe_lb,
            "worker_idle_secs": status.worker_idle_secs,
            "cpu_path": crate::kernels::cpu::simd::cpu_path().name(),
            "device_idle_secs": status.device_idle_secs,
            "prefix_cache_hit_blocks": status.num_prefix_hit_blocks,
            "prefix_cache_queried_blocks": status.num_prefix_queried_blocks,
            "kv_store_hit_blocks": status.num_stored_hit_blocks,
            "swa_resumed_hits": status.num_resumed_hits,
            "swa_replayed_hits": status.num_replayed_hits,
            "kv_store": {
                "host_hit_blocks": status.kv_store.host_hit_blocks,
                "disk_hit_blocks": status.kv_store.disk_hit_blocks,
                "corrupt_blocks": status.kv_store.corrupt_blocks,
                "bytes_read": status.kv_store.bytes_read,
                "bytes_written": status.kv_store.bytes_written,
                "host_evictions": status.kv_store.host_evictions,
                "disk_evictions": status.kv_store.disk_evictions,
                "disk_expired": status.kv_store.disk_expired,
                "dropped_writes": status.kv_store.dropped_writes,
            },
            "spec_verify_rows": status.num_spec_verify_rows,
            "spec_draft_tokens": status.num_spec_draft_tokens,
            "spec_verified_tokens": status.num_spec_verified_tokens,
            "spec_accepted_tokens": status.num_spec_accepted_tokens,
            "spec_sat_out_rows": status.num_spec_sat_out_rows,
            "host_sampled_rows": status.num_host_sampled_rows,
            "cpu_affinity": status.cpu_affinity,
            "resident_weight_bytes": status.resident_weight_bytes,
            "resident_host_weight_bytes": status.resident_host_weight_bytes,
            "checkpoint_bytes": crate::model::checkpoint_bytes(&path),
            "weight_card": status.weight_card,
            "encoded_images": status.num_encoded_images,
            "image_cache_hits": status.num_image_cache_hits,
            "received_images": status.num_received_images,
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
    for (i, (line, result)) in lines.iter().zip(outputs).enumerate() {
        let label = || line.label(args.prompts_file.as_deref());
        let o = result.map_err(|e| TroupeError::InvalidInput(format!("{}: {e}", label())))?;
        if let Some(err) = &o.error {
            return Err(TroupeError::InvalidInput(format!("{}: {err}", label())));
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

#[cfg(test)]
mod tests;
