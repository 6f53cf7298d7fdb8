//! DeepSeek-V4 with routed experts in host memory (`--cpu-moe`, `--n-cpu-moe`, a split
//! layer): the random differential checkpoints (`scripts/dsv4_differential.py`) under
//! generated placements give the all-on-device run's logits bit for bit (their experts are
//! f32, which the host computes as the device does) and transformers' tokens; the packed
//! checkpoint (MXFP4 experts, computed packed against 8-bit activations on the host) stays
//! near transformers; the engine runs them, and restarts a rank that panics mid-run with
//! them; impossible placements are refused by name.

mod common;

use common::dsv4_host::{streaming, with_host_experts};

use std::path::Path;
use std::time::Duration;

use common::dsv4_host::{argmax_rows, case, case_dirs, first_layers, logits, placements};
use common::engine::{ok_outputs, tokens};
use troupe::engine::{Engine, EngineConfig, EngineRequest};
use troupe::kernels::cpu::CpuBackend;
use troupe::model::deepseek_v4::DsV4Model;
use troupe::model::deepseek_v4::cache::{DsV4Cache, lcm_rates};
use troupe::model::deepseek_v4::config::DsV4Config;
use troupe::model::deepseek_v4::expert_placement::{CpuMoe, ExpertPlacement};
use troupe::model::deepseek_v4::expert_streaming::StreamExperts;
use troupe::sampling::{SamplingParams, splitmix64};

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
            let model = with_host_experts(CpuBackend::default(), dir, placement, false);
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
    let all = first_layers(cfg.num_layers, cfg.num_routed_experts, cfg.num_layers);
    let model = with_host_experts(CpuBackend::default(), &dir, all, false);
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

/// Through the engine (ZOS, chunked prefill, three requests at once), plain and with the
/// checkpoint's MTP layer drafting (`--spec mtp`, fixed verification): transformers' tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_runs_host_experts_and_reports_their_bytes() {
    use troupe::engine::{SpecAcceptance, SpecConfig, SpecMethod, SpecVerify};
    let dirs: Vec<_> = case_dirs().into_iter().take(2).collect();
    let mut drafted = 0;
    for (dir, cpu_moe, mtp) in dirs.iter().flat_map(|d| {
        [
            (d, CpuMoe::All, false),
            (d, CpuMoe::FirstLayers(1), false),
            (d, CpuMoe::All, true),
        ]
    }) {
        let (prompt, greedy) = case(dir);
        let json = std::fs::read_to_string(dir.join("case.json")).unwrap();
        if mtp && !json.contains("\"mtp\": true") {
            continue;
        }
        let mut cfg = engine_cfg(dir, cpu_moe);
        cfg.speculative = mtp.then_some(SpecConfig {
            method: SpecMethod::Mtp,
            num_speculative_tokens: 2,
            verify: SpecVerify::Fixed,
            acceptance: SpecAcceptance::Coupled,
        });
        let engine = Engine::spawn(cfg).await.unwrap();
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
            assert_eq!(g, greedy, "{} {cpu_moe} (mtp {mtp})", dir.display());
        }
        let status = engine.status().await.unwrap();
        drafted += status.num_spec_draft_tokens;
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
    assert!(drafted > 0, "the MTP layer drafted nothing");
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
    let mut cfg = EngineConfig::new(common::goldens().join("tiny-llama"));
    cfg.stream_experts = StreamExperts::Always;
    let err = Engine::spawn(cfg)
        .await
        .err()
        .expect("streaming a dense model's experts refused")
        .to_string();
    assert!(
        err.contains("--stream-experts always") && err.contains("no routed experts"),
        "{err}"
    );
}

/// `--stream-experts always`: every layer's touched host experts are copied to the
/// device and computed there, through the device's own grouped kernels beside the
/// experts it holds. On the CPU rank the copy is computed as the host computes it, so
/// the packed checkpoint under generated placements gives the CPU part's bits; experts
/// the copy cannot take (the batch-invariant mode's panels) are refused by name.
#[test]
fn streamed_host_experts_give_the_host_computed_bits() {
    let name = "tiny-dsv4-packed";
    let dir = common::dsv4::dir(name);
    let r = common::dsv4::reference(name);
    let cfg = DsV4Config::from_dir(&dir).unwrap();
    for seed in 0..3u64 {
        for (what, placement) in placements(&cfg, seed) {
            let on_cpu = with_host_experts(CpuBackend::default(), &dir, placement.clone(), false);
            let copied = streaming(
                CpuBackend::default(),
                &dir,
                placement,
                (false, StreamExperts::Always),
            )
            .unwrap();
            let prompt = &r.prompts[seed as usize % r.prompts.len()];
            for chunk in [prompt.len(), 1 + (splitmix64(seed) % 6) as usize] {
                let want = logits(&on_cpu, prompt, chunk);
                let got = logits(&copied, prompt, chunk);
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{what}, chunks of {chunk}: streamed experts' logits differ"
                );
            }
        }
    }
    let all = first_layers(cfg.num_layers, cfg.num_routed_experts, cfg.num_layers);
    let err = streaming(
        CpuBackend::default(),
        &dir,
        all,
        (true, StreamExperts::Always),
    )
    .err()
    .expect("panels refused")
    .to_string();
    assert!(err.contains("--stream-experts always"), "{err}");
}

