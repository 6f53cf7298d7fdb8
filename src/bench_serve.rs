//! `troupe bench-serve`: an online serving benchmark against a running `troupe serve`
//! (or any OpenAI-compatible server that streams `token_ids`). For each request rate it
//! sends `--num-prompts` streaming `/v1/completions` requests with Poisson arrivals, each a
//! random `--input-len`-token prompt generating exactly `--output-len` tokens (EOS
//! ignored), and reports throughput and TTFT / TPOT / ITL percentiles, like vLLM's
//! `benchmark_serving.py`.
//!
//! Arrivals and prompts are seeded counter draws (`sampling::uniform`), so a run is
//! reproducible; every rate gets fresh prompts so a prefix cache cannot carry hits from
//! one rate to the next. A failed request (refused, error event, cut stream, wrong token
//! count) is counted and left out of the latency statistics.
//!
//! With `--images-per-request N` each request is a streaming chat instead: the prompt as
//! text, then N seeded noise images (`--image-size`) as base64 PNG parts.

mod http;
mod images;
mod table;

pub use table::format_table;

use std::path::PathBuf;
// std's Arc even under loom: these tasks run on a real tokio runtime, never in a model.
use crate::sync::Shared as Arc;
use std::time::{Duration, Instant};

use clap::Args;
use serde::Serialize;
use serde_json::{Value, json};

use crate::error::{Result, TroupeError};
use crate::sampling::{splitmix64, uniform};
use http::Endpoint;

/// Draw streams of `sampling::uniform`, apart from each other.
const STREAM_ARRIVAL: u64 = 0x6172_7269_7661_6c00;
const STREAM_PROMPT: u64 = 0x7072_6f6d_7074_0000;
/// Prompt ids are drawn from here: clear of the special tokens at the bottom of common
/// vocabularies and inside every vocabulary the engine serves.
const PROMPT_TOKEN_IDS: std::ops::Range<u32> = 100..10_000;

#[derive(Args)]
pub struct BenchServeArgs {
    /// The server root.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    url: String,
    /// The model name to send; by default the first one GET /v1/models lists.
    #[arg(long)]
    model: Option<String>,
    /// Request rates in requests/s, comma-separated; `inf` sends all requests at once.
    #[arg(long, value_delimiter = ',', value_parser = parse_rate,
          default_values = ["1", "2", "4", "8", "inf"])]
    rates: Vec<f64>,
    /// Requests per rate.
    #[arg(long, default_value_t = 64)]
    num_prompts: usize,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 128)]
    input_len: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 64)]
    output_len: usize,
    /// Seed of the arrival times and the prompts.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Also write the rows as a JSON array to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// A request still unfinished after this many seconds counts as failed.
    #[arg(long, default_value_t = 600)]
    request_timeout_secs: u64,
    /// Token ids sent with a −100 logit bias: the EOS ids, for a peer server that has no
    /// `ignore_eos`, so both sides generate the full `--output-len`.
    #[arg(long, value_delimiter = ',')]
    suppress_ids: Vec<u32>,
    /// Send prompts as text (`--input-len` common words) instead of token ids, for a peer
    /// server that takes only text.
    #[arg(long)]
    text_prompts: bool,
    /// The server's key (`troupe serve --api-key`), sent as `Authorization: Bearer`.
    #[arg(long, env = "TROUPE_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Also write the first rate's requests to this file as `troupe generate --prompts-file`
    /// lines, so an offline run can be timed on the very same requests.
    #[arg(long)]
    write_prompts: Option<PathBuf>,
    /// Images per request (a vision-language model): requests go to /v1/chat/completions
    /// with the prompt as text (`--input-len` words) and this many noise images.
    #[arg(long, default_value_t = 0)]
    images_per_request: usize,
    /// Each image's size, WIDTHxHEIGHT in pixels.
    #[arg(long, default_value = "448x448", value_parser = images::parse_size)]
    image_size: (u32, u32),
}

