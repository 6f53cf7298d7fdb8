//! DeepSeek-V4 prefix hits: time to first token of a repeated long prompt, cold and hit,
//! with slot states saved at block boundaries (the hit resumes there) and without them
//! (the hit replays the tokens that rebuild the sliding-window state, L·(W−1) rounded up);
//! and the compressed cache's bytes a source token against the seed's layouts.
//!
//! `cargo bench --bench swa_resume_ttft`; environment: `SWA_DEVICE` (`cpu`, `cuda`),
//! `SWA_LAYERS` (6: one sliding layer, then CSA and HCA alternating), `SWA_WINDOW` (64),
//! `SWA_TOKENS` (2048), `SWA_REPS` (3). A random-weight checkpoint of the CPU benchmark's
//! shape (`scripts/bench_dsv4_cpu.py`) at that depth and window. Every hit's first token
//! must be the cold run's.

use std::time::Instant;

use serde_json::json;
use troupe::engine::{Device, Engine, EngineConfig, EngineHandle, EngineRequest};
use troupe::model::deepseek_v4::cache::DsV4Cache;
use troupe::model::deepseek_v4::config::{AttentionKind, DsV4Config};
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

/// Bytes a source token of the compressed cache (entries of every compressing layer), as
/// we keep it (f32), in bf16, and in the seed's layout: main entries FP8 or FP4 with
/// their scales (528 / 288 bytes an entry of 512 dims, scaled to this head size), the
/// indexer's keys MXFP4 (half a byte a value, a byte of scale per 32).
fn kv_bytes_per_token(cfg: &DsV4Config, block_size: usize) -> [f64; 4] {
    let ours = DsV4Cache::bytes_per_block(cfg, block_size) as f64 / block_size as f64;
    let (mut fp8, mut fp4) = (0.0, 0.0);
    for layer in 0..cfg.num_layers {
        let Some(rate) = cfg.rate(layer) else {
            continue;
        };
        let main = cfg.head_dim as f64 / 512.0;
        let mut index = 0.0;
        if cfg.attention[layer] == AttentionKind::CompressedSparse {
            index = cfg.index_head_dim as f64 * (0.5 + 1.0 / 32.0);
        }
        fp8 += (528.0 * main + index) / rate as f64;
        fp4 += (288.0 * main + index) / rate as f64;
    }
    [ours, ours / 2.0, fp8, fp4]
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
    let block_size = troupe::model::deepseek_v4::cache::lcm_rates(&ds).max(16);
    let [ours, bf16, fp8, fp4] = kv_bytes_per_token(&ds, block_size);
    println!(
        "compressed cache, bytes a source token: ours (f32) {ours:.1}, bf16 {bf16:.1}, \
         seed FP8 {fp8:.1}, seed FP4 {fp4:.1}"
    );
    std::fs::remove_dir_all(&dir).ok();
}