/// `--batch-invariant` with host experts: a row's logits are the same bits alone or
/// beside a whole prompt (the packed host kernel takes every row through the same row
/// dots; the host's rows are added exactly into the device's), for every experts on the
/// host and for a split.
#[test]
fn host_experts_keep_a_row_the_same_bits_alone_or_batched() {
    use troupe::model::deepseek_v4::DsSeqStep;
    use troupe::model::deepseek_v4::cache::SlotSpan;
    let name = "tiny-dsv4-packed";
    let r = common::dsv4::reference(name);
    let dir = common::dsv4::dir(name);
    let cfg = DsV4Config::from_dir(&dir).unwrap();
    let (l, e) = (cfg.num_layers, cfg.num_routed_experts);
    let split = ExpertPlacement::new((0..l).map(|i| (i * 3 + 1) % (e + 1)).collect(), e);
    for placement in [first_layers(l, e, l), split] {
        let invariant = CpuBackend {
            batch_invariant: true,
            ..Default::default()
        };
        let model = with_host_experts(invariant, &dir, placement.clone(), true);
        let (a, b) = (&r.prompts[0], &r.prompts[1]);
        let block_size = 2 * lcm_rates(&cfg);
        let tables: Vec<Vec<u32>> = (0..2)
            .map(|s| (0..12).map(|i| 23 - (2 * i + s)).collect())
            .collect();
        let seq = |ids, at, slot: usize| DsSeqStep {
            token_ids: ids,
            num_cached_tokens: at,
            block_table: &tables[slot],
            state_slot: slot as u32,
            span: SlotSpan::default(),
            num_logit_rows: ids.len(),
        };
        let cut = a.len() - 2;
        let run = |with_b: bool| {
            let mut cache = DsV4Cache::on(&model.backend, &cfg, 2, 24, block_size);
            model.forward(&mut cache, &[seq(&a[..cut], 0, 0)]).unwrap();
            let mut steps = vec![seq(&a[cut..], cut, 0)];
            if with_b {
                steps.push(seq(b, 0, 1));
            }
            model.forward(&mut cache, &steps).unwrap()[..2 * model.vocab_size()].to_vec()
        };
        let (alone, batched) = (run(false), run(true));
        let moved = alone
            .iter()
            .zip(&batched)
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count();
        assert_eq!(
            moved, 0,
            "{placement:?}: {moved} logits moved when b joined the batch"
        );
    }
}

/// A split layer follows generated loads (`ExpertPlacement::following`): the experts
/// move between the device and host memory between two steps, as many as the placements
/// differ by, and the model still gives the all-device run's logits bit for bit.
#[test]
fn experts_moved_between_device_and_host_keep_the_logits() {
    for (i, dir) in case_dirs().iter().enumerate().take(4) {
        let (prompt, greedy) = case(dir);
        let mut seq = prompt.clone();
        seq.extend_from_slice(&greedy[..greedy.len() - 1]);
        let device = DsV4Model::load_dir(dir).unwrap();
        let want = logits(&device, &seq, 7);
        let (l, e) = (device.cfg.num_layers, device.cfg.num_routed_experts);
        let split = ExpertPlacement::new((0..l).map(|x| 1 + (x + i) % (e - 1)).collect(), e);
        let mut model = with_host_experts(CpuBackend::default(), dir, split.clone(), false);
        let mut moved_total = 0;
        for round in 0..3u64 {
            let load = |layer: usize| -> Vec<f64> {
                (0..e)
                    .map(|x| (splitmix64(round ^ ((layer * e + x) as u64 * 0x51)) % 1000) as f64)
                    .collect()
            };
            let next = model.expert_placement().unwrap().following(load);
            let expected = model.expert_placement().unwrap().num_moved(&next);
            let moved = model.move_experts(dir, false, next.clone()).unwrap();
            assert_eq!(moved, expected);
            assert_eq!(model.expert_placement(), Some(&next));
            moved_total += moved;
            let got = logits(&model, &seq, 7);
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{} round {round}: logits moved with the experts",
                dir.display()
            );
        }
        assert!(moved_total > 0, "{}: nothing moved", dir.display());
    }
}

/// A rank whose step panics mid-run with host experts (a split layer and every layer) is
/// rebuilt — its host experts loaded again — and every request ends with transformers'
/// tokens, no block or state slot left held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_restarted_mid_run_with_host_experts_finishes_every_request_unchanged() {
    use troupe::runner::fault::FaultPlan;
    let dir = &case_dirs()[1];
    let (prompt, greedy) = case(dir);
    for cpu_moe in [CpuMoe::FirstLayers(1), CpuMoe::All] {
        let faults = FaultPlan::default();
        let engine = Engine::spawn_with_faults(engine_cfg(dir, cpu_moe), faults.clone())
            .await
            .unwrap();
        let mut streams = Vec::new();
        for _ in 0..3 {
            let mut r = EngineRequest::new(prompt.clone(), greedy.len(), SamplingParams::default());
            r.ignore_eos = true;
            streams.push(engine.generate(r).await.unwrap());
        }
        let stepped = async {
            while engine.status().await.unwrap().num_steps < 2 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(60), stepped)
            .await
            .expect("the engine runs steps");
        faults.panic_next_step();
        for (i, s) in streams.into_iter().enumerate() {
            let o = tokio::time::timeout(Duration::from_secs(120), s.collect())
                .await
                .expect("every request ends within 120 s");
            assert!(o.error.is_none(), "{cpu_moe}, request {i}: {:?}", o.error);
            assert_eq!(o.token_ids, greedy, "{cpu_moe}, request {i}");
        }
        let freed = async {
            loop {
                let s = engine.status().await.unwrap();
                if s.num_running == 0
                    && s.num_free_blocks == s.num_total_blocks
                    && s.num_free_state_slots == s.num_total_state_slots
                {
                    return s;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        let status = tokio::time::timeout(Duration::from_secs(10), freed)
            .await
            .expect("blocks and state slots freed");
        // The first start counts as one.
        assert!(status.num_resets >= 2, "{cpu_moe}: no restart: {status:?}");
        assert!(status.resident_host_weight_bytes > 0, "{cpu_moe}");
        engine.shutdown(true).await;
    }
}
