//! DeepSeek-V4's one pass on the CUDA backend against the CPU reference with the
//! same bf16 weights, and against transformers' logits (`scripts/make_dsv4_goldens.py`):
//! every position, in one piece, in chunks and token by token, batched over scattered
//! blocks, replayed after a prefix hit, and with `--dummy-weights` made on the device.
//! Needs a GPU: run by `scripts/gpu-tests.sh` on the device machine.
#![cfg(feature = "cuda")]

mod common;

use common::dsv4::{
    CHECKPOINTS, Reference, assert_rows_close, assert_tracks, dir, mtp_reference, reference, step,
};
use troupe::error::Result;
use troupe::kernels::cpu::{CpuBackend, CpuMatrix};
use troupe::kernels::cuda::CudaBackend;
use troupe::kernels::deepseek_v4::DsV4Kernels;
use troupe::kernels::{Backend, HostData, random_weight};
use troupe::model::deepseek_v4::cache::{DsV4Cache, SlotSpan, lcm_rates};
use troupe::model::deepseek_v4::config::DsV4Config;
use troupe::model::deepseek_v4::mtp::MtpLayer;
use troupe::model::deepseek_v4::weights::{DsV4Weights, LinearData, LinearStore};
use troupe::model::deepseek_v4::{DsSeqStep, DsV4Model};
use troupe::model::loader::SafetensorsSource;

/// The CPU reference with its matrices rounded to bf16, as the GPU holds them.
struct Bf16OnHost(CpuBackend);

impl LinearStore for Bf16OnHost {
    type Backend = CpuBackend;
    fn backend(&self) -> &CpuBackend {
        &self.0
    }
    fn store(&self, rows: usize, cols: usize, data: LinearData) -> Result<CpuMatrix> {
        let values = match data {
            LinearData::Host(w) => w,
            // Packed FP8 / MXFP4: their exact values (the invariant GEMM dequantizes them to
            // bf16 too).
            LinearData::Stored(d) => d.into_f32(rows * cols),
            LinearData::Random {
                seed,
                mean,
                half_width,
            } => (0..(rows * cols) as u64)
                .map(|i| random_weight(seed, i, mean, half_width))
                .collect(),
        };
        let rounded = values
            .into_iter()
            .map(|v| half::bf16::from_f32(v).to_f32())
            .collect();
        Ok(CpuMatrix::from_host(troupe::kernels::HostMatrix {
            rows,
            cols,
            data: HostData::F32(rounded),
        }))
    }
}

type Gpu = DsV4Model<CudaBackend>;

fn host_model(name: &str, dummy: bool) -> DsV4Model {
    let cfg = DsV4Config::from_dir(&dir(name)).unwrap();
    let weights = if dummy {
        DsV4Weights::dummy_into(&cfg, &Bf16OnHost(CpuBackend::default())).unwrap()
    } else {
        let src = SafetensorsSource::open_dir(&dir(name)).unwrap();
        DsV4Weights::load_into(&cfg, &src, &Bf16OnHost(CpuBackend::default())).unwrap()
    };
    DsV4Model::new(cfg, weights)
}

fn gpu(name: &str, batch_invariant: bool, dummy: bool) -> Gpu {
    let b = CudaBackend::new(0, batch_invariant, false).expect("a GPU");
    DsV4Model::load_dir_on(b, &dir(name), dummy).unwrap()
}

/// The packed checkpoint stays packed on the GPU: MXFP4 routed experts, FP8 projections.
#[test]
fn a_released_format_checkpoint_keeps_its_experts_mxfp4_and_projections_fp8() {
    let card = gpu("tiny-dsv4-packed", false, false).footprint().card();
    assert!(card.contains("routed_experts MXFP4"), "{card}");
    assert!(card.contains("attn FP8"), "{card}");
    assert!(card.contains("shared_experts FP8"), "{card}");
}

const NUM_BLOCKS: usize = 32;