/// The requests `first..first + num` as prompts-file lines (ids, budget, greedy); the
/// offline run gives `--ignore-eos` as bench-serve's requests do.
pub fn prompts_file_lines(
    input_len: usize,
    output_len: usize,
    seed: u64,
    first: u64,
    num: usize,
) -> String {
    (first..first + num as u64)
        .map(|i| {
            let line = json!({
                "prompt_ids": random_prompt_ids(input_len, seed, i),
                "max_tokens": output_len, "temperature": 0,
            });
            line.to_string() + "\n"
        })
        .collect()
}

pub fn parse_rate(s: &str) -> std::result::Result<f64, String> {
    let rate = match s.trim() {
        "inf" => f64::INFINITY,
        t => t
            .parse::<f64>()
            .map_err(|_| format!("`{s}` is not a rate (a number of requests/s, or inf)"))?,
    };
    if rate.is_nan() || rate <= 0.0 {
        return Err(format!("rate `{s}` must be positive"));
    }
    Ok(rate)
}

fn rate_label(rate: f64) -> String {
    if rate.is_infinite() {
        "inf".into()
    } else {
        format!("{rate}")
    }
}

/// Send times in seconds from the start: exponential gaps of mean `1 / rate`, the first
/// request at once; all at 0 for an infinite rate.
pub fn poisson_arrivals(num_requests: usize, rate: f64, seed: u64) -> Vec<f64> {
    let mut at = 0.0;
    (0..num_requests)
        .map(|i| {
            if i > 0 && rate.is_finite() {
                let u = uniform(seed, i as u64, STREAM_ARRIVAL);
                // 1 - u is in (0, 1], so the log is finite.
                at += -(1.0 - u).ln() / rate;
            }
            at
        })
        .collect()
}

/// Prompt number `index` of a run: `len` ids from `PROMPT_TOKEN_IDS`, exact length.
pub fn random_prompt_ids(len: usize, seed: u64, index: u64) -> Vec<u32> {
    let prompt_seed = splitmix64(seed ^ splitmix64(index));
    let span = (PROMPT_TOKEN_IDS.end - PROMPT_TOKEN_IDS.start) as f64;
    (0..len as u64)
        .map(|j| PROMPT_TOKEN_IDS.start + (uniform(prompt_seed, j, STREAM_PROMPT) * span) as u32)
        .collect()
}

/// Words that are one token each in common BPE vocabularies (with their leading space).
const PROMPT_WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "time", "people", "water",
    "city", "house", "music", "light", "river", "money", "paper", "world", "story", "green",
    "small", "great", "old",
];

/// The text form of prompt number `index`: `len` words drawn like `random_prompt_ids`.
pub fn random_prompt_text(len: usize, seed: u64, index: u64) -> String {
    random_prompt_ids(len, seed, index)
        .iter()
        .map(|&id| PROMPT_WORDS[id as usize % PROMPT_WORDS.len()])
        .collect::<Vec<_>>()
        .join(" ")
}

/// The `p`-th percentile (0..=100) of sorted values, interpolated linearly between
/// ranks (numpy's default, which vLLM's numbers use); `None` without values.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    let last = sorted.len().checked_sub(1)?;
    let rank = p.clamp(0.0, 100.0) / 100.0 * last as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    Some(sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64))
}

#[derive(Debug, PartialEq)]
pub enum StreamEvent {
    /// A chunk carrying this many new tokens (0 for a chunk with only a finish reason).
    Tokens(usize),
    /// The usage chunk of a chat stream: the tokens generated in all.
    Usage(usize),
    Done,
}

/// One SSE event's data from `/v1/completions`.
pub fn parse_event(data: &str) -> std::result::Result<StreamEvent, String> {
    if data.trim() == "[DONE]" {
        return Ok(StreamEvent::Done);
    }
    let value: Value = serde_json::from_str(data)
        .map_err(|e| format!("a stream event is not JSON ({e}): {}", clip(data)))?;
    if let Some(err) = value.get("error") {
        let message = err["message"]
            .as_str()
            .map_or_else(|| err.to_string(), str::to_string);
        return Err(format!("the server reported an error: {message}"));
    }
    let choices = value["choices"]
        .as_array()
        .ok_or_else(|| format!("a stream event has no `choices`: {}", clip(data)))?;
    if let (true, Some(n)) = (
        choices.is_empty(),
        value["usage"]["completion_tokens"].as_u64(),
    ) {
        return Ok(StreamEvent::Usage(n as usize));
    }
    let mut num_tokens = 0;
    for choice in choices {
        num_tokens += match choice["token_ids"].as_array() {
            Some(ids) => ids.len(),
            // A server without `token_ids` (llama.cpp's, and chat chunks) streams one
            // token per chunk.
            None => {
                let text = choice["text"]
                    .as_str()
                    .or(choice["delta"]["content"].as_str());
                usize::from(text.is_some_and(|t| !t.is_empty()))
            }
        };
    }
    Ok(StreamEvent::Tokens(num_tokens))
}

