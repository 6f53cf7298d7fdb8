//! DeepSeek-V4 prefix hits: time to first token of a repeated long prompt, cold and hit,
//! with slot states saved at block boundaries (the hit resumes there) and without them
//! (the hit replays the tokens that rebuild the sliding-window state, L·(W−1) rounded up);
//! and the cache's bytes by `--kv-cache-dtype` (f32, bf16, the seed's FP8 and FP4 layouts).
//!
//! `cargo bench --bench swa_resume_ttft`; environment: `SWA_DEVICE` (`cpu`, `cuda`),
//! `SWA_LAYERS` (6: one sliding layer, then CSA and HCA alternating), `SWA_WINDOW` (64),
//! `SWA_TOKENS` (2048), `SWA_REPS` (3). A random-weight checkpoint of the CPU benchmark's
//! shape (`scripts/bench_dsv4_cpu.py`) at that depth and window. Every hit's first token
//! must be the cold run's.

use std::time::Instant;

use serde_json::json;
use troupe::engine::{Device, Engine, EngineConfig, EngineHandle, EngineRequest};
use troupe::kernels::KvDtype;
use troupe::model::deepseek_v4::cache::{CacheFormats, DsV4Cache};
use troupe::model::deepseek_v4::config::DsV4Config;
use troupe::model::deepseek_v4::saved_state::SavedStates;
use troupe::sampling::{SamplingParams, splitmix64};

fn env(name: &str, default: &str) -> usize {
    std::env::var(name)
        .unwrap_or_else(|_| default.to_string())
        .parse()
        .unwrap_or_else(|_| panic!("{name} is a count"))
}

const VOCAB: u64 = 4096;

fn config(layers: usize, window: usize) -> serde_json::Value {
    let kinds: Vec<&str> = (0..layers)
        .map(|i| match i {
            0 => "sliding_attention",
            i if i % 2 == 1 => "compressed_sparse_attention",
            _ => "heavily_compressed_attention",
        })
        .collect();
    let mlps: Vec<&str> = (0..layers)
        .map(|i| if i == 0 { "hash_moe" } else { "moe" })
        .collect();
    json!({
        "model_type": "deepseek_v4",
        "architectures": ["DeepseekV4ForCausalLM"],
        "vocab_size": VOCAB, "hidden_size": 512, "moe_intermediate_size": 256,
        "num_hidden_layers": layers, "num_attention_heads": 8, "head_dim": 64,
        "q_lora_rank": 256, "num_experts_per_tok": 2, "n_routed_experts": 16,
        "layer_types": kinds, "mlp_layer_types": mlps,
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 32},
        "hc_mult": 4, "sliding_window": window, "o_groups": 2, "o_lora_rank": 128,
        "index_n_heads": 8, "index_head_dim": 64, "index_topk": 32,
        "partial_rotary_factor": 0.25, "initializer_range": 0.05,
        "max_position_embeddings": 65536, "bos_token_id": 0, "eos_token_id": 1,
    })
}

fn prompt(seed: u64, len: usize) -> Vec<u32> {
    (0..len as u64)
        .map(|i| 2 + (splitmix64(seed ^ splitmix64(i)) % (VOCAB - 2)) as u32)
        .collect()
}

