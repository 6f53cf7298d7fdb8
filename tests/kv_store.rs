//! The prefix store below the device (`--kv-host-cache-bytes`, `--kv-store-dir`): blocks
//! evicted from the device come back from host memory, a restarted engine — killed with
//! SIGKILL mid-run — finds its prompts on disk, two engines share one directory, and a
//! torn or bit-flipped file is a miss; outputs always equal a cold run's.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::engine::{assert_finished_unchanged, ok_outputs, reference_outputs, tiny_config};
use troupe::engine::{Engine, EngineConfig, EngineHandle, EngineRequest, EngineStatus};
use troupe::sampling::{SamplingParams, splitmix64};
use troupe::sched::{ROOT_HASH, block_hash};
use troupe::store::KvStoreConfig;

const BOUND: Duration = Duration::from_secs(240);

/// A fresh directory under the system's temporary one.
fn store_dir(tag: &str) -> PathBuf {
    common::scratch_path(&format!("kv-store-{tag}"))
}

/// Block files under `dir`, recursively.
fn block_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(block_files(&path));
        } else if path.extension().is_some_and(|e| e == "kv") {
            out.push(path);
        }
    }
    out.sort();
    out
}

/// `n` greedy requests over `groups` shared prefixes of generated lengths (40..100
/// tokens), each with its own tail and length, from `seed`.
fn shared_prefix_requests(n: usize, groups: usize, vocab: u32, seed: u64) -> Vec<EngineRequest> {
    let h = |k: u64| splitmix64(seed ^ splitmix64(k));
    let token = |k: u64| 3 + (h(k) % (vocab as u64 - 3)) as u32;
    (0..n)
        .map(|i| {
            let g = (i % groups) as u64;
            let prefix_len = 40 + h(1000 + g) % 61;
            let tail_len = 1 + h(2000 + i as u64) % 9;
            let mut prompt: Vec<u32> = (0..prefix_len)
                .map(|j| token(10_000 * (g + 1) + j))
                .collect();
            prompt.extend((0..tail_len).map(|j| token(7_000_000 + 100 * i as u64 + j)));
            let max_tokens = 4 + (h(3000 + i as u64) % 9) as usize;
            let mut r = EngineRequest::new(prompt, max_tokens, SamplingParams::default());
            r.ignore_eos = true;
            r
        })
        .collect()
}

fn with_store(mut cfg: EngineConfig, store: KvStoreConfig) -> EngineConfig {
    cfg.kv_store = store;
    cfg
}

/// A DeepSeek-V4 differential case on the CPU with `store`: its engine config, prompt and
/// transformers' greedy tokens.
fn dsv4_case(case_dir: &str, store: KvStoreConfig) -> (EngineConfig, Vec<u32>, Vec<u32>) {
    let case = common::read_json(&format!("{case_dir}/case.json"));
    let mut cfg = EngineConfig::new(common::goldens().join(case_dir));
    cfg.device = troupe::engine::Device::Cpu;
    cfg.kv_cache_bytes = 16 << 20;
    cfg.max_num_seqs = 2;
    let (prompt, greedy) = (
        common::ids(&case["prompt"]),
        common::ids(&case["greedy_tokens"]),
    );
    (with_store(cfg, store), prompt, greedy)
}

