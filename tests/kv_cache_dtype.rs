//! `--kv-cache-dtype` against transformers: the log-probability error a bf16 or fp8 cache
//! adds on the tiny checkpoints (their full last-position logits) and on SmolLM2 (the
//! reference's top 20), bounded and reported, and SmolLM2's greedy agreement with
//! transformers' tokens, teacher-forced, next to llama.cpp's on the same file.

mod common;

use common::generate::Generator;
use troupe::kernels::KvDtype;
use troupe::kernels::cpu::CpuBackend;

const DTYPES: [KvDtype; 3] = [KvDtype::Auto, KvDtype::Bf16, KvDtype::Fp8];

fn exact() -> CpuBackend {
    CpuBackend {
        exact_activations: true,
        ..Default::default()
    }
}

/// Per dtype, the largest change of a top-10 token's log-probability against
/// transformers' over every case of the three tiny checkpoints (random weights: flat
/// distributions, short prompts of generated lengths).
#[test]
fn tiny_checkpoints_logprob_error_per_cache_dtype_is_bounded() {
    let mut worst = [0f64; 3];
    for (model, reference) in [
        ("tiny-llama", "tiny-llama/reference.json"),
        ("tiny-qwen2", "tiny-qwen2/reference.json"),
        ("tiny-qwen3", "tiny-qwen3/reference.json"),
    ] {
        let reference = common::read_json(reference);
        let loaded = common::load_on(&common::goldens().join(model), &exact());
        let mut generator = Generator::new(exact(), loaded, 16);
        for case in reference["cases"].as_array().unwrap() {
            let prompt = common::ids(&case["prompt_ids"]);
            let want = common::log_probs(&common::floats(&case["last_logits"]));
            let mut top: Vec<usize> = (0..want.len()).collect();
            top.sort_by(|&a, &b| want[b].total_cmp(&want[a]));
            for (i, &dtype) in DTYPES.iter().enumerate() {
                let got = common::log_probs(&common::decode_logits(&mut generator, &prompt, dtype));
                for &id in &top[..10] {
                    worst[i] = worst[i].max((got[id] - want[id]).abs());
                }
            }
        }
    }
    eprintln!(
        "tiny checkpoints, largest top-10 logprob error against transformers: \
         f32 {:.2e}, bf16 {:.2e}, fp8 {:.2e}",
        worst[0], worst[1], worst[2]
    );
    assert!(worst[0] < 1e-4, "f32 cache: {}", worst[0]);
    // Measured 8e-3 and 0.13 (AMD EPYC and Intel alike: the cache's rounding, not the
    // CPU's, decides them).
    assert!(worst[1] < 2e-2, "bf16 cache: {}", worst[1]);
    assert!(worst[2] < 0.3, "fp8 cache: {}", worst[2]);
    assert!(
        worst[2] > worst[0] && worst[1] > worst[0],
        "a low-precision cache changed nothing: is it in use? {worst:?}"
    );
}

/// SmolLM2 (the default model) on its golden prompts: per dtype the largest change of a
/// top-20 token's logit gap to the top token (its log-probability relative to the top's)
/// against transformers'.
#[test]
fn smollm2_logprob_error_per_cache_dtype_is_bounded() {
    let golden = common::read_json("smollm2.json");
    let path = common::smollm2_path();
    let mut generator = Generator::new(exact(), common::load_on(&path, &exact()), 16);
    let mut worst = [0f64; 3];
    for p in golden["prompts"].as_array().unwrap() {
        let prompt = common::ids(&p["prompt_ids"]);
        let top: Vec<(usize, f64)> = p["top20"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| (e[0].as_u64().unwrap() as usize, e[1].as_f64().unwrap()))
            .collect();
        for (i, &dtype) in DTYPES.iter().enumerate() {
            let got = common::decode_logits(&mut generator, &prompt, dtype);
            let gap = |id: usize| got[id] as f64 - got[top[0].0] as f64;
            for &(id, want) in &top {
                worst[i] = worst[i].max((gap(id) - (want - top[0].1)).abs());
            }
        }
    }
    eprintln!(
        "SmolLM2, largest top-20 logprob error (gap to the top token) against transformers: \
         f32 {:.3}, bf16 {:.3}, fp8 {:.3}",
        worst[0], worst[1], worst[2]
    );
    assert!(worst[0] < 0.05, "f32 cache: {}", worst[0]);
    assert!(worst[1] < 0.1, "bf16 cache: {}", worst[1]);
    // e4m3 keeps three mantissa bits: each K and V entry moves by up to 1/16 (measured
    // 0.83, on a top-20 token ten logits below the top; bf16 0.04).
    assert!(worst[2] < 1.5, "fp8 cache: {}", worst[2]);
    assert!(worst[2] > worst[0], "fp8 changed nothing: {worst:?}");
}

