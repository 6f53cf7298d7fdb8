//! DeepSeek-V4's MoE routing on the CPU: routed experts picked by a frozen token table
//! (hash layers) or by the top-k of biased router scores, weighted by the normalised
//! unbiased scores times the routed scaling.

use super::super::torch_topk::torch_top_k;
use super::{score, sigmoid};
use crate::kernels::deepseek_v4::Scoring;

pub(super) fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

#[allow(clippy::too_many_arguments)]
pub(super) fn route(
    chosen: &mut [u32],
    weights: &mut [f32],
    logits: &[f32],
    token_ids: &[u32],
    tid2eid: Option<&[u32]>,
    bias: Option<&[f32]>,
    scoring: Scoring,
    tokens: usize,
    num_experts: usize,
    k: usize,
    scaling: f32,
) {
    let mut s = vec![0.0f32; num_experts];
    for t in 0..tokens {
        s.copy_from_slice(&logits[t * num_experts..(t + 1) * num_experts]);
        score(&mut s, scoring);
        let picked: Vec<usize> = match (tid2eid, bias) {
            (Some(table), _) => {
                let tok = token_ids[t] as usize;
                table[tok * k..(tok + 1) * k]
                    .iter()
                    .map(|&e| e as usize)
                    .collect()
            }
            (None, Some(bias)) => {
                let biased: Vec<f32> = s.iter().zip(bias).map(|(a, b)| a + b).collect();
                torch_top_k(&biased, k, false)
            }
            (None, None) => torch_top_k(&s, k, false),
        };
        let total: f32 = picked.iter().map(|&e| s[e]).sum::<f32>() + 1e-20;
        for (j, &e) in picked.iter().enumerate() {
            chosen[t * k + j] = e as u32;
            weights[t * k + j] = s[e] / total * scaling;
        }
    }
}
