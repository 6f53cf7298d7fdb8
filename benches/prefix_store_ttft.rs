//! Time to first token of a long prompt by where its prefix lies: computed (cold), on the
//! device (a prefix-cache hit), in host memory (evicted from the device by another prompt,
//! back from `--kv-host-cache-bytes`), on disk (a second engine on the same
//! `--kv-store-dir`; the file system's page cache is warm).
//!
//! `cargo bench --bench prefix_store_ttft`; environment: `TTFT_MODEL` (default: the
//! default model), `TTFT_DEVICE` (`cpu`, `cuda`), `TTFT_TOKENS` (4096), `TTFT_KV_MIB` (the
//! device pool: about 1.3 prompts, so the next prompt evicts the last), `TTFT_REPS` (3),
//! `TTFT_DIR` (the store; default under the system's temporary directory), `TTFT_DUMMY=1`
//! (`--dummy-weights`: a config's shape alone), `TTFT_KV_DTYPE` (`auto`, `bf16`, `fp8`).
//! Every hit's first token must be the cold run's.

use std::time::Instant;

use troupe::engine::{Device, Engine, EngineConfig, EngineHandle, EngineRequest};
use troupe::kernels::KvDtype;
use troupe::model;
use troupe::sampling::{SamplingParams, splitmix64};
use troupe::store::KvStoreConfig;

fn env(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_string())
}

fn prompt(seed: u64, len: usize) -> Vec<u32> {
    (0..len as u64)
        .map(|i| 100 + (splitmix64(seed ^ splitmix64(i)) % 30_000) as u32)
        .collect()
}

/// Seconds from submission to the first token, and the token.
async fn ttft(engine: &EngineHandle, prompt: &[u32]) -> (f64, u32) {
    let started = Instant::now();
    let request = EngineRequest::new(prompt.to_vec(), 1, SamplingParams::default());
    let mut stream = engine.generate(request).await.expect("accepted");
    let first = stream.next().await.expect("a token");
    assert!(first.error.is_none(), "{:?}", first.error);
    let secs = started.elapsed().as_secs_f64();
    while stream.next().await.is_some() {}
    settle(engine).await;
    (secs, first.token_ids[0])
}