fn block_size(cfg: &DsV4Config) -> usize {
    2 * lcm_rates(cfg)
}

/// Blocks handed out back to front, interleaved between `num_seqs` sequences.
fn table(seq: usize, num_seqs: usize) -> Vec<u32> {
    (0..NUM_BLOCKS / num_seqs)
        .map(|i| (NUM_BLOCKS - 1 - (i * num_seqs + seq)) as u32)
        .collect()
}

/// Every position's logits from `span.state_start` on, in chunks of the given sizes.
fn gpu_run(
    m: &Gpu,
    cache: &mut DsV4Cache<CudaBackend>,
    slot: u32,
    table: &[u32],
    prompt: &[u32],
    span: SlotSpan,
    chunks: &[usize],
) -> Vec<f32> {
    let mut out = Vec::new();
    let mut pos = span.state_start;
    let mut experts = vec![vec![0; m.cfg.num_routed_experts]; m.cfg.num_layers];
    for c in 0.. {
        if pos >= prompt.len() {
            break;
        }
        let n = chunks[c % chunks.len()].min(prompt.len() - pos);
        let step = DsSeqStep {
            token_ids: &prompt[pos..pos + n],
            num_cached_tokens: pos,
            block_table: table,
            state_slot: slot,
            span,
            num_logit_rows: n,
        };
        out.extend(m.forward_counting(cache, &[step], &mut experts).unwrap());
        pos += n;
    }
    out
}

fn host_run(model: &DsV4Model, prompt: &[u32]) -> Vec<f32> {
    let bs = block_size(&model.cfg);
    let mut cache = DsV4Cache::new(&model.cfg, 1, NUM_BLOCKS, bs);
    let step = DsSeqStep {
        token_ids: prompt,
        num_cached_tokens: 0,
        block_table: &table(0, 1),
        state_slot: 0,
        span: SlotSpan::default(),
        num_logit_rows: prompt.len(),
    };
    model.forward(&mut cache, &[step]).unwrap()
}

fn new_cache(m: &Gpu, num_slots: usize) -> DsV4Cache<CudaBackend> {
    m.new_cache(num_slots, NUM_BLOCKS, block_size(&m.cfg))
}

/// f32 activations on both sides (the batch-invariant GEMM), the same bf16 weights:
/// only the order of sums differs.
const SAME_WEIGHTS_TOL: f32 = 1e-4;

#[test]
fn every_position_matches_the_host_reference_whole_chunked_and_token_by_token() {
    for name in CHECKPOINTS {
        let r = reference(name);
        let host = host_model(name, false);
        let invariant = gpu(name, true, false);
        let default = gpu(name, false, false);
        for prompt in &r.prompts {
            let want = host_run(&host, prompt);
            let runs = [
                (&invariant, &[prompt.len()][..]),
                (&invariant, &[5, 2, 7]),
                (&invariant, &[1]),
                (&default, &[1]),
            ];
            for (dev, chunks) in runs {
                let mut cache = new_cache(dev, 1);
                let got = gpu_run(
                    dev,
                    &mut cache,
                    0,
                    &table(0, 1),
                    prompt,
                    SlotSpan::default(),
                    chunks,
                );
                let what = format!(
                    "chunks {chunks:?}, invariant {}",
                    dev.backend.batch_invariant
                );
                if dev.backend.batch_invariant {
                    assert_rows_close(name, &what, &got, &want, r.vocab_size, SAME_WEIGHTS_TOL);
                } else {
                    assert_tracks(name, &what, &got, &want, r.vocab_size);
                }
            }
        }
    }
}