fn clip(s: &str) -> String {
    match s.char_indices().nth(200) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

/// The latencies of one finished request, in seconds.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestTiming {
    pub ttft_secs: f64,
    pub e2e_secs: f64,
    /// Gaps between consecutive events that carried tokens.
    pub itl_secs: Vec<f64>,
    pub num_output_tokens: usize,
}

impl RequestTiming {
    /// From (seconds since send, tokens) per token-carrying event, in arrival order.
    pub fn from_events(
        events: &[(f64, usize)],
        e2e_secs: f64,
        expected_tokens: usize,
    ) -> std::result::Result<Self, String> {
        let &(ttft_secs, _) = events.first().ok_or("the stream carried no tokens")?;
        let num_counted: usize = events.iter().map(|&(_, n)| n).sum();
        // A server that streams only text may fold a token that ends inside a character
        // into the next chunk, so a count a little short of the budget is still a full run.
        if num_counted > expected_tokens || num_counted * 10 < expected_tokens * 9 {
            return Err(format!(
                "generated {num_counted} tokens, expected {expected_tokens} (ignore_eos not honoured?)"
            ));
        }
        let num_output_tokens = expected_tokens;
        Ok(RequestTiming {
            ttft_secs,
            e2e_secs,
            itl_secs: events.windows(2).map(|w| w[1].0 - w[0].0).collect(),
            num_output_tokens,
        })
    }

    /// Mean time per output token after the first; `None` with a single token.
    pub fn tpot_secs(&self) -> Option<f64> {
        (self.num_output_tokens > 1)
            .then(|| (self.e2e_secs - self.ttft_secs) / (self.num_output_tokens - 1) as f64)
    }
}

/// One rate's results: a row of the table and of `--json`. Latencies in milliseconds.
#[derive(Debug, Clone, Serialize)]
pub struct RateRow {
    /// Requests/s as given, or "inf".
    pub rate: String,
    pub completed: usize,
    pub failed: usize,
    pub duration_secs: f64,
    pub request_throughput: f64,
    pub output_token_throughput: f64,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p90_ms: Option<f64>,
    pub ttft_p99_ms: Option<f64>,
    pub tpot_p50_ms: Option<f64>,
    pub tpot_p90_ms: Option<f64>,
    pub tpot_p99_ms: Option<f64>,
    pub itl_p50_ms: Option<f64>,
    pub itl_p99_ms: Option<f64>,
    /// End-to-end latency of a request, as vLLM's `e2el`.
    pub e2el_p50_ms: Option<f64>,
    pub e2el_p99_ms: Option<f64>,
}

pub fn summarize(
    rate: f64,
    results: &[std::result::Result<RequestTiming, String>],
    duration_secs: f64,
) -> RateRow {
    let ok: Vec<&RequestTiming> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
    let sorted_ms = |mut v: Vec<f64>| {
        v.iter_mut().for_each(|x| *x *= 1e3);
        v.sort_by(f64::total_cmp);
        v
    };
    let ttft = sorted_ms(ok.iter().map(|t| t.ttft_secs).collect());
    let tpot = sorted_ms(ok.iter().filter_map(|t| t.tpot_secs()).collect());
    let itl = sorted_ms(ok.iter().flat_map(|t| t.itl_secs.iter().copied()).collect());
    let e2el = sorted_ms(ok.iter().map(|t| t.e2e_secs).collect());
    let num_output_tokens: usize = ok.iter().map(|t| t.num_output_tokens).sum();
    let per_sec = |n: usize| {
        if duration_secs > 0.0 {
            n as f64 / duration_secs
        } else {
            0.0
        }
    };
    RateRow {
        rate: rate_label(rate),
        completed: ok.len(),
        failed: results.len() - ok.len(),
        duration_secs,
        request_throughput: per_sec(ok.len()),
        output_token_throughput: per_sec(num_output_tokens),
        ttft_p50_ms: percentile(&ttft, 50.0),
        ttft_p90_ms: percentile(&ttft, 90.0),
        ttft_p99_ms: percentile(&ttft, 99.0),
        tpot_p50_ms: percentile(&tpot, 50.0),
        tpot_p90_ms: percentile(&tpot, 90.0),
        tpot_p99_ms: percentile(&tpot, 99.0),
        itl_p50_ms: percentile(&itl, 50.0),
        itl_p99_ms: percentile(&itl, 99.0),
        e2el_p50_ms: percentile(&e2el, 50.0),
        e2el_p99_ms: percentile(&e2el, 99.0),
    }
}