/// Transformers' greedy continuations of generated chat prompts fed back one token at a
/// time (scripts/make_agreement_goldens.py), on the default 8-bit path with an fp8 cache:
/// troupe's argmax equals transformers' token nearly as often as llama.cpp's does with its
/// f16 cache.
#[test]
fn smollm2_greedy_agreement_with_an_fp8_cache() {
    let golden = common::read_json("smollm2_agreement.json");
    let mut generator = Generator::new(
        CpuBackend::default(),
        common::load(&common::smollm2_path()),
        16,
    );
    let mut ours = [0usize; 2];
    let (mut llama_cpp, mut total) = (0, 0);
    for p in golden["prompts"].as_array().unwrap() {
        let prompt = common::ids(&p["prompt_ids"]);
        let want = common::ids(&p["greedy"]);
        for (i, dtype) in [KvDtype::Auto, KvDtype::Fp8].into_iter().enumerate() {
            ours[i] += common::forced_argmax_hits(&mut generator, &prompt, &want, dtype);
        }
        let theirs = common::ids(&p["llama_cpp_forced_argmax"]);
        llama_cpp += theirs.iter().zip(&want).filter(|(a, b)| a == b).count();
        total += want.len();
    }
    eprintln!(
        "argmax equal to transformers' token: troupe f32 cache {}, fp8 cache {}, \
         llama.cpp {llama_cpp} of {total}",
        ours[0], ours[1]
    );
    // A token in a hundred may flip on a near-tie.
    assert!(
        ours[1] * 100 >= llama_cpp * 99,
        "fp8 cache {} against llama.cpp {llama_cpp} of {total}",
        ours[1]
    );
}

/// Through the engine on the CPU: one budget holds twice f32's blocks in bf16 and
/// 4·hd / (hd + 4) times in fp8, and the requests run (how often the tokens agree is
/// reported: the random checkpoint's near-ties make it a poor measure; SmolLM2's is
/// asserted above); what cannot run is refused by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_sizes_its_pool_by_the_cache_dtype_and_refuses_what_cannot_run() {
    use troupe::engine::{Device, Engine};
    let bound = std::time::Duration::from_secs(120);
    tokio::time::timeout(bound, async {
        let requests = common::engine::random_requests(8, 384, 11);
        let num_tokens: usize = requests.iter().map(|r| r.max_tokens).sum();
        let mut runs = Vec::new();
        for dtype in DTYPES {
            let mut cfg = common::engine::tiny_config("tiny-llama");
            cfg.device = Device::Cpu;
            cfg.kv_cache_dtype = dtype;
            runs.push(common::engine::run_engine(cfg, requests.clone()).await);
        }
        let blocks: Vec<usize> = runs.iter().map(|(_, s)| s.num_total_blocks).collect();
        // tiny-llama: head_dim 16, so fp8 takes 20 bytes a head where f32 takes 64.
        assert!(blocks[1].abs_diff(2 * blocks[0]) <= 1, "{blocks:?}");
        assert!(blocks[2].abs_diff(blocks[0] * 64 / 20) <= 1, "{blocks:?}");
        let same = |i: usize| -> usize {
            let pairs = runs[0].0.iter().zip(&runs[i].0);
            pairs
                .map(|(a, b)| {
                    a.token_ids
                        .iter()
                        .zip(&b.token_ids)
                        .filter(|(x, y)| x == y)
                        .count()
                })
                .sum()
        };
        for (i, (outs, _)) in runs.iter().enumerate() {
            let n: usize = outs.iter().map(|o| o.token_ids.len()).sum();
            assert_eq!(
                n, num_tokens,
                "{:?}: every request ran to its length",
                DTYPES[i]
            );
        }
        eprintln!(
            "greedy tokens equal to the f32 cache's: bf16 {}, fp8 {} of {num_tokens}",
            same(1),
            same(2)
        );

        for dtype in [KvDtype::Bf16, KvDtype::Fp8] {
            let mut invariant = common::engine::tiny_config("tiny-llama");
            invariant.device = Device::Cuda(0);
            invariant.batch_invariant = true;
            invariant.kv_cache_dtype = dtype;
            let err = Engine::spawn(invariant)
                .await
                .err()
                .expect("refused")
                .to_string();
            assert!(
                err.contains(&format!("--kv-cache-dtype {}", dtype.name()))
                    && err.contains("--batch-invariant"),
                "{err}"
            );
        }
        // tiny-dsv4-a's index heads are 16 wide: MXFP4 keys take groups of 32.
        let mut dsv4 = common::engine::tiny_config("tiny-dsv4-a");
        dsv4.device = Device::Cpu;
        dsv4.kv_cache_dtype = KvDtype::Fp8;
        let mut dsv4_cuda = common::engine::tiny_config("tiny-dsv4-a");
        dsv4_cuda.device = Device::Cuda(0);
        dsv4_cuda.kv_cache_dtype = KvDtype::Bf16;
        let mut llama_fp4 = common::engine::tiny_config("tiny-llama");
        llama_fp4.kv_cache_dtype = KvDtype::Fp4;
        for (cfg, want) in [
            (
                dsv4,
                "Mxfp4 entries take rows of whole groups of 32, not 16",
            ),
            (
                dsv4_cuda,
                "DeepSeek-V4's packed entries run on the CPU so far",
            ),
            (llama_fp4, "--kv-cache-dtype fp4 is DeepSeek-V4's layout"),
        ] {
            let err = Engine::spawn(cfg).await.err().expect("refused").to_string();
            assert!(err.contains(want), "{err}");
        }
    })
    .await
    .expect("within its time bound");
}