#[test]
fn sequences_batched_over_scattered_blocks_get_their_own_logits() {
    for name in CHECKPOINTS {
        let r = reference(name);
        let dev = gpu(name, true, false);
        let (a, b) = (&r.prompts[0], &r.prompts[1]);
        let alone: Vec<Vec<f32>> = [a, b]
            .iter()
            .map(|p| {
                let mut cache = new_cache(&dev, 1);
                gpu_run(
                    &dev,
                    &mut cache,
                    0,
                    &table(0, 1),
                    p,
                    SlotSpan::default(),
                    &[9],
                )
            })
            .collect();
        let mut cache = new_cache(&dev, 2);
        let (ta, tb) = (table(0, 2), table(1, 2));
        let mut experts = vec![vec![0; dev.cfg.num_routed_experts]; dev.cfg.num_layers];
        let (mut got_a, mut got_b) = (Vec::new(), Vec::new());
        let mut pos = 0;
        while pos < a.len().max(b.len()) {
            let mut steps = Vec::new();
            for (p, t, slot) in [(a, &ta, 1u32), (b, &tb, 0)] {
                if pos < p.len() {
                    let n = 9.min(p.len() - pos);
                    steps.push(DsSeqStep {
                        token_ids: &p[pos..pos + n],
                        num_cached_tokens: pos,
                        block_table: t,
                        state_slot: slot,
                        span: SlotSpan::default(),
                        num_logit_rows: n,
                    });
                }
            }
            let rows: Vec<usize> = steps.iter().map(|s| s.num_logit_rows).collect();
            let logits = dev
                .forward_counting(&mut cache, &steps, &mut experts)
                .unwrap();
            let split = if pos < a.len() { rows[0] } else { 0 };
            got_a.extend_from_slice(&logits[..split * r.vocab_size]);
            got_b.extend_from_slice(&logits[split * r.vocab_size..]);
            pos += 9;
        }
        assert_rows_close(name, "batched a", &got_a, &alone[0], r.vocab_size, 1e-6);
        assert_rows_close(name, "batched b", &got_b, &alone[1], r.vocab_size, 1e-6);
    }
}

#[test]
fn a_prefix_hit_replayed_from_the_bound_gives_the_logits_of_a_cold_run() {
    for name in CHECKPOINTS {
        let r = reference(name);
        let dev = gpu(name, true, false);
        let prompt = &r.prompts[0];
        let bs = block_size(&dev.cfg);
        let replay = dev.cfg.num_replay_tokens();
        let t = table(0, 1);
        let mut cache = new_cache(&dev, 2);
        let cold = gpu_run(&dev, &mut cache, 0, &t, prompt, SlotSpan::default(), &[7]);
        // Slot 1 resumes on the blocks slot 0 filled: a hit at every block boundary the
        // replay bound fits before.
        let mut hit = bs;
        let mut checked = 0;
        while hit < prompt.len() {
            if hit >= replay {
                let span = SlotSpan {
                    state_start: hit - replay,
                    replay_until: hit,
                };
                let got = gpu_run(&dev, &mut cache, 1, &t, prompt, span, &[5]);
                let v = r.vocab_size;
                assert_rows_close(
                    name,
                    &format!("hit at {hit}"),
                    &got[replay * v..],
                    &cold[hit * v..],
                    v,
                    1e-6,
                );
                checked += 1;
            }
            hit += bs;
        }
        assert!(checked > 0, "{name}: no hit point past the replay bound");
    }
}

fn argmax(row: &[f32]) -> usize {
    (0..row.len())
        .max_by(|&a, &b| row[a].total_cmp(&row[b]).then(b.cmp(&a)))
        .unwrap()
}