/// The engine's status once every queued disk write is done (bounded).
async fn settled(engine: &EngineHandle) -> EngineStatus {
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let status = engine.status().await.unwrap();
        if status.kv_store.pending_writes == 0 || Instant::now() > until {
            assert_eq!(status.kv_store.pending_writes, 0, "disk writes hang");
            return status;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_evicted_from_the_device_come_back_from_host_memory() {
    tokio::time::timeout(BOUND, async {
        let requests = shared_prefix_requests(12, 6, 256, 17);
        let want = reference_outputs("tiny-llama", &requests);
        let mut cfg = with_store(
            tiny_config("tiny-llama"),
            KvStoreConfig {
                host_bytes: 64 << 20,
                ..Default::default()
            },
        );
        // 24 blocks of 16 tokens: three requests' worth, so later groups evict earlier ones.
        cfg.kv_cache_bytes = 24 * 8192;
        let engine = Engine::spawn(cfg).await.unwrap();
        // One at a time: each group's prefix is evicted from the device before it recurs.
        let mut got = Vec::new();
        for r in &requests {
            got.extend(ok_outputs(&engine, vec![r.clone()]).await);
        }
        let status = assert_finished_unchanged(&engine, &got, &want).await;
        eprintln!(
            "host tier: {} blocks from host memory, {} from the device, {} host evictions",
            status.kv_store.host_hit_blocks,
            status.num_prefix_hit_blocks,
            status.kv_store.host_evictions
        );
        assert!(status.kv_store.host_hit_blocks > 0, "{:?}", status.kv_store);
        assert_eq!(
            status.num_stored_hit_blocks,
            status.kv_store.host_hit_blocks
        );
        assert_eq!(status.kv_store.disk_hit_blocks, 0);
        engine.shutdown(true).await;
    })
    .await
    .expect("bounded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_engines_share_one_directory() {
    tokio::time::timeout(BOUND, async {
        let dir = store_dir("shared");
        let store = KvStoreConfig {
            dir: Some(dir.clone()),
            disk_bytes: 1 << 30,
            ..Default::default()
        };
        let requests = shared_prefix_requests(8, 4, 256, 29);
        let want = reference_outputs("tiny-qwen2", &requests);
        let a = Engine::spawn(with_store(tiny_config("tiny-qwen2"), store.clone()))
            .await
            .unwrap();
        let b = Engine::spawn(with_store(tiny_config("tiny-qwen2"), store))
            .await
            .unwrap();
        let first = ok_outputs(&a, requests[..4].to_vec()).await;
        let written = settled(&a).await.kv_store;
        assert!(written.bytes_written > 0 && !block_files(&dir).is_empty());
        // B never computed these prefixes: the first four groups come from A's files.
        let second = ok_outputs(&b, requests[4..].to_vec()).await;
        let got: Vec<_> = first.into_iter().chain(second).collect();
        let status = assert_finished_unchanged(&b, &got[4..], &want[4..]).await;
        assert_eq!(common::engine::tokens(&got[..4]), want[..4]);
        eprintln!(
            "shared directory: engine B read {} blocks ({} bytes) engine A wrote ({} bytes)",
            status.kv_store.disk_hit_blocks, status.kv_store.bytes_read, written.bytes_written
        );
        assert!(
            status.kv_store.disk_hit_blocks >= 4 * 2,
            "{:?}",
            status.kv_store
        );
        assert_eq!(
            status.num_stored_hit_blocks,
            status.kv_store.disk_hit_blocks
        );
        a.shutdown(true).await;
        b.shutdown(true).await;
        let _ = std::fs::remove_dir_all(&dir);
    })
    .await
    .expect("bounded");
}

/// DeepSeek-V4 (a differential case, f32 layout): a prompt's compressed blocks written by
/// one engine come back from disk in another, which rebuilds the window state by the
/// bounded replay over them and gives transformers' greedy tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deepseek_v4_blocks_come_back_from_disk_in_another_engine() {
    tokio::time::timeout(BOUND, async {
        let dir = store_dir("dsv4");
        let store = KvStoreConfig {
            dir: Some(dir.clone()),
            disk_bytes: 1 << 30,
            ..Default::default()
        };
        let (cfg, prompt, greedy) = dsv4_case("dsv4-diff/case-1005", store);
        let request = || {
            let mut r = EngineRequest::new(prompt.clone(), greedy.len(), SamplingParams::default());
            r.ignore_eos = true;
            vec![r]
        };
        let a = Engine::spawn(cfg.clone()).await.unwrap();
        let first = ok_outputs(&a, request()).await;
        let written = settled(&a).await.kv_store;
        a.shutdown(true).await;
        let b = Engine::spawn(cfg).await.unwrap();
        let second = ok_outputs(&b, request()).await;
        let status = b.status().await.unwrap();
        b.shutdown(true).await;
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(first[0].token_ids, greedy, "the cold run");
        assert_eq!(second[0].token_ids, greedy, "the run from the store");
        eprintln!(
            "DeepSeek-V4 store: {} bytes written, {} blocks read back from disk, {} hits replayed",
            written.bytes_written, status.kv_store.disk_hit_blocks, status.num_replayed_hits
        );
        assert!(
            status.kv_store.disk_hit_blocks >= 4,
            "{:?}",
            status.kv_store
        );
        assert_eq!(status.num_replayed_hits, 1);
    })
    .await
    .expect("bounded");
}

/// DeepSeek-V4, every differential case (generated configs and prompt lengths): what a
/// prefill engine hands a decode engine — the prompt's blocks and the state a cold run
/// has at the last one's end — lets the decode engine continue with no replay, to
/// transformers' greedy tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deepseek_v4_prompt_handed_over_with_its_state_continues_with_no_replay() {
    use troupe::cluster::kv_transfer::{Prefix, encode_chunks, put_blocks};
    tokio::time::timeout(BOUND, async {
        let mut num_cases = 0;
        let mut cases: Vec<String> = std::fs::read_dir(common::goldens().join("dsv4-diff"))
            .unwrap()
            .map(|e| format!("dsv4-diff/{}", e.unwrap().file_name().to_string_lossy()))
            .collect();
        cases.sort();
        for case_dir in &cases {
            let store = KvStoreConfig {
                host_bytes: 64 << 20,
                ..Default::default()
            };
            let (cfg, prompt, greedy) = dsv4_case(case_dir, store);
            let request = |max_tokens: usize| {
                let mut r =
                    EngineRequest::new(prompt.clone(), max_tokens, SamplingParams::default());
                r.ignore_eos = true;
                vec![r]
            };
            let prefill = Engine::spawn(cfg.clone()).await.unwrap();
            let store = prefill.kv_store().expect("a store");
            let (num_blocks, namespace) =
                (store.num_blocks_of(&prompt), store.namespace().to_string());
            if num_blocks == 0 {
                prefill.shutdown(true).await;
                continue;
            }
            num_cases += 1;
            let first = ok_outputs(&prefill, request(1)).await;
            assert_eq!(first[0].token_ids, greedy[..1], "{case_dir}: the prefill");
            prefill.flush_kv_saves().await.unwrap();
            let prefix = Prefix::export(prefill.kv_store().unwrap(), &prompt);
            prefill.shutdown(true).await;
            assert_eq!(prefix.blocks.len(), num_blocks, "{case_dir}");
            assert_eq!(prefix.states.len(), 1, "{case_dir}: the last block's state");

            let decode = Engine::spawn(cfg).await.unwrap();
            for chunk in encode_chunks(&namespace, &prefix) {
                put_blocks(decode.kv_store().unwrap(), &chunk).unwrap();
            }
            let out = ok_outputs(&decode, request(greedy.len())).await;
            let status = decode.status().await.unwrap();
            decode.shutdown(true).await;
            assert_eq!(out[0].token_ids, greedy, "{case_dir}: the decode engine");
            assert_eq!(
                status.kv_store.host_hit_blocks as usize,
                prefix.blocks.len(),
                "{case_dir}"
            );
            let hits = (status.num_resumed_hits, status.num_replayed_hits);
            assert_eq!(hits, (1, 0), "{case_dir}: (resumed, replayed)");
        }
        assert!(num_cases >= 5, "{num_cases} cases with a full block");
    })
    .await
    .expect("bounded");
}

/// `troupe generate` on the default model with `args` and `--stats` to `stats`: its
/// tokens and its stats.
fn generate(
    model: &Path,
    prompt: &str,
    stats: &Path,
    args: &[&str],
) -> (Vec<u32>, serde_json::Value) {
    let out = Command::new(env!("CARGO_BIN_EXE_troupe"))
        .args(["generate", "--model"])
        .arg(model)
        .args([
            "--prompt-ids",
            prompt,
            "--max-tokens",
            "12",
            "--json",
            "--stats",
        ])
        .arg(stats)
        .args(args)
        .output()
        .expect("the troupe binary runs");
    let tokens = common::cli::token_ids(&out);
    let stats = serde_json::from_str(&std::fs::read_to_string(stats).unwrap()).unwrap();
    (tokens, stats)
}

#[test]
fn an_engine_killed_mid_run_restarts_on_its_store_and_a_bad_file_is_a_miss() {
    let model = common::smollm2_path();
    let dir = store_dir("kill");
    let stats = dir.with_extension("stats.json");
    // A prompt of generated ids; its last token is never matched: 599 / 16 full blocks.
    let prompt_ids: Vec<u32> = (0..599u64)
        .map(|i| (100 + splitmix64(41 ^ splitmix64(i)) % 40_000) as u32)
        .collect();
    let prompt: Vec<String> = prompt_ids.iter().map(u32::to_string).collect();
    let prompt = prompt.join(",") + ",42";
    let num_blocks = 599 / 16;
    let dir_arg = dir.to_str().unwrap();
    let store = ["--kv-store-dir", dir_arg];
    let (cold, _) = generate(&model, &prompt, &stats, &[]);

    // A long generation of the same prompt, killed once the prompt's blocks are on disk.
    let mut child = Command::new(env!("CARGO_BIN_EXE_troupe"))
        .args(["generate", "--model"])
        .arg(&model)
        .args([
            "--prompt-ids",
            &prompt,
            "--max-tokens",
            "4000",
            "--ignore-eos",
        ])
        .args(store)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("the troupe binary runs");
    let until = Instant::now() + Duration::from_secs(180);
    while block_files(&dir).len() < num_blocks {
        assert!(
            Instant::now() < until,
            "the prompt's blocks never reached the disk"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "it ended before it was killed"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap(); // SIGKILL
    let status = child.wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(9), "{status:?}");

    let (warm, s) = generate(&model, &prompt, &stats, &store);
    assert_eq!(warm, cold, "tokens after a disk hit");
    assert_eq!(s["kv_store"]["disk_hit_blocks"], num_blocks, "{s}");
    assert_eq!(s["kv_store_hit_blocks"], num_blocks, "{s}");

    // A truncated file, then a bit-flipped one: each a miss where the chain reaches it,
    // the blocks from there on recomputed (and the bad file written again).
    let chain: Vec<u64> = prompt_ids
        .chunks_exact(16)
        .scan(ROOT_HASH, |parent, block| {
            *parent = block_hash(*parent, block, 0);
            Some(*parent)
        })
        .collect();
    let namespace = block_files(&dir)[0].parent().unwrap().to_path_buf();
    let file = |block: usize| namespace.join(format!("{:016x}.kv", chain[block]));
    let first_bad = 1 + (splitmix64(5) % 17) as usize;
    let bytes = std::fs::read(file(first_bad)).unwrap();
    std::fs::write(file(first_bad), &bytes[..bytes.len() / 2]).unwrap();
    let second_bad = first_bad + 1 + (splitmix64(6) % 17) as usize;
    for (bad, flip) in [(first_bad, false), (second_bad, true)] {
        if flip {
            let mut bytes = std::fs::read(file(bad)).unwrap();
            let at = splitmix64(7) as usize % bytes.len();
            bytes[at] ^= 0x10;
            std::fs::write(file(bad), &bytes).unwrap();
        }
        let (after, s) = generate(&model, &prompt, &stats, &store);
        assert_eq!(after, cold, "tokens after a bad file at block {bad}");
        assert_eq!(s["kv_store"]["corrupt_blocks"], 1, "{s}");
        assert_eq!(s["kv_store"]["disk_hit_blocks"], bad, "{s}");
    }
    let (again, s) = generate(&model, &prompt, &stats, &store);
    assert_eq!(again, cold);
    assert_eq!(s["kv_store"]["disk_hit_blocks"], num_blocks, "{s}");
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_file(&stats);
}

#[test]
fn what_cannot_use_the_store_is_refused_by_name() {
    use common::cli::{assert_clear_error, tiny, troupe};
    let dir = store_dir("refused");
    let dir = dir.to_str().unwrap();
    let llama = tiny("tiny-llama");
    let run = |model: &str, extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--model",
            model,
            "--prompt-ids",
            "5,6,7",
            "--max-tokens",
            "2",
        ];
        args.extend_from_slice(extra);
        troupe(&args)
    };
    for (model, extra, needle) in [
        (
            llama.clone(),
            vec!["--kv-store-dir", dir, "--no-prefix-cache"],
            "prefix cache is off",
        ),
        (
            llama.clone(),
            vec!["--kv-host-cache-bytes", "1G", "--tensor-parallel-size", "2"],
            "one rank",
        ),
        (
            llama.clone(),
            vec!["--kv-store-ttl", "1h"],
            "--kv-store-dir",
        ),
        (
            llama.clone(),
            vec!["--kv-store-bytes", "4G"],
            "--kv-store-bytes is for the disk store: give --kv-store-dir",
        ),
        (
            llama.clone(),
            vec!["--kv-store-dir", dir, "--kv-store-bytes", "lots"],
            "lots",
        ),
        (
            llama.clone(),
            vec!["--kv-store-dir", dir, "--kv-store-ttl", "0"],
            "positive duration",
        ),
    ] {
        assert_clear_error(&run(&model, &extra), needle);
    }
}