/// What every request of a run shares.
struct Ctx {
    endpoint: Endpoint,
    model: String,
    input_len: usize,
    output_len: usize,
    seed: u64,
    request_timeout: Duration,
    suppress_ids: Vec<u32>,
    text_prompts: bool,
    /// Images per request and their size (0: completions without images).
    images: (usize, (u32, u32)),
}

async fn run_one(ctx: Arc<Ctx>, index: u64) -> std::result::Result<RequestTiming, String> {
    let prompt = if ctx.text_prompts {
        json!(random_prompt_text(ctx.input_len, ctx.seed, index))
    } else {
        json!(random_prompt_ids(ctx.input_len, ctx.seed, index))
    };
    let logit_bias: serde_json::Map<String, Value> = ctx
        .suppress_ids
        .iter()
        .map(|id| (id.to_string(), json!(-100)))
        .collect();
    let (path, body) = if ctx.images.0 > 0 {
        let text = random_prompt_text(ctx.input_len, ctx.seed, index);
        let body = images::chat_body(
            &ctx.model,
            &text,
            ctx.images,
            ctx.seed,
            index,
            ctx.output_len,
            &logit_bias,
        );
        ("/v1/chat/completions", body.to_string())
    } else {
        let body = json!({
            "model": ctx.model, "prompt": prompt, "max_tokens": ctx.output_len,
            "ignore_eos": true, "stream": true, "temperature": 0, "logit_bias": logit_bias,
        });
        ("/v1/completions", body.to_string())
    };
    let start = Instant::now();
    let mut events: Vec<(f64, usize)> = Vec::with_capacity(ctx.output_len);
    let mut done = false;
    let mut reported = None;
    let on_event = |data: &str, at: Instant| {
        match parse_event(data)? {
            StreamEvent::Done => done = true,
            StreamEvent::Usage(n) => reported = Some(n),
            StreamEvent::Tokens(0) => {}
            StreamEvent::Tokens(n) => events.push((at.duration_since(start).as_secs_f64(), n)),
        }
        Ok(())
    };
    let request = http::post_sse(&ctx.endpoint, path, &body, on_event);
    tokio::time::timeout(ctx.request_timeout, request)
        .await
        .map_err(|_| format!("timed out after {:?}", ctx.request_timeout))??;
    let e2e_secs = start.elapsed().as_secs_f64();
    if !done {
        return Err("the stream ended without [DONE]".into());
    }
    // Chat chunks carry text, not ids: tokens that end inside a character arrive folded
    // into a later chunk, and the usage chunk says how many there were.
    if let Some(n) = reported {
        let counted: usize = events.iter().map(|&(_, k)| k).sum();
        if let (true, Some(last)) = (counted < n, events.last_mut()) {
            last.1 += n - counted;
        }
    }
    RequestTiming::from_events(&events, e2e_secs, ctx.output_len)
}

