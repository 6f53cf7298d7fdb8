//! `moe::moe` on the GPU: the router's choice is made on the device and read back, the
//! host groups the (token, expert) rows by expert, each active expert runs its GEMMs on its
//! contiguous rows, and each token adds its experts' outputs in expert order after the
//! shared expert's, as the reference does.

use cudarc::driver::CudaSlice;

use super::weights::{DeviceExpert, DeviceMoe};
use super::{DsV4Cuda, Step};
use crate::kernels::Backend;
use crate::kernels::cuda::CudaBackend;
use crate::model::deepseek_v4::config::{MlpKind, Scoring};

pub(super) fn moe(
    model: &DsV4Cuda,
    b: &CudaBackend,
    step: &Step,
    l: usize,
    w: &DeviceMoe,
    x: &CudaSlice<f32>,
    expert_tokens: &mut [u64],
) -> CudaSlice<f32> {
    let cfg = &model.cfg;
    let t = step.positions.len();
    let (d, k, num_experts) = (
        cfg.hidden_size,
        cfg.num_experts_per_tok,
        cfg.num_routed_experts,
    );
    let mut logits = b.alloc_written(t * num_experts);
    b.matmul(x, t, &w.router, None, &mut logits);
    let mut chosen = b.alloc_u32s(t * k);
    let mut weights = b.alloc_written(t * k);
    let scoring = match cfg.scoring {
        Scoring::SqrtSoftplus => 0,
        Scoring::Sigmoid => 1,
        Scoring::Softmax => 2,
    };
    let hashed = cfg.mlp[l] == MlpKind::HashMoe;
    b.dsv4_moe_route(
        &mut chosen,
        &mut weights,
        &logits,
        &step.token_ids,
        w.tid2eid.as_ref().filter(|_| hashed),
        w.score_bias.as_ref().filter(|_| !hashed),
        scoring,
        t,
        num_experts,
        k,
        cfg.routed_scaling_factor,
    );
    let chosen = b.download_u32s(&chosen, t * k);

    // Rows grouped by expert; per token, its (row, router slot) pairs in expert order.
    let mut by_expert: Vec<Vec<(usize, usize)>> = vec![Vec::new(); num_experts];
    for (i, &e) in chosen.iter().enumerate() {
        by_expert[e as usize].push((i / k, i % k));
        expert_tokens[e as usize] += 1;
    }
    let mut source_rows = Vec::with_capacity(t * k);
    let mut order: Vec<Vec<u32>> = vec![Vec::with_capacity(2 * k); t];
    let mut spans = Vec::new();
    for (e, rows) in by_expert.iter().enumerate() {
        if rows.is_empty() {
            continue;
        }
        spans.push((e, source_rows.len(), rows.len()));
        for &(token, slot) in rows {
            order[token].extend_from_slice(&[source_rows.len() as u32, slot as u32]);
            source_rows.push(token);
        }
    }
    let n = source_rows.len();
    let inter = cfg.moe_intermediate_size;
    let mut xs = b.alloc_written(n * d);
    b.gather_rows(x, d, &source_rows, &mut xs);
    let mut gate = b.alloc_written(n * inter);
    let mut up = b.alloc_written(n * inter);
    for &(e, row0, rows) in &spans {
        let ex = &w.experts[e];
        b.gemm_rows(&xs, row0, rows, &ex.gate, &mut gate, row0);
        b.gemm_rows(&xs, row0, rows, &ex.up, &mut up, row0);
    }
    let mut h = b.alloc_written(n * inter);
    b.dsv4_swiglu(&mut h, &gate, &up, n * inter, cfg.swiglu_limit);
    let mut ys = b.alloc_written(n * d);
    for &(e, row0, rows) in &spans {
        b.gemm_rows(&h, row0, rows, &w.experts[e].down, &mut ys, row0);
    }

    let mut out = expert(b, &w.shared, x, t, inter, cfg.swiglu_limit);
    let order: Vec<u32> = order.into_iter().flatten().collect();
    let order = b.upload_u32s(&order);
    b.dsv4_moe_combine(&mut out, &ys, &order, &weights, t, k, d);
    out
}

fn expert(
    b: &CudaBackend,
    w: &DeviceExpert,
    x: &CudaSlice<f32>,
    t: usize,
    inter: usize,
    limit: f32,
) -> CudaSlice<f32> {
    let mut gate = b.alloc_written(t * inter);
    b.matmul(x, t, &w.gate, None, &mut gate);
    let mut up = b.alloc_written(t * inter);
    b.matmul(x, t, &w.up, None, &mut up);
    let mut h = b.alloc_written(t * inter);
    b.dsv4_swiglu(&mut h, &gate, &up, t * inter, limit);
    let mut y = b.alloc_written(t * w.down.rows);
    b.matmul(&h, t, &w.down, None, &mut y);
    y
}
