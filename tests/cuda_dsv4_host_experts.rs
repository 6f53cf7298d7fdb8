//! DeepSeek-V4 on a CUDA rank with routed experts in host memory (`--cpu-moe`, generated
//! splits): on the differential cases' bf16 checkpoints (the GPU's weights are then the
//! checkpoint's own), in the batch-invariant mode (f32 activations on both sides), every
//! position stays within 1e-4 of the all-GPU run and the greedy tokens are transformers';
//! the packed checkpoint in the default mode tracks transformers (bf16 operands on the GPU,
//! 8-bit activations on the host).
#![cfg(feature = "cuda")]

mod common;

use common::dsv4::{assert_rows_close, assert_tracks, dir, reference};
use common::dsv4_host::{
    argmax_rows, case, case_dirs, first_layers, logits, placements, streaming, with_host_experts,
};
use troupe::kernels::cuda::CudaBackend;
use troupe::model::deepseek_v4::DsV4Model;

fn gpu(invariant: bool) -> CudaBackend {
    CudaBackend::new(0, invariant, false).expect("a GPU")
}

#[test]
fn host_experts_on_a_cuda_rank_match_the_all_gpu_run_and_transformers_tokens() {
    let mut checked = 0;
    for (i, dir) in case_dirs().iter().enumerate() {
        let json = std::fs::read_to_string(dir.join("case.json")).unwrap();
        if json.contains("\"weights\": \"f32\"") || json.contains("\"weights\":\"f32\"") {
            continue;
        }
        let (prompt, greedy) = case(dir);
        let mut seq = prompt.clone();
        seq.extend_from_slice(&greedy[..greedy.len() - 1]);
        let all_gpu = DsV4Model::load_dir_on(gpu(true), dir, false).unwrap();
        let vocab = all_gpu.vocab_size();
        let want = logits(&all_gpu, &seq, seq.len());
        for (what, placement) in placements(&all_gpu.cfg, i as u64 + 5) {
            let model = with_host_experts(gpu(true), dir, placement, true);
            for chunk in [seq.len(), 7] {
                let got = logits(&model, &seq, chunk);
                let name = dir.display().to_string();
                assert_rows_close(
                    &name,
                    &format!("{what}, chunks of {chunk}"),
                    &got,
                    &want,
                    vocab,
                    1e-4,
                );
            }
            let got = argmax_rows(&logits(&model, &seq, seq.len()), vocab);
            assert_eq!(
                &got[prompt.len() - 1..],
                &greedy[..],
                "{} {what}",
                dir.display()
            );
            checked += 1;
        }
    }
    assert!(checked > 0, "no bf16 case");
}

#[test]
fn packed_host_experts_on_a_cuda_rank_track_transformers() {
    let name = "tiny-dsv4-packed";
    let r = reference(name);
    let cfg = DsV4Model::load_dir(&dir(name)).unwrap().cfg;
    let all = first_layers(cfg.num_layers, cfg.num_routed_experts, cfg.num_layers);
    let model = with_host_experts(gpu(false), &dir(name), all, false);
    for (prompt, want) in r.prompts.iter().zip(&r.logits) {
        let got = logits(&model, prompt, 7);
        assert_tracks(name, "--cpu-moe on the GPU", &got, want, r.vocab_size);
    }
}

/// Experts moved between the GPU and host memory (a split layer following generated
/// loads) leave the logits where the all-GPU run has them.
#[test]
fn experts_moved_between_the_gpu_and_host_keep_the_logits() {
    use troupe::model::deepseek_v4::expert_placement::ExpertPlacement;
    use troupe::sampling::splitmix64;
    let dir = case_dirs()
        .into_iter()
        .find(|d| {
            std::fs::read_to_string(d.join("case.json"))
                .unwrap()
                .contains("bf16")
        })
        .expect("a bf16 case");
    let (prompt, _) = case(&dir);
    let all_gpu = DsV4Model::load_dir_on(gpu(true), &dir, false).unwrap();
    let (l, e, vocab) = (
        all_gpu.cfg.num_layers,
        all_gpu.cfg.num_routed_experts,
        all_gpu.vocab_size(),
    );
    let want = logits(&all_gpu, &prompt, 7);
    let split = ExpertPlacement::new((0..l).map(|x| 1 + x % (e - 1)).collect(), e);
    let mut model = with_host_experts(gpu(true), &dir, split, true);
    for round in 0..2u64 {
        let load = |layer: usize| -> Vec<f64> {
            (0..e)
                .map(|x| (splitmix64(round ^ ((layer * e + x) as u64 * 0x51)) % 1000) as f64)
                .collect()
        };
        let next = model.expert_placement().unwrap().following(load);
        model.move_experts(&dir, false, next).unwrap();
        let got = logits(&model, &prompt, 7);
        assert_rows_close("moved", &format!("round {round}"), &got, &want, vocab, 1e-4);
    }
}

