//! DeepSeek-V4's MoE block: the router's choice is made on the device and read back, the
//! host groups the (token, expert) rows by expert, each active expert runs its GEMMs on
//! its contiguous rows, and each token adds its experts' outputs in expert order after the
//! shared expert's. SwiGLU with clipped pre-activations. In an expert-parallel group each
//! rank computes only its products and the group sums the output.

use super::block::Pass;
use super::config::MlpKind;
use super::expert_parallel::ExpertGroup;
use super::weights::{Expert, Moe};
use crate::kernels::deepseek_v4::DsV4Kernels;

/// `x` is `[rows, hidden]` (the normed block input); returns `[rows, hidden]` and adds
/// each routed expert's tokens to `expert_tokens`.
pub fn moe<B: DsV4Kernels>(
    p: &Pass<'_, B>,
    layer: usize,
    w: &Moe<B>,
    x: &B::Buf,
    expert_tokens: &mut [u64],
    group: Option<&mut ExpertGroup<B>>,
) -> B::Buf {
    let (b, cfg) = (p.b, p.cfg);
    let t = p.plan.num_rows();
    let (d, k, num_experts) = (
        cfg.hidden_size,
        cfg.num_experts_per_tok,
        cfg.num_routed_experts,
    );
    let mut logits = b.scratch(t * num_experts);
    b.matmul(x, t, &w.router, None, &mut logits);
    let mut chosen = b.alloc_ids(t * k);
    let mut weights = b.scratch(t * k);
    let hashed = cfg.mlp[layer] == MlpKind::HashMoe;
    b.dsv4_moe_route(
        &mut chosen,
        &mut weights,
        &logits,
        &p.plan.token_ids,
        w.tid2eid.as_ref().filter(|_| hashed),
        w.score_bias.as_ref().filter(|_| !hashed),
        cfg.scoring,
        t,
        num_experts,
        k,
        cfg.routed_scaling_factor,
    );
    let chosen = b.download_ids(&chosen, t * k);

    // Rows grouped by expert; per token, its (row, router slot) pairs in expert order.
    let shard = group.as_ref().map(|g| &g.shard);
    let mut by_expert: Vec<Vec<(usize, usize)>> = vec![Vec::new(); num_experts];
    let mut elsewhere = Vec::new();
    for (i, &e) in chosen.iter().enumerate() {
        let (token, slot, e) = (i / k, i % k, e as usize);
        expert_tokens[e] += 1;
        if shard.is_none_or(|sh| sh.computes(layer, num_experts, e, token)) {
            by_expert[e].push((token, slot));
        } else {
            elsewhere.push((token, slot));
        }
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
    // Another rank's products read a zero row past the computed ones: adding 0 leaves
    // the sum as it is, and every token keeps its k pairs.
    let zero_row = !elsewhere.is_empty();
    for (token, slot) in elsewhere {
        order[token].extend_from_slice(&[n as u32, slot as u32]);
    }
    let inter = cfg.moe_intermediate_size;
    let mut ys = if zero_row {
        b.alloc((n + 1) * d)
    } else {
        b.scratch(n * d)
    };
    if n > 0 {
        let mut xs = b.scratch(n * d);
        b.gather_rows(x, d, &source_rows, &mut xs);
        let groups = |m: fn(&Expert<B>) -> &B::Matrix| -> Vec<(&B::Matrix, usize, usize)> {
            spans
                .iter()
                .map(|&(e, row0, rows)| (m(&w.experts[e]), row0, rows))
                .collect()
        };
        let mut gate = b.scratch(n * inter);
        b.dsv4_gemm_row_groups(&xs, &groups(|e| &e.gate), &mut gate);
        let mut up = b.scratch(n * inter);
        b.dsv4_gemm_row_groups(&xs, &groups(|e| &e.up), &mut up);
        let mut h = b.scratch(n * inter);
        b.dsv4_swiglu(&mut h, &gate, &up, n * inter, cfg.swiglu_limit);
        b.dsv4_gemm_row_groups(&h, &groups(|e| &e.down), &mut ys);
    }

    let mut out = if shard.is_none_or(|sh| sh.computes_shared()) {
        expert(b, &w.shared, x, (t, inter, d), cfg.swiglu_limit)
    } else {
        b.alloc(t * d)
    };
    let order: Vec<u32> = order.into_iter().flatten().collect();
    b.dsv4_moe_combine(&mut out, &ys, &b.upload_ids(&order), &weights, t, k, d);
    if let Some(g) = group {
        g.combine(b, &mut out, t * d);
    }
    out
}

fn expert<B: DsV4Kernels>(
    b: &B,
    w: &Expert<B>,
    x: &B::Buf,
    (t, inter, hidden): (usize, usize, usize),
    limit: f32,
) -> B::Buf {
    let mut gate = b.scratch(t * inter);
    b.matmul(x, t, &w.gate, None, &mut gate);
    let mut up = b.scratch(t * inter);
    b.matmul(x, t, &w.up, None, &mut up);
    let mut h = b.scratch(t * inter);
    b.dsv4_swiglu(&mut h, &gate, &up, t * inter, limit);
    let mut y = b.scratch(t * hidden);
    b.matmul(&h, t, &w.down, None, &mut y);
    y
}