/// One rate: `num_prompts` requests at Poisson times, prompts `first_prompt..`.
async fn run_rate(
    ctx: &Arc<Ctx>,
    rate: f64,
    arrival_seed: u64,
    first_prompt: u64,
    num: usize,
) -> RateRow {
    let arrivals = poisson_arrivals(num, rate, arrival_seed);
    let t0 = tokio::time::Instant::now();
    let mut tasks = Vec::with_capacity(num);
    for (i, &at) in arrivals.iter().enumerate() {
        tokio::time::sleep_until(t0 + Duration::from_secs_f64(at)).await;
        tasks.push(tokio::spawn(run_one(ctx.clone(), first_prompt + i as u64)));
    }
    let mut results = Vec::with_capacity(num);
    for task in tasks {
        results.push(
            task.await
                .unwrap_or_else(|e| Err(format!("the request task failed: {e}"))),
        );
    }
    let row = summarize(rate, &results, t0.elapsed().as_secs_f64());
    let mut errors: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    errors.dedup();
    for e in errors.iter().take(3) {
        eprintln!("bench-serve: rate {}: failed request: {e}", row.rate);
    }
    row
}

async fn served_model(endpoint: &Endpoint) -> std::result::Result<String, String> {
    let models = http::get_json(endpoint, "/v1/models").await?;
    models["data"][0]["id"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| {
            format!(
                "GET /v1/models lists no model: {}",
                clip(&models.to_string())
            )
        })
}

pub fn run(args: BenchServeArgs) -> Result<()> {
    let bad = |m: String| TroupeError::InvalidInput(m);
    for (flag, value) in [
        ("--num-prompts", args.num_prompts),
        ("--input-len", args.input_len),
        ("--output-len", args.output_len),
    ] {
        if value == 0 {
            return Err(bad(format!("{flag} must be at least 1")));
        }
    }
    if let Some(path) = &args.write_prompts {
        if args.text_prompts || !args.suppress_ids.is_empty() || args.images_per_request > 0 {
            return Err(bad(
                "--write-prompts writes token-id prompts without a logit bias or images: not with --text-prompts, --suppress-ids or --images-per-request".into(),
            ));
        }
        let lines = prompts_file_lines(
            args.input_len,
            args.output_len,
            args.seed,
            0,
            args.num_prompts,
        );
        std::fs::write(path, lines).map_err(|e| TroupeError::io(path, e))?;
    }
    let mut endpoint = http::parse_url(&args.url).map_err(bad)?;
    endpoint.api_key = args.api_key.clone();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| bad(format!("cannot start the async runtime: {e}")))?;
    let rows = runtime.block_on(async {
        let model = match &args.model {
            Some(m) => m.clone(),
            None => served_model(&endpoint)
                .await
                .map_err(|e| bad(format!("cannot ask {} for its model: {e}", args.url)))?,
        };
        let ctx = Arc::new(Ctx {
            endpoint,
            model,
            input_len: args.input_len,
            output_len: args.output_len,
            seed: args.seed,
            request_timeout: Duration::from_secs(args.request_timeout_secs),
            suppress_ids: args.suppress_ids.clone(),
            text_prompts: args.text_prompts,
            images: (args.images_per_request, args.image_size),
        });
        // One request first: a misconfigured server fails here with its reason, and the
        // first rate does not pay for warm-up.
        run_one(ctx.clone(), u64::MAX)
            .await
            .map_err(|e| bad(format!("the test request to {} failed: {e}", args.url)))?;
        eprintln!(
            "bench-serve: {} at {}: {} requests per rate, {} prompt + {} output tokens each{}",
            ctx.model,
            args.url,
            args.num_prompts,
            args.input_len,
            args.output_len,
            match args.images_per_request {
                0 => String::new(),
                n => format!(
                    ", {n} images of {}x{}",
                    args.image_size.0, args.image_size.1
                ),
            }
        );
        let mut rows = Vec::new();
        for (k, &rate) in args.rates.iter().enumerate() {
            let first_prompt = (k * args.num_prompts) as u64;
            let arrival_seed = splitmix64(args.seed ^ splitmix64(k as u64));
            let row = run_rate(&ctx, rate, arrival_seed, first_prompt, args.num_prompts).await;
            eprintln!(
                "bench-serve: rate {}: {} ok, {} failed in {:.1} s",
                row.rate, row.completed, row.failed, row.duration_secs
            );
            rows.push(row);
        }
        Ok::<_, TroupeError>(rows)
    })?;
    print!("{}", format_table(&rows));
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&rows).expect("rows serialize");
        std::fs::write(path, text + "\n").map_err(|e| TroupeError::io(path, e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