/// Waits until the blocks the last request registered are copied out and on disk, so the
/// next request's TTFT is its own (the copy's cost is reported apart): a short request
/// queued behind the copy on the rank, then the disk writer drained.
async fn settle(engine: &EngineHandle) {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let request = EngineRequest::new(prompt(1 << 40 | n, 2), 1, SamplingParams::default());
    let stream = engine.generate(request).await.expect("accepted");
    stream.collect().await;
    for _ in 0..6000 {
        if engine.status().await.unwrap().kv_store.pending_writes == 0 {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let model_path = model::resolve_model_path(&env("TTFT_MODEL", model::hub::DEFAULT_MODEL))
        .expect("the model resolves");
    let device = match env("TTFT_DEVICE", "cpu").as_str() {
        "cuda" => Device::Cuda(0),
        _ => Device::Cpu,
    };
    let tokens: usize = env("TTFT_TOKENS", "4096").parse().expect("TTFT_TOKENS");
    let dummy = env("TTFT_DUMMY", "0") == "1";
    let kv_dtype = match env("TTFT_KV_DTYPE", "auto").as_str() {
        "fp8" => KvDtype::Fp8,
        "bf16" => KvDtype::Bf16,
        _ => KvDtype::Auto,
    };
    let reps: u64 = env("TTFT_REPS", "3").parse().expect("TTFT_REPS");
    let kv_mib: usize = env("TTFT_KV_MIB", "256").parse().expect("TTFT_KV_MIB");
    let dir = std::env::var("TTFT_DIR").map_or_else(
        |_| std::env::temp_dir().join(format!("troupe-ttft-{}", std::process::id())),
        Into::into,
    );
    let _ = std::fs::remove_dir_all(&dir);
    let config = |host_bytes: usize| {
        let mut cfg = EngineConfig::new(&model_path);
        cfg.device = device;
        cfg.kv_cache_bytes = kv_mib << 20;
        cfg.dummy_weights = dummy;
        cfg.kv_cache_dtype = kv_dtype;
        cfg.kv_store = KvStoreConfig {
            host_bytes,
            dir: Some(dir.clone()),
            disk_bytes: 64 << 30,
            ttl: None,
        };
        cfg
    };
    let (mut cold, mut device_hit, mut host_hit, mut disk_hit) = (vec![], vec![], vec![], vec![]);
    let mut firsts = Vec::new();
    // The same prompts on an engine without a store: what the store costs a cold prompt.
    let mut no_store = Vec::new();
    {
        let mut cfg = config(0);
        cfg.kv_store = KvStoreConfig::default();
        let engine = Engine::spawn(cfg).await.expect("engine starts");
        ttft(&engine, &prompt(999, 64)).await;
        for rep in 0..reps {
            no_store.push(ttft(&engine, &prompt(rep, tokens)).await.0);
        }
        engine.shutdown(true).await;
    }
    let engine = Engine::spawn(config(8 << 30)).await.expect("engine starts");
    ttft(&engine, &prompt(999, 64)).await;
    for rep in 0..reps {
        let p = prompt(rep, tokens);
        let (secs, token) = ttft(&engine, &p).await;
        cold.push(secs);
        firsts.push(token);
        let hit = ttft(&engine, &p).await;
        assert_eq!(hit.1, token, "a device hit's first token");
        device_hit.push(hit.0);
        let before = engine.status().await.unwrap().kv_store.host_hit_blocks;
        ttft(&engine, &prompt(1000 + rep, tokens)).await;
        let hit = ttft(&engine, &p).await;
        assert_eq!(hit.1, token, "a host hit's first token");
        host_hit.push(hit.0);
        let hits = engine.status().await.unwrap().kv_store.host_hit_blocks - before;
        assert!(
            hits > 0,
            "no host hit: is the pool too large to evict? (TTFT_KV_MIB)"
        );
    }
    let status = engine.status().await.unwrap();
    engine.shutdown(true).await;
    // A second engine, nothing on its device or in its host memory.
    let engine = Engine::spawn(config(0)).await.expect("engine starts");
    ttft(&engine, &prompt(999, 64)).await;
    for rep in 0..reps {
        let hit = ttft(&engine, &prompt(rep, tokens)).await;
        assert_eq!(hit.1, firsts[rep as usize], "a disk hit's first token");
        disk_hit.push(hit.0);
    }
    let disk = engine.status().await.unwrap().kv_store;
    let blocks_per_prompt = (tokens - 1) / 16;
    assert!(disk.disk_hit_blocks > 0, "no disk hit");
    engine.shutdown(true).await;
    let _ = std::fs::remove_dir_all(&dir);
    let cold = median(cold);
    println!(
        "prefix store TTFT, {tokens}-token prompt, {} KV, {} ({reps} reps, medians); host tier {} blocks, disk {} blocks ({} MB read)",
        kv_dtype.name(),
        status.weight_card,
        status.kv_store.host_hit_blocks,
        disk.disk_hit_blocks,
        disk.bytes_read >> 20
    );
    println!(
        "copied out of the cache for the store: {:.2} ms a block; into it on hits: {:.2} ms a block",
        1e3 * status.kv_store.copy_out_secs / (2 * reps as usize * blocks_per_prompt) as f64,
        1e3 * (status.kv_store.copy_in_secs + disk.copy_in_secs)
            / (status.kv_store.host_hit_blocks + disk.disk_hit_blocks).max(1) as f64,
    );
    println!("| where the prefix lies | TTFT ms | of cold |");
    println!("|---|---:|---:|");
    for (name, secs) in [
        ("cold, no store", median(no_store)),
        ("cold (computed)", cold),
        ("device (prefix cache)", median(device_hit)),
        ("host memory", median(host_hit)),
        ("disk", median(disk_hit)),
    ] {
        println!("| {name} | {:.1} | {:.3} |", secs * 1e3, secs / cold);
    }
}