/// Against transformers' logits (the checkpoints are bf16, so the GPU holds their weights
/// exactly). The batch-invariant mode keeps f32 activations: every position within 1e-4
/// (2e-6 measured). The default mode's prefill takes bf16 operands (`assert_tracks`; the
/// argmax the same at 67–69 of 72 measured).
#[test]
fn prefill_in_either_mode_tracks_transformers_logits() {
    for name in CHECKPOINTS {
        let r: Reference = reference(name);
        for invariant in [true, false] {
            let dev = gpu(name, invariant, false);
            for (p, prompt) in r.prompts.iter().enumerate() {
                let mut cache = new_cache(&dev, 1);
                let got = gpu_run(
                    &dev,
                    &mut cache,
                    0,
                    &table(0, 1),
                    prompt,
                    SlotSpan::default(),
                    &[16],
                );
                let what = format!("invariant={invariant} prompt {p}");
                if invariant {
                    assert_rows_close(name, &what, &got, &r.logits[p], r.vocab_size, 1e-4);
                } else {
                    assert_tracks(name, &what, &got, &r.logits[p], r.vocab_size);
                }
            }
        }
    }
}

#[test]
fn dummy_weights_made_on_the_device_are_the_host_dummy_model() {
    let name = CHECKPOINTS[0];
    let host = host_model(name, true);
    let dev = gpu(name, true, true);
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 % 200) as u32).collect();
    let want = host_run(&host, &prompt);
    let mut cache = new_cache(&dev, 1);
    let got = gpu_run(
        &dev,
        &mut cache,
        0,
        &table(0, 1),
        &prompt,
        SlotSpan::default(),
        &[40],
    );
    assert_rows_close(
        name,
        "dummy",
        &got,
        &want,
        host.cfg.vocab_size,
        SAME_WEIGHTS_TOL,
    );
}

/// The random checkpoints of `scripts/dsv4_differential.py` (the committed ones, or
/// `TROUPE_DSV4_CASES`) on the GPU in the batch-invariant mode against transformers'
/// logits: in one piece, in chunks of 64 and 7, and token by token. bf16 checkpoints only: the GPU
/// holds matrices in bf16.
#[test]
fn random_checkpoints_match_transformers_on_the_gpu() {
    let root = std::env::var_os("TROUPE_DSV4_CASES")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| common::goldens().join("dsv4-diff"));
    let mut dirs: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("case.json").exists())
        .collect();
    dirs.sort();
    let (mut failures, mut checked) = (Vec::new(), 0);
    for d in &dirs {
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(d.join("case.json")).unwrap()).unwrap();
        if json["weights"] == "f32" {
            continue;
        }
        checked += 1;
        let mut tokens = common::ids(&json["prompt"]);
        let greedy = common::ids(&json["greedy_tokens"]);
        tokens.extend_from_slice(&greedy[..greedy.len() - 1]);
        let bytes = std::fs::read(d.join("logits.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let want: Vec<f32> = st
            .tensor("logits")
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|x| f32::from_le_bytes(x.try_into().unwrap()))
            .collect();
        let b = CudaBackend::new(0, true, false).expect("a GPU");
        let dev = DsV4Model::load_dir_on(b, d, false).unwrap();
        let vocab = want.len() / tokens.len();
        let bs = block_size(&dev.cfg);
        let num_blocks = tokens.len().div_ceil(bs) + 1;
        let table: Vec<u32> = (0..num_blocks as u32).rev().collect();
        for chunks in [&[tokens.len()][..], &[64], &[7], &[1]] {
            let mut cache = dev.new_cache(1, num_blocks, bs);
            let got = gpu_run(
                &dev,
                &mut cache,
                0,
                &table,
                &tokens,
                SlotSpan::default(),
                chunks,
            );
            let first = got
                .chunks(vocab)
                .zip(want.chunks(vocab))
                .position(|(g, w)| {
                    let scale = w.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                    g.iter().zip(w).any(|(a, c)| (a - c).abs() > 1e-3 * scale)
                });
            if let Some(pos) = first {
                failures.push(format!("{} chunks {chunks:?}: position {pos}", d.display()));
            }
        }
    }
    eprintln!(
        "{checked} bf16 cases on the GPU, {} failures",
        failures.len()
    );
    assert!(checked > 0);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The one pass rewinds on the GPU as on the CPU: after a verify row whose last drafts