/// DeepSeek-V4's layouts through the engine on a differential case whose heads take them:
/// the pool holds more blocks the fewer bytes a block takes, every request runs, the f32
/// cache gives transformers' greedy tokens, and the others' agreement is reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deepseek_v4_layouts_size_the_pool_and_run_through_the_engine() {
    use troupe::engine::{Device, Engine, EngineConfig, EngineRequest};
    use troupe::model::deepseek_v4::cache::{CacheFormats, DsV4Cache, lcm_rates};
    use troupe::model::deepseek_v4::config::DsV4Config;
    use troupe::model::deepseek_v4::saved_state::SavedStates;
    use troupe::sampling::SamplingParams;
    let dir = common::goldens().join("dsv4-diff/case-1005");
    let case = common::read_json("dsv4-diff/case-1005/case.json");
    let prompt = common::ids(&case["prompt"]);
    let greedy = common::ids(&case["greedy_tokens"]);
    let ds = DsV4Config::from_dir(&dir).unwrap();
    let bound = std::time::Duration::from_secs(120);
    tokio::time::timeout(bound, async {
        let mut runs = Vec::new();
        for dtype in [KvDtype::Auto, KvDtype::Bf16, KvDtype::Fp8, KvDtype::Fp4] {
            let mut cfg = EngineConfig::new(dir.clone());
            cfg.device = Device::Cpu;
            // Room for 12 f32 blocks beside the layout's slots and 8 saved states: the
            // budget, not the cap, sizes the pool. The repeated prompt resumes from them.
            let formats = CacheFormats::for_dtype(dtype);
            cfg.kv_cache_bytes = 4 * DsV4Cache::bytes_per_slot_in(&ds, formats)
                + 8 * SavedStates::bytes_per_state_in(&ds, formats)
                + 12 * DsV4Cache::bytes_per_block(&ds, lcm_rates(&ds).max(16));
            cfg.swa_saved_states = Some(8);
            cfg.max_num_seqs = 4;
            cfg.kv_cache_dtype = dtype;
            let requests = |n: usize| {
                (0..n)
                    .map(|_| {
                        let p = prompt.clone();
                        let mut r = EngineRequest::new(p, greedy.len(), SamplingParams::default());
                        r.ignore_eos = true;
                        r
                    })
                    .collect::<Vec<_>>()
            };
            // One alone, then two that hit its prefix.
            let engine = Engine::spawn(cfg).await.unwrap();
            let mut outs = common::engine::ok_outputs(&engine, requests(1)).await;
            outs.extend(common::engine::ok_outputs(&engine, requests(2)).await);
            let status = engine.status().await.unwrap();
            engine.shutdown(true).await;
            for o in &outs {
                assert_eq!(o.token_ids.len(), greedy.len(), "{dtype:?}");
            }
            let agree = outs[0]
                .token_ids
                .iter()
                .zip(&greedy)
                .take_while(|(a, b)| a == b)
                .count();
            eprintln!(
                "{}: {} blocks, the first {agree} of {} greedy tokens as transformers'",
                dtype.name(),
                status.num_total_blocks,
                greedy.len()
            );
            assert!(status.num_resumed_hits > 0, "{dtype:?}: {status:?}");
            runs.push((status.num_total_blocks, agree));
        }
        assert_eq!(
            runs[0].1,
            greedy.len(),
            "the f32 cache gives transformers' tokens"
        );
        assert!(
            runs.windows(2).all(|w| w[1].0 > w[0].0),
            "blocks by layout: {runs:?}"
        );
    })
    .await
    .expect("within its time bound");
}
