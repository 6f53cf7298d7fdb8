//! DeepSeek-V4's MoE routing on the CPU: routed experts picked by a frozen token table
//! (hash layers) or by the top-k of biased router scores, weighted by the normalised
//! unbiased scores times the routed scaling; the routed experts' products and their
//! combine.

use rayon::prelude::*;

use super::super::CpuBackend;
use super::super::matmul::matmul;
use super::super::packed_matmul::{MatJob, matmul_many};
use super::super::qmatrix::CpuMatrix;
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
    let active: Vec<(usize, Vec<usize>)> = by_expert
        .into_iter()
        .enumerate()
        .filter(|(_, rows)| !rows.is_empty())
        .collect();
    // Each expert's rows of `x`, gathered.
    let xs: Vec<Vec<f32>> = active
        .iter()
        .map(|(_, rows)| {
            rows.iter()
                .flat_map(|&pair| &x[pair / k * hidden..(pair / k + 1) * hidden])
                .copied()
                .collect()
        })
        .collect();
    let packed = active.iter().all(|(e, _)| {
        experts[*e]
            .iter()
            .all(|w| matches!(w, CpuMatrix::Packed { .. }))
    });
    let dims = (inter, hidden, limit);
    let ys_of = if packed && !invariant && flat_products() {
        products_flat(&active, &xs, experts, dims)
    } else {
        products_nested(&active, &xs, experts, dims, invariant)
    };
    ys[..pairs * hidden].fill(0.0);
    for ((_, rows), y) in active.iter().zip(&ys_of) {
        for (&pair, row) in rows.iter().zip(y.chunks_exact(hidden)) {
            ys[pair * hidden..(pair + 1) * hidden].copy_from_slice(row);
        }
    }
}

/// Each active expert's products (`active[i]`: its id and pairs; `xs[i]` its rows), as
/// one task an expert, its matrices' rows split inside it.
fn products_nested(
    active: &[(usize, Vec<usize>)],
    xs: &[Vec<f32>],
    experts: &ExpertMatrices<'_, CpuBackend>,
    (inter, hidden, limit): (usize, usize, f32),
    invariant: bool,
) -> Vec<Vec<f32>> {
    active
        .par_iter()
        .zip(xs)
        .map(|((e, rows), xs)| {
            let n = rows.len();
            let [gate_w, up_w, down_w] = experts[*e];
            let (mut gate, mut up) = (vec![0.0f32; n * inter], vec![0.0f32; n * inter]);
            matmul(xs, n, gate_w, &mut gate, invariant);
            matmul(xs, n, up_w, &mut up, invariant);
            swiglu(&mut gate, &up, limit);
            let mut y = vec![0.0f32; n * hidden];
            matmul(&gate, n, down_w, &mut y, invariant);
            y
        })
        .collect()
}

/// `TROUPE_HOST_MOE=flat`: the products as two flat sweeps over every active expert's rows
/// (`products_flat`), to measure against one task an expert (the default), the same bits
/// either way. They lost where measured (BENCHMARKS.md): on two cores no faster at decode
/// and 1.3–1.6× slower at a 512-token prefill; with the 16 threads of an H100 machine's
/// host the whole V4-Flash decoded 1.07–1.08× slower with them.
fn flat_products() -> bool {
    std::env::var_os("TROUPE_HOST_MOE").is_some_and(|v| v == "flat")
}

/// Packed experts' products as two flat sweeps over every active expert's weight rows
/// (`matmul_many`): all gates and ups, then all downs. At decode a layer has a few
/// experts of one row each; split expert by expert, a thread that finished its share of
/// one expert's matrix may wait on that matrix's slowest task before the next begins.
fn products_flat(
    active: &[(usize, Vec<usize>)],
    xs: &[Vec<f32>],
    experts: &ExpertMatrices<'_, CpuBackend>,
    (inter, hidden, limit): (usize, usize, f32),
) -> Vec<Vec<f32>> {
    let rows_of = |i: usize| active[i].1.len();
    let mut gates: Vec<Vec<f32>> = (0..active.len())
        .map(|i| vec![0.0; rows_of(i) * inter])
        .collect();
    let mut ups = gates.clone();
    let mut jobs = Vec::with_capacity(2 * active.len());
    for (i, (gate, up)) in gates.iter_mut().zip(&mut ups).enumerate() {
        let [gate_w, up_w, _] = experts[active[i].0];
        let (x, m) = (&xs[i][..], rows_of(i));
        jobs.push(MatJob {
            x,
            m,
            w: gate_w,
            out: gate,
        });
        jobs.push(MatJob {
            x,
            m,
            w: up_w,
            out: up,
        });
    }
    matmul_many(&mut jobs);
    drop(jobs);
    gates
        .par_iter_mut()
        .zip(&ups)
        .for_each(|(g, u)| swiglu(g, u, limit));
    let mut ys: Vec<Vec<f32>> = (0..active.len())
        .map(|i| vec![0.0; rows_of(i) * hidden])
        .collect();
    let mut jobs: Vec<MatJob<'_>> = ys
        .iter_mut()
        .enumerate()
        .map(|(i, y)| MatJob {
            x: &gates[i],
            m: rows_of(i),
            w: experts[active[i].0][2],
            out: y,
        })
        .collect();
    matmul_many(&mut jobs);
    drop(jobs);
    ys
}

