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
    argmax_rows, case, case_dirs, first_layers, logits, placements, with_host_experts,
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
