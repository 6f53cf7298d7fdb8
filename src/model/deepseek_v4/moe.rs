//! DeepSeek-V4's MoE block: routed experts picked by a frozen token table (hash layers)
//! or by the top-k of biased router scores, weighted by the normalised unbiased scores
//! times the routed scaling, plus the shared expert; SwiGLU with clipped pre-activations.

use rayon::prelude::*;

use super::config::{DsV4Config, MlpKind};
use super::expert_parallel::ExpertShard;
use super::ops::{score, silu};
use super::torch_topk::torch_top_k;
use super::weights::{Expert, Moe};

/// `x` is `[tokens, hidden]` (the normed block input); returns `[tokens, hidden]` and adds
/// each routed expert's tokens to `expert_tokens`. In an expert-parallel group (`shard`)
/// the output holds only this rank's products: the group sums it.
pub fn moe(
    cfg: &DsV4Config,
    layer: usize,
    w: &Moe,
    x: &[f32],
    token_ids: &[u32],
    expert_tokens: &mut [u64],
    shard: Option<&ExpertShard>,
) -> Vec<f32> {
    let d = cfg.hidden_size;
    let tokens = x.len() / d;
    let k = cfg.num_experts_per_tok;
    let num_experts = cfg.num_routed_experts;
    let mut scores = w.router.apply(x);
    // Per expert: (token, weight) pairs routed to it.
    let mut routed: Vec<Vec<(usize, f32)>> = vec![Vec::new(); num_experts];
    for t in 0..tokens {
        let s = &mut scores[t * num_experts..(t + 1) * num_experts];
        score(s, cfg.scoring);
        let chosen: Vec<usize> = match cfg.mlp[layer] {
            MlpKind::HashMoe => {
                let table = w.tid2eid.as_ref().expect("hash layers carry their table");
                let tok = token_ids[t] as usize;
                table[tok * k..(tok + 1) * k]
                    .iter()
                    .map(|&e| e as usize)
                    .collect()
            }
            MlpKind::Moe => match &w.score_bias {
                Some(bias) => {
                    let biased: Vec<f32> = s.iter().zip(bias).map(|(a, b)| a + b).collect();
                    torch_top_k(&biased, k, false)
                }
                None => torch_top_k(s, k, false),
            },
        };
        let total: f32 = chosen.iter().map(|&e| s[e]).sum::<f32>() + 1e-20;
        for &e in &chosen {
            expert_tokens[e] += 1;
            if shard.is_none_or(|sh| sh.computes(layer, num_experts, e, t)) {
                routed[e].push((t, s[e] / total * cfg.routed_scaling_factor));
            }
        }
    }

    let mut out = if shard.is_none_or(ExpertShard::computes_shared) {
        expert(&w.shared, x, cfg.swiglu_limit)
    } else {
        vec![0.0; x.len()]
    };
    // Experts run in parallel; their outputs are added in expert order, so the sum's
    // order does not depend on the thread count.
    let outputs: Vec<(usize, Vec<f32>)> = routed
        .par_iter()
        .enumerate()
        .filter(|(_, assigned)| !assigned.is_empty())
        .map(|(e, assigned)| {
            let rows: Vec<f32> = assigned
                .iter()
                .flat_map(|&(t, _)| x[t * d..(t + 1) * d].iter().copied())
                .collect();
            (e, expert(&w.experts[e], &rows, cfg.swiglu_limit))
        })
        .collect();
    for (e, y) in outputs {
        for (i, &(t, weight)) in routed[e].iter().enumerate() {
            out[t * d..(t + 1) * d]
                .iter_mut()
                .zip(&y[i * d..(i + 1) * d])
                .for_each(|(o, v)| *o += weight * v);
        }
    }
    out
}

fn expert(w: &Expert, x: &[f32], limit: f32) -> Vec<f32> {
    let gate = w.gate.apply(x);
    let up = w.up.apply(x);
    let h: Vec<f32> = gate
        .iter()
        .zip(&up)
        .map(|(g, u)| silu(g.min(limit)) * u.clamp(-limit, limit))
        .collect();
    w.down.apply(&h)
}