/// `gate ← silu(min(gate, limit)) · clamp(up, ±limit)`, DeepSeek-V4's clamped SwiGLU.
fn swiglu(gate: &mut [f32], up: &[f32], limit: f32) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = silu(g.min(limit)) * u.clamp(-limit, limit);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::quant::GgmlType;
    use crate::kernels::{HostData, HostMatrix};
    use crate::sampling::splitmix64;

    /// A random MXFP4 matrix: codes anywhere, E8M0 exponents near 1.
    fn mxfp4(rows: usize, cols: usize, seed: u64) -> CpuMatrix {
        let ty = GgmlType::MXFP4;
        let mut bytes: Vec<u8> = (0..rows * cols / ty.block_len() * ty.block_bytes())
            .map(|i| splitmix64(seed ^ (i as u64) << 8) as u8)
            .collect();
        for blk in bytes.chunks_exact_mut(ty.block_bytes()) {
            blk[0] = 122 + blk[0] % 8;
        }
        CpuMatrix::from_host(HostMatrix {
            rows,
            cols,
            data: HostData::Quantized {
                ggml_type: ty,
                bytes,
            },
        })
    }

    #[test]
    fn flat_sweeps_give_each_experts_products_the_bits_of_one_task_an_expert() {
        let mut rng = 11u64;
        let mut draw = |n: u64| {
            rng = splitmix64(rng);
            rng % n
        };
        for case in 0..12u64 {
            let (inter, hidden) = (32 * (1 + draw(4)) as usize, 32 * (1 + draw(5)) as usize);
            let num_experts = 2 + draw(6) as usize;
            let mats: Vec<[CpuMatrix; 3]> = (0..num_experts as u64)
                .map(|e| {
                    let seed = case * 100 + e * 3;
                    [
                        mxfp4(inter, hidden, seed),
                        mxfp4(inter, hidden, seed + 1),
                        mxfp4(hidden, inter, seed + 2),
                    ]
                })
                .collect();
            let experts: Vec<[&CpuMatrix; 3]> = mats.iter().map(|[g, u, d]| [g, u, d]).collect();
            // Decode-sized and prefill-sized groups: 1 to 12 rows an expert.
            let mut active: Vec<(usize, Vec<usize>)> = Vec::new();
            for e in 0..num_experts {
                if draw(4) > 0 {
                    active.push((e, (0..1 + draw(12) as usize).collect()));
                }
            }
            let xs: Vec<Vec<f32>> = active
                .iter()
                .map(|(_, rows)| {
                    (0..rows.len() * hidden)
                        .map(|_| draw(2001) as f32 / 1000.0 - 1.0)
                        .collect()
                })
                .collect();
            let dims = (inter, hidden, 7.0);
            let flat = products_flat(&active, &xs, &experts, dims);
            let nested = products_nested(&active, &xs, &experts, dims, false);
            assert_eq!(flat.len(), active.len());
            for (f, n) in flat.iter().zip(&nested) {
                assert!(
                    f.iter().any(|v| *v != 0.0),
                    "case {case}: products all zero"
                );
                let (f, n): (Vec<u32>, Vec<u32>) = (
                    f.iter().map(|v| v.to_bits()).collect(),
                    n.iter().map(|v| v.to_bits()).collect(),
                );
                assert_eq!(f, n, "case {case}: {inter}x{hidden}");
            }
        }
    }
}