/// A host expert streamed to the GPU (`--stream-experts always`): GGUF's MXFP4 blocks as
/// the host keeps them, put in the GPU's pair order on the device, multiply as the
/// checkpoint's own upload does, bit for bit, on generated shapes.
#[test]
fn ggml_mxfp4_blocks_upload_as_the_checkpoint_layout() {
    use troupe::kernels::fp4::Mxfp4Matrix;
    use troupe::kernels::quant::GgmlType;
    use troupe::kernels::{Backend, HostData, HostMatrix};
    use troupe::sampling::splitmix64;
    let g = gpu(false);
    for seed in 0..6u64 {
        let rows = 1 + (splitmix64(seed) % 300) as usize;
        let cols = 32 * (1 + (splitmix64(seed ^ 7) % 40) as usize);
        let tokens = 1 + (splitmix64(seed ^ 9) % 70) as usize;
        let mut m = Mxfp4Matrix::random(rows, cols, seed);
        for (i, e) in m.exponents.iter_mut().enumerate() {
            *e = 110 + (splitmix64(seed ^ i as u64) % 20) as u8;
        }
        let x: Vec<f32> = (0..tokens * cols)
            .map(|i| (splitmix64(seed ^ (i as u64 * 31)) % 2001) as f32 / 1000.0 - 1.0)
            .collect();
        let product = |data: HostData| {
            let w = g.upload_matrix(HostMatrix { rows, cols, data });
            let mut out = g.alloc(tokens * rows);
            g.matmul(&g.upload(&x), tokens, &w, None, &mut out);
            g.download(&out, tokens * rows)
        };
        let want = product(HostData::Mxfp4(m.clone()));
        let blocks = m.to_ggml_blocks();
        let got = product(HostData::Quantized {
            ggml_type: GgmlType::MXFP4,
            bytes: blocks.clone(),
        });
        let streamed = g.upload_blocks(rows, cols, GgmlType::MXFP4, &blocks);
        let mut out = g.alloc(tokens * rows);
        g.matmul(&g.upload(&x), tokens, &streamed, None, &mut out);
        let got_streamed = g.download(&out, tokens * rows);
        for (what, got) in [("upload_matrix", &got), ("upload_blocks", &got_streamed)] {
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "[{rows}, {cols}] × {tokens} rows through {what}"
            );
        }
    }
}

/// `--stream-experts always` on the GPU: the touched host experts of every layer copied
/// and computed beside the GPU's own give the all-GPU run's logits bit for bit (the same
/// codes, the same kernels), on the packed checkpoint under generated placements.
#[test]
fn streamed_host_experts_on_a_cuda_rank_give_the_all_gpu_bits() {
    use troupe::model::deepseek_v4::expert_streaming::StreamExperts;
    let name = "tiny-dsv4-packed";
    let r = reference(name);
    let all_gpu = DsV4Model::load_dir_on(gpu(false), &dir(name), false).unwrap();
    let cfg = all_gpu.cfg.clone();
    for seed in 0..3u64 {
        for (what, placement) in placements(&cfg, seed) {
            let model = streaming(
                gpu(false),
                &dir(name),
                placement,
                (false, StreamExperts::Always),
            )
            .unwrap();
            let prompt = &r.prompts[seed as usize % r.prompts.len()];
            for chunk in [prompt.len(), 7] {
                let want = logits(&all_gpu, prompt, chunk);
                let got = logits(&model, prompt, chunk);
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{what}, chunks of {chunk}: streamed experts' logits differ from the all-GPU run"
                );
            }
        }
    }
}

