//! DeepSeek-V4's MoE routing on the CPU: routed experts picked by a frozen token table
//! (hash layers) or by the top-k of biased router scores, weighted by the normalised
//! unbiased scores times the routed scaling; the routed experts' products and their
//! combine.

use rayon::prelude::*;

use super::super::CpuBackend;
use super::super::matmul::matmul;
use super::super::torch_topk::torch_top_k;
use super::{score, sigmoid};
use crate::kernels::deepseek_v4::{ExpertMatrices, ExpertOwners, Scoring};

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

/// `DsV4Kernels::dsv4_routed_experts`: pairs grouped by expert on the host, each expert's
/// rows through its three GEMMs (experts in parallel, each writing its own pairs' rows).
#[allow(clippy::too_many_arguments)]
pub(super) fn routed_experts(
    b: &CpuBackend,
    ys: &mut [f32],
    x: &[f32],
    chosen: &[u32],
    experts: &ExpertMatrices<'_, CpuBackend>,
    owners: Option<&ExpertOwners<'_, CpuBackend>>,
    counts: &mut [u32],
    (tokens, k, limit): (usize, usize, f32),
) {
    let Some(first) = experts.first() else {
        return;
    };
    let (inter, hidden) = (first[0].rows(), first[0].cols());
    let pairs = tokens * k;
    let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); experts.len()];
    for (pair, &e) in chosen[..pairs].iter().enumerate() {
        counts[e as usize] += 1;
        if owners.is_none_or(|o| owns(o, e as usize, pair / k)) {
            by_expert[e as usize].push(pair);
        }
    }
    let invariant = b.batch_invariant;
    let products: Vec<(Vec<usize>, Vec<f32>)> = by_expert
        .into_par_iter()
        .enumerate()
        .filter(|(_, rows)| !rows.is_empty())
        .map(|(e, rows)| {
            let n = rows.len();
            let xs: Vec<f32> = rows
                .iter()
                .flat_map(|&pair| &x[pair / k * hidden..(pair / k + 1) * hidden])
                .copied()
                .collect();
            let [gate_w, up_w, down_w] = experts[e];
            let (mut gate, mut up) = (vec![0.0f32; n * inter], vec![0.0f32; n * inter]);
            matmul(&xs, n, gate_w, &mut gate, invariant);
            matmul(&xs, n, up_w, &mut up, invariant);
            for (g, &u) in gate.iter_mut().zip(&up) {
                *g = silu(g.min(limit)) * u.clamp(-limit, limit);
            }
            let mut y = vec![0.0f32; n * hidden];
            matmul(&gate, n, down_w, &mut y, invariant);
            (rows, y)
        })
        .collect();
    ys[..pairs * hidden].fill(0.0);
    for (rows, y) in products {
        for (&pair, row) in rows.iter().zip(y.chunks_exact(hidden)) {
            ys[pair * hidden..(pair + 1) * hidden].copy_from_slice(row);
        }
    }
}

fn owns(o: &ExpertOwners<'_, CpuBackend>, expert: usize, token: usize) -> bool {
    let entry = &o.table[expert * (1 + o.replicas)..(expert + 1) * (1 + o.replicas)];
    entry[1 + token % entry[0] as usize] as usize == o.rank
}

/// `DsV4Kernels::dsv4_moe_combine`: each token's slots in increasing expert id.
pub(super) fn combine(
    out: &mut [f32],
    ys: &[f32],
    chosen: &[u32],
    weights: &[f32],
    (tokens, k, hidden): (usize, usize, usize),
) {
    let mut slots: Vec<usize> = Vec::with_capacity(k);
    for t in 0..tokens {
        slots.clear();
        slots.extend(0..k);
        slots.sort_by_key(|&j| chosen[t * k + j]);
        let o = &mut out[t * hidden..(t + 1) * hidden];
        for &j in &slots {
            let (w, pair) = (weights[t * k + j], t * k + j);
            o.iter_mut()
                .zip(&ys[pair * hidden..(pair + 1) * hidden])
                .for_each(|(o, v)| *o += w * v);
        }
    }
}