/// Seconds from submission to the first token, and the token.
async fn ttft(engine: &EngineHandle, prompt: &[u32]) -> (f64, u32) {
    let started = Instant::now();
    let request = EngineRequest::new(prompt.to_vec(), 1, SamplingParams::default());
    let out = engine
        .generate(request)
        .await
        .expect("accepted")
        .collect()
        .await;
    assert!(out.error.is_none(), "{:?}", out.error);
    (started.elapsed().as_secs_f64(), out.token_ids[0])
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// The cache's bytes by `--kv-cache-dtype`, as our layouts store it: per source token of
/// the paged entries, and per sequence of its state slot (the ring, packed, and the
/// compressors' open windows, f32).
fn layout_bytes(cfg: &DsV4Config, block_size: usize) -> Vec<(&'static str, f64, usize)> {
    [KvDtype::Auto, KvDtype::Bf16, KvDtype::Fp8, KvDtype::Fp4]
        .into_iter()
        .map(|dtype| {
            let formats = CacheFormats::for_dtype(dtype);
            let block = DsV4Cache::bytes_per_block_in(cfg, block_size, formats);
            let ring = DsV4Cache::bytes_per_slot_in(cfg, formats);
            (dtype.name(), block as f64 / block_size as f64, ring)
        })
        .collect()
}

/// One layer of `kind` beside a sliding one, at V4-Flash's dims (head 512, index head
/// 128, window 128, rates 4 and 128); the rows print what the layer adds (its slot bytes
/// less the sliding layer's ring).
fn flash_layer(dir: &std::path::Path, kind: &str) -> DsV4Config {
    let mut json = config(2, 128);
    json["layer_types"] = json!(["sliding_attention", kind]);
    json["head_dim"] = json!(512);
    json["index_head_dim"] = json!(128);
    json["compress_rates"] =
        json!({"compressed_sparse_attention": 4, "heavily_compressed_attention": 128});
    std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
    DsV4Config::from_dir(dir).expect("the config parses")
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let (layers, window) = (env("SWA_LAYERS", "6"), env("SWA_WINDOW", "64"));
    let (tokens, reps) = (env("SWA_TOKENS", "2048"), env("SWA_REPS", "3"));
    let device = match std::env::var("SWA_DEVICE").as_deref() {
        Ok("cuda") => Device::Cuda(0),
        _ => Device::Cpu,
    };
    let dir = std::env::temp_dir().join(format!("troupe-swa-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg_json = config(layers, window);
    std::fs::write(dir.join("config.json"), cfg_json.to_string()).unwrap();
    let ds = DsV4Config::from_dir(&dir).expect("the config parses");
    let replay = ds.num_replay_tokens();
    println!(
        "DeepSeek-V4 shape: {layers} layers, window {window}, {tokens}-token prompt; \
         bounded replay {replay} tokens; a saved state {} KiB, a slot {} KiB",
        SavedStates::bytes_per_state(&ds) >> 10,
        DsV4Cache::bytes_per_slot(&ds) >> 10
    );
    let mut rows = Vec::new();
    for (name, saved) in [("saved states", None), ("replay only", Some(0))] {
        let mut cfg = EngineConfig::new(dir.clone());
        cfg.dummy_weights = true;
        cfg.device = device;
        cfg.max_num_seqs = 4;
        cfg.kv_cache_bytes = 2 << 30;
        cfg.swa_saved_states = saved;
        let engine = Engine::spawn(cfg).await.expect("the engine starts");
        let (mut cold, mut hit) = (Vec::new(), Vec::new());
        for rep in 0..reps {
            let p = prompt(rep as u64, tokens);
            let (secs, first) = ttft(&engine, &p).await;
            cold.push(secs);
            let (secs, again) = ttft(&engine, &p).await;
            assert_eq!(
                again, first,
                "{name}: a hit's first token differs from the cold run's"
            );
            hit.push(secs);
        }
        let s = engine.status().await.unwrap();
        engine.shutdown(true).await;
        rows.push((
            name,
            median(cold),
            median(hit),
            s.num_resumed_hits,
            s.num_replayed_hits,
        ));
    }
    println!("| run | cold TTFT ms | hit TTFT ms | hit / cold | resumed | replayed |");
    println!("|---|---|---|---|---|---|");
    for (name, cold, hit, resumed, replayed) in &rows {
        println!(
            "| {name} | {:.1} | {:.1} | {:.3} | {resumed} | {replayed} |",
            cold * 1e3,
            hit * 1e3,
            hit / cold
        );
    }
    println!("| layout | paged bytes a source token | state slot bytes a sequence |");
    println!("|---|---|---|");
    for (name, per_token, ring) in layout_bytes(&ds, 128) {
        println!("| this shape, {name} | {per_token:.1} | {ring} |");
    }
    for kind in [
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ] {
        let layer = flash_layer(&dir, kind);
        let sliding = flash_layer(&dir, "sliding_attention");
        for ((name, per_token, ring), (_, _, ring_alone)) in layout_bytes(&layer, 128)
            .into_iter()
            .zip(layout_bytes(&sliding, 128))
        {
            println!(
                "| V4-Flash dims, a {kind} layer, {name} | {per_token:.1} | {} |",
                ring - ring_alone / 2
            );
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}
