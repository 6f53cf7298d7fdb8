//! DeepSeek-V4 with routed experts in host memory (`--cpu-moe`, `--n-cpu-moe`, a split
//! layer): the random differential checkpoints (`scripts/dsv4_differential.py`) under
//! generated placements give the all-on-device run's logits bit for bit (their experts are
//! f32, which the host computes as the device does) and transformers' tokens; the packed
//! checkpoint (MXFP4 experts, computed packed against 8-bit activations on the host) stays
//! near transformers; the engine runs them; impossible placements are refused by name.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::engine::{ok_outputs, tokens};
use troupe::engine::{Engine, EngineConfig, EngineRequest};
use troupe::kernels::cpu::CpuBackend;
use troupe::model::deepseek_v4::cache::{DsV4Cache, SlotSpan, lcm_rates};
use troupe::model::deepseek_v4::config::DsV4Config;
use troupe::model::deepseek_v4::expert_placement::{CpuMoe, ExpertPlacement};
use troupe::model::deepseek_v4::{DsSeqStep, DsV4Model};
use troupe::sampling::{SamplingParams, splitmix64};

fn case_dirs() -> Vec<PathBuf> {
    let root = std::env::var_os("TROUPE_DSV4_CASES")
        .map(PathBuf::from)
        .unwrap_or_else(|| common::goldens().join("dsv4-diff"));
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("case.json").exists())
        .collect();
    dirs.sort();
    assert!(!dirs.is_empty(), "no cases under {}", root.display());
    dirs
}

/// Every expert on the host, the first layers' (`--n-cpu-moe`), and a generated count per
/// layer (split layers included).
fn placements(cfg: &DsV4Config, seed: u64) -> Vec<(String, ExpertPlacement)> {
    let (l, e) = (cfg.num_layers, cfg.num_routed_experts);
    let first = (splitmix64(seed) as usize) % l + 1;
    let per_layer: Vec<usize> = (0..l)
        .map(|i| (splitmix64(seed ^ ((i as u64 + 1) * 0x9e37)) as usize) % (e + 1))
        .collect();
    let mut out = vec![
        ("--cpu-moe".to_string(), first_layers(l, e, l)),
        (format!("--n-cpu-moe {first}"), first_layers(l, e, first)),
    ];
    out.push((
        format!("host experts per layer {per_layer:?}"),
        ExpertPlacement {
            host_experts: per_layer,
            num_experts: e,
        },
    ));
    out
}

fn first_layers(l: usize, e: usize, n: usize) -> ExpertPlacement {
    ExpertPlacement {
        host_experts: (0..l).map(|i| if i < n { e } else { 0 }).collect(),
        num_experts: e,
    }
}

/// `dir`'s model with `placement`'s experts in host memory (none held on the device).
fn with_host_experts(dir: &Path, placement: ExpertPlacement) -> DsV4Model {
    let holds = |l: usize, e: usize| !placement.on_host(l, e);
    let mut model = DsV4Model::load_dir_holding(CpuBackend::default(), dir, false, &holds)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    model
        .keep_experts_on_host(dir, false, placement, false)
        .unwrap();
    model
}

/// Every position's logits of `tokens`, fed in chunks of `chunk`.
fn logits(model: &DsV4Model, tokens: &[u32], chunk: usize) -> Vec<f32> {
    let block_size = 2 * lcm_rates(&model.cfg);
    let num_blocks = tokens.len().div_ceil(block_size) + 1;
    let table: Vec<u32> = (0..num_blocks as u32).rev().collect();
    let mut cache = DsV4Cache::on(&model.backend, &model.cfg, 1, num_blocks, block_size);
    let mut out = Vec::new();
    for start in (0..tokens.len()).step_by(chunk) {
        let n = chunk.min(tokens.len() - start);
        let step = DsSeqStep {
            token_ids: &tokens[start..start + n],
            num_cached_tokens: start,
            block_table: &table,
            state_slot: 0,
            span: SlotSpan::default(),
            num_logit_rows: n,
        };
        out.extend(model.forward(&mut cache, &[step]).unwrap());
    }
    out
}

fn argmax_rows(logits: &[f32], vocab: usize) -> Vec<u32> {
    logits
        .chunks(vocab)
        .map(|r| (0..vocab).max_by(|&a, &b| r[a].total_cmp(&r[b])).unwrap() as u32)
        .collect()
}

fn case(dir: &Path) -> (Vec<u32>, Vec<u32>) {
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("case.json")).unwrap()).unwrap();
    (
        common::ids(&json["prompt"]),
        common::ids(&json["greedy_tokens"]),
    )
}