/// Decode steps with host experts recorded as CUDA graphs (the host's part as host
/// functions on the stream, `HostCalls`) give the eager run's logits and expert counts bit
/// for bit, and replay: generated placements, batch sizes and prompts.
#[test]
fn recorded_decode_steps_with_host_experts_replay_the_eager_bits() {
    use common::dsv4_host::batch_decode;
    use troupe::sampling::splitmix64;
    let name = "tiny-dsv4-packed";
    let r = reference(name);
    let cfg = DsV4Model::load_dir(&dir(name)).unwrap().cfg;
    let steps = 6;
    for seed in 0..3u64 {
        let rows = 1 + (splitmix64(seed ^ 0x77) % 9) as usize;
        let prompts: Vec<Vec<u32>> = (0..rows)
            .map(|i| {
                let p = &r.prompts[(seed as usize + i) % r.prompts.len()];
                p[..1 + (splitmix64(seed ^ i as u64) as usize) % p.len()].to_vec()
            })
            .collect();
        for (what, placement) in placements(&cfg, seed) {
            let eager = with_host_experts(gpu(false), &dir(name), placement.clone(), false);
            let mut graphs = CudaBackend::new(0, false, true).expect("a GPU");
            graphs.host_calls_in_steps = true;
            let recorded = with_host_experts(graphs, &dir(name), placement, false);
            let (want, want_counts) = batch_decode(&eager, &prompts, steps, seed);
            let (got, got_counts) = batch_decode(&recorded, &prompts, steps, seed);
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{what}, {rows} rows: recorded steps' logits differ from the eager run's"
            );
            assert_eq!(
                got_counts, want_counts,
                "{what}, {rows} rows: expert counts"
            );
            // A shape's first step runs eagerly, its second is captured and replayed (the
            // indexer's span, part of the shape, may grow once in these steps).
            let replayed = recorded.backend.replayed_steps();
            assert!(
                replayed >= 2,
                "{what}, {rows} rows: {replayed} of {steps} steps replayed"
            );
        }
    }
}

/// A recorded step whose host call comes early and is followed by more work than the
/// stream's queue holds (the whole V4-Flash at batch 32: 25 host layers, then 18 more):
/// its launch must not hold up the thread that serves the call, or the device waits on
/// that thread until its waits give up (30 s each, then a `DeviceGaveUp` error here).
#[test]
fn a_long_recorded_step_with_an_early_host_call_is_served_while_it_launches() {
    use troupe::kernels::deepseek_v4::DsV4Kernels;
    use troupe::kernels::{Backend, StepRecorder};
    let mut b = CudaBackend::new(0, false, true).expect("a GPU");
    b.host_calls_in_steps = true;
    let calls = b.host_calls().expect("host calls are on");
    let (n, after) = (64usize, 20_000usize);
    let x: Vec<f32> = (0..n).map(|i| (i as f32).sin()).collect();
    let xs = b.upload(&x);
    let ids = b.upload_ids(&[5, 2]);
    calls.reserve_host_calls(n, 2, n);
    let (mut out, mut acc, one) = (
        b.scratch(n),
        b.upload(&vec![0.0; n]),
        b.upload(&vec![1.0; n]),
    );
    // Eager, recorded, then replayed twice.
    for step in 1..=4usize {
        let mut body = || {
            // As the model does: an eager step computes its host part inline.
            if calls.recording() {
                calls.begin_host_call(7, &xs, n, &ids, 2).unwrap();
                calls.end_host_call(&mut out, n).unwrap();
            } else {
                let v = b.download(&xs, n);
                out = b.upload(&v.iter().map(|v| 2.0 * v + 52.0).collect::<Vec<_>>());
            }
            for _ in 0..after {
                b.add(&mut acc, &one, n);
            }
            b.add(&mut acc, &out, n);
        };
        b.run_recorded(0x5eed, &mut body);
        let served = calls
            .serve_host_calls(&mut |tag, x, ids, ys| {
                assert_eq!(tag, 7);
                for (y, v) in ys[..n].iter_mut().zip(&x[..n]) {
                    *y = 2.0 * v + (ids[0] * 10 + ids[1]) as f32;
                }
            })
            .unwrap_or_else(|e| panic!("step {step}: {e}"));
        assert_eq!(
            served,
            usize::from(step > 1),
            "step {step}: a call a recorded step"
        );
        let got = b.download(&acc, n);
        for (i, (g, v)) in got.iter().zip(&x).enumerate() {
            let want = (step * after) as f32 + step as f32 * (2.0 * v + 52.0);
            assert!(
                (g - want).abs() <= 1e-3 * want.abs(),
                "step {step}, [{i}]: {g} vs {want}"
            );
        }
    }
}
