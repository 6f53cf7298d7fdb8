//! DeepSeek-V4's MoE block: the router's choice is made on the device and stays there —
//! the backend's grouped expert kernels read it (`dsv4_routed_experts`), each (token, slot)
//! pair gets its expert's product, and each token adds its experts' outputs in expert
//! order after the shared expert's. SwiGLU with clipped pre-activations. In an
//! expert-parallel group each rank computes only its products and the group sums the
//! output.

use super::config::MlpKind;
use super::expert_parallel::ExpertGroup;
use super::pass::Pass;
use super::weights::{Expert, Moe};
use crate::kernels::deepseek_v4::{DsV4Kernels, ExpertOwners};

/// `x` is `[rows, hidden]` (the normed block input); returns `[rows, hidden]` and adds
/// each routed pair to `counts[layer · experts + expert]`.
pub fn moe<B: DsV4Kernels>(
    p: &Pass<'_, B>,
    layer: usize,
    w: &Moe<B>,
    x: &B::Buf,
    counts: &mut B::Ids,
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

    let shard = group.as_ref().map(|g| &g.shard);
    let owner_table = shard.map(|sh| sh.owner_table(layer, num_experts));
    let table_ids = owner_table.as_ref().map(|(ids, _)| b.upload_ids(ids));
    let host = p.host.filter(|h| h.has_layer(layer));
    debug_assert!(
        host.is_none() || shard.is_none(),
        "host experts in a group are refused at load"
    );
    let owners = owner_table
        .as_ref()
        .zip(table_ids.as_ref())
        .map(|((_, replicas), table)| ExpertOwners {
            table,
            replicas: *replicas,
            rank: shard.expect("a table comes from a shard").shard.rank,
        })
        .or_else(|| host.and_then(|h| h.device_owners(layer)));
    // In a recorded step the host's part is a call on the device's stream (`HostCalls`):
    // its inputs go out before the device's experts are queued and its rows come back
    // after the shared expert's, so the CPU computes while the device does.
    let deferred = host.and(p.host_calls).filter(|c| c.recording());
    if let Some(calls) = deferred {
        calls
            .begin_host_call(layer as u32, x, t * d, &chosen, t * k)
            .unwrap_or_else(|e| panic!("layer {layer}: {e}"));
    }
    // Else the host's inputs are read before the device's experts are queued, to the
    // same end.
    let chosen_host = host
        .filter(|_| deferred.is_none())
        .map(|_| b.download_ids(&chosen, t * k));
    // Or the host's touched experts come to the device and it computes every pair.
    let streamed = host.zip(chosen_host.as_ref()).and_then(|(h, chosen_host)| {
        let copied = h.stream(layer, b, chosen_host)?;
        if super::layer_clock::enabled() {
            let started = std::time::Instant::now();
            super::layer_clock::settle(b, x);
            h.waited_on_copies(started.elapsed().as_secs_f64());
        }
        Some(copied)
    });
    let mut host_inputs = chosen_host
        .filter(|_| streamed.is_none())
        .map(|chosen_host| (b.download(x, t * d), chosen_host));
    let mut ys = b.scratch(t * k * d);
    let all_here = streamed.as_ref().and_then(|s| {
        let held = w
            .experts
            .iter()
            .zip(s)
            .map(|(own, copied)| own.as_ref().or(copied.as_ref()));
        let stand_in = held.clone().flatten().next()?;
        let experts: Vec<_> = held
            .map(|e| {
                let e = e.unwrap_or(stand_in);
                [&e.gate, &e.up, &e.down]
            })
            .collect();
        let table = b.dsv4_expert_table(&experts).ok()?;
        Some((experts, table))
    });
    if let Some((experts, table)) = &all_here {
        b.dsv4_routed_experts(
            &mut ys,
            x,
            &chosen,
            experts,
            table,
            None,
            counts,
            layer * num_experts,
            t,
            k,
            cfg.swiglu_limit,
        );
        host_inputs = None;
    } else if let Some(table) = &w.table {
        b.dsv4_routed_experts(
            &mut ys,
            x,
            &chosen,
            &super::expert_table::matrices(&w.experts),
            table,
            owners.as_ref(),
            counts,
            layer * num_experts,
            t,
            k,
            cfg.swiglu_limit,
        );
    }

    let inter = cfg.moe_intermediate_size;
    let mut out = if shard.is_none_or(|sh| sh.computes_shared()) {
        expert(b, &w.shared, x, (t, inter, d), cfg.swiglu_limit)
    } else {
        b.alloc(t * d)
    };
    if let (Some(h), Some((x_host, chosen_host))) = (host, host_inputs) {
        let host_ys = h.compute(layer, &x_host, &chosen_host, (t, k, d, cfg.swiglu_limit));
        if w.table.is_some() {
            // The device's rows of the host's pairs are zeros: the sum is the host's row.
            let mut on_device = b.scratch(t * k * d);
            b.write_floats(&mut on_device, 0, &host_ys);
            b.add(&mut ys, &on_device, t * k * d);
        } else {
            b.write_floats(&mut ys, 0, &host_ys);
        }
    }
    if let Some(calls) = deferred {
        let mut from_host = b.scratch(t * k * d);
        calls
            .end_host_call(&mut from_host, t * k * d)
            .unwrap_or_else(|e| panic!("layer {layer}: {e}"));
        if w.table.is_some() {
            b.add(&mut ys, &from_host, t * k * d);
        } else {
            ys = from_host;
        }
    }
    b.dsv4_moe_combine(&mut out, &ys, &chosen, &weights, t, k, d);
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