#[test]
fn host_experts_give_the_all_device_logits_bit_for_bit_and_transformers_tokens() {
    let mut host_layers = 0;
    for (i, dir) in case_dirs().iter().enumerate() {
        let (prompt, greedy) = case(dir);
        let mut seq = prompt.clone();
        seq.extend_from_slice(&greedy[..greedy.len() - 1]);
        let device = DsV4Model::load_dir(dir).unwrap();
        let vocab = device.vocab_size();
        let want: Vec<Vec<f32>> = [seq.len(), 7].map(|c| logits(&device, &seq, c)).into();
        for (what, placement) in placements(&device.cfg, i as u64 + 17) {
            host_layers += placement.host_layers().count();
            let model = with_host_experts(dir, placement);
            for (chunk, want) in [seq.len(), 7].into_iter().zip(&want) {
                let got = logits(&model, &seq, chunk);
                assert!(
                    got.iter()
                        .zip(want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{} {what}, chunks of {chunk}: logits differ from the all-device run",
                    dir.display()
                );
            }
            // transformers' greedy tokens: the argmax after each of them.
            let got = argmax_rows(&logits(&model, &seq, seq.len()), vocab);
            assert_eq!(
                &got[prompt.len() - 1..],
                &greedy[..],
                "{} {what}: greedy tokens",
                dir.display()
            );
        }
    }
    assert!(host_layers > 0, "no placement put a layer on the host");
}

#[test]
fn packed_mxfp4_experts_on_the_host_stay_near_transformers() {
    let name = "tiny-dsv4-packed";
    let r = common::dsv4::reference(name);
    let dir = common::dsv4::dir(name);
    let device = DsV4Model::load_dir(&dir).unwrap();
    let cfg = device.cfg.clone();
    let model = with_host_experts(
        &dir,
        first_layers(cfg.num_layers, cfg.num_routed_experts, cfg.num_layers),
    );
    let card = model.footprint().card();
    assert!(
        card.contains("routed_experts_host") && card.contains("MXFP4"),
        "{card}"
    );
    assert!(model.footprint().host_resident_bytes > 0);
    // 8-bit activations (a scale per 4 values) against transformers' f32 pass: about
    // 0.5 % a position until a router or the indexer picks differently.
    for (prompt, want) in r.prompts.iter().zip(&r.logits) {
        for chunk in [prompt.len(), 7] {
            let got = logits(&model, prompt, chunk);
            let what = format!("host MXFP4 experts, chunks of {chunk}");
            common::dsv4::assert_tracks(name, &what, &got, want, r.vocab_size);
        }
    }
}

fn engine_cfg(dir: &Path, cpu_moe: CpuMoe) -> EngineConfig {
    let cfg = DsV4Config::from_dir(dir).unwrap();
    let block_size = lcm_rates(&cfg);
    let mut e = EngineConfig::new(dir.to_path_buf());
    e.block_size = block_size;
    e.max_num_seqs = 3;
    e.max_step_tokens = 7;
    e.kv_cache_bytes =
        3 * DsV4Cache::bytes_per_slot(&cfg) + 64 * DsV4Cache::bytes_per_block(&cfg, block_size);
    e.cpu_moe = cpu_moe;
    e
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_runs_host_experts_and_reports_their_bytes() {
    for (dir, cpu_moe) in case_dirs()
        .iter()
        .take(2)
        .flat_map(|d| [(d, CpuMoe::All), (d, CpuMoe::FirstLayers(1))])
    {
        let (prompt, greedy) = case(dir);
        let engine = Engine::spawn(engine_cfg(dir, cpu_moe)).await.unwrap();
        let requests: Vec<EngineRequest> = (0..3)
            .map(|_| {
                let mut r =
                    EngineRequest::new(prompt.clone(), greedy.len(), SamplingParams::default());
                r.ignore_eos = true;
                r
            })
            .collect();
        let got = tokio::time::timeout(Duration::from_secs(120), ok_outputs(&engine, requests))
            .await
            .expect("the engine did not finish in 120 s");
        for g in tokens(&got) {
            assert_eq!(g, greedy, "{} {cpu_moe}", dir.display());
        }
        let status = engine.status().await.unwrap();
        assert!(
            status.resident_host_weight_bytes > 0,
            "{cpu_moe}: no host bytes reported"
        );
        assert!(
            status.weight_card.contains("routed_experts_host"),
            "{}",
            status.weight_card
        );
        engine.shutdown(true).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn impossible_placements_are_refused_by_name() {
    let dir = &case_dirs()[0];
    let layers = DsV4Config::from_dir(dir).unwrap().num_layers;
    let err = Engine::spawn(engine_cfg(dir, CpuMoe::FirstLayers(layers + 1)))
        .await
        .err()
        .expect("too many layers refused")
        .to_string();
    assert!(
        err.contains(&format!("--n-cpu-moe {}", layers + 1)) && err.contains("MoE layers"),
        "{err}"
    );
    let mut two = engine_cfg(dir, CpuMoe::All);
    two.tensor_parallel_size = 2;
    let err = Engine::spawn(two)
        .await
        .err()
        .expect("a group refused")
        .to_string();
    assert!(
        err.contains("--cpu-moe") && err.contains("not built"),
        "{err}"
    );
    let llama = common::goldens().join("tiny-llama");
    let mut cfg = EngineConfig::new(llama);
    cfg.cpu_moe = CpuMoe::All;
    let err = Engine::spawn(cfg)
        .await
        .err()
        .expect("a dense model refused")
        .to_string();
    assert!(
        err.contains("--cpu-moe") && err.contains("no routed experts"),
        "{err}"
    );
}