/// are wrong (crossing a compress boundary, so the ring and the open windows must both
/// come back), resuming from the accepted tokens gives transformers' logits.
#[test]
fn rejected_drafts_rewind_the_device_state() {
    for name in CHECKPOINTS {
        let r = reference(name);
        let dev = gpu(name, true, false);
        let vocab = r.vocab_size;
        let prompt = &r.prompts[0];
        let t = table(0, 1);
        let mut cache = new_cache(&dev, 1);
        let mut experts = vec![vec![0; dev.cfg.num_routed_experts]; dev.cfg.num_layers];
        for (at, accepted) in [(29, 3), (38, 0)] {
            let mut run = |s: DsSeqStep<'_>| {
                dev.forward_counting(&mut cache, &[s], &mut experts)
                    .unwrap()
            };
            run(step(&prompt[..at], 0, 1, &t));
            let mut row = prompt[at..at + 7].to_vec();
            for tok in row.iter_mut().skip(accepted) {
                *tok = (*tok + 17) % vocab as u32;
            }
            run(step(&row, at, row.len(), &t));
            let resume = at + accepted;
            let got = run(step(&prompt[resume..], resume, prompt.len() - resume, &t));
            assert_rows_close(
                name,
                &format!("resumed at {resume}"),
                &got,
                &r.logits[0][resume * vocab..],
                vocab,
                1e-4,
            );
        }
    }
}

/// `--spec mtp` on a CUDA rank: the MTP layer on the GPU, fed the model's own last-layer
/// streams from the GPU, chains the reference's drafts (transformers' decoder layer with
/// DeepSeek's `MTPBlock` glue), logits within the invariant mode's bound.
#[test]
fn the_mtp_layer_on_the_gpu_chains_the_reference_drafts() {
    let name = "tiny-dsv4-a";
    let dev = gpu(name, true, false);
    let b = &dev.backend;
    let mtp = MtpLayer::load_into(&dev.cfg, Some(&dir(name)), b).unwrap();
    let (r, want) = (reference(name), mtp_reference(name));
    let prompt = &r.greedy_prompt;
    let (n, vocab) = (prompt.len(), dev.vocab_size());
    let mut cache = new_cache(&dev, 1);
    let blocks = table(0, 1);
    let step = DsSeqStep {
        token_ids: prompt,
        num_cached_tokens: 0,
        block_table: &blocks,
        state_slot: 0,
        span: SlotSpan::default(),
        num_logit_rows: n,
    };
    let mut loads = vec![vec![0; dev.cfg.num_routed_experts]; dev.cfg.num_layers];
    let (logits, streams) = dev
        .forward_streams(&mut cache, &[step], &mut loads, None)
        .unwrap();
    let first = argmax(&logits[(n - 1) * vocab..]) as u32;
    assert_eq!(first, r.greedy_tokens[0]);

    let width = dev.cfg.hc_mult * dev.cfg.hidden_size;
    let mut mtp_cache = mtp.new_cache_on(b, 1);
    MtpLayer::restart(&mut mtp_cache, 0, 0);
    let before = b.upload(&b.read_floats(&streams, 0..(n - 1) * width));
    mtp.forward(&dev, &mut mtp_cache, 0, 0, &before, &prompt[1..]);
    let mut h = b.upload(&b.read_floats(&streams, (n - 1) * width..n * width));
    let (mut next, mut drafts, mut chain) = (first, Vec::new(), Vec::new());
    for i in 0..want.drafts.len() {
        let out = mtp.forward(&dev, &mut mtp_cache, 0, n - 1 + i, &h, &[next]);
        let l = mtp.logits_on(&dev, &out, 1);
        next = argmax(&l) as u32;
        drafts.push(next);
        chain.extend(l);
        h = out;
    }
    assert_rows_close(
        name,
        "MTP chain on the GPU",
        &chain,
        &want.chain,
        vocab,
        1e-4,
    );
    assert_eq!(drafts, want.drafts);
}
