//! What DeepSeek-V4's weights take on the device and run in, by tensor group: the model
//! card of `--stats` and the log (MXFP4 routed experts and FP8 projections stay packed on
//! a backend with kernels for them).

use super::weights::{Attention, DsV4Weights, Expert};
use crate::kernels::deepseek_v4::DsV4Kernels;
use crate::model::weights::WeightFootprint;

impl<B: DsV4Kernels> DsV4Weights<B> {
    pub fn footprint(&self, backend: &B) -> WeightFootprint {
        let mut out = WeightFootprint::default();
        let mut group = |name, matrices| out.add_group(backend, name, matrices);
        group(
            "attn",
            self.layers
                .iter()
                .flat_map(|l| attention(&l.attn))
                .collect(),
        );
        group(
            "routed_experts",
            self.layers
                .iter()
                .flat_map(|l| l.moe.experts.iter().flatten().flat_map(expert::<B>))
                .collect(),
        );
        group(
            "shared_experts",
            self.layers
                .iter()
                .flat_map(|l| expert(&l.moe.shared))
                .collect(),
        );
        group(
            "router",
            self.layers.iter().map(|l| &l.moe.router).collect(),
        );
        group(
            "mhc",
            self.layers
                .iter()
                .flat_map(|l| [&l.attn_hc.fn_, &l.ffn_hc.fn_])
                .chain([&self.hc_head.fn_])
                .collect(),
        );
        group("head", vec![&self.head]);
        out
    }
}

fn expert<B: DsV4Kernels>(e: &Expert<B>) -> [&B::Matrix; 3] {
    [&e.gate, &e.up, &e.down]
}

/// An attention block's projections, its compressor's and its indexer's.
fn attention<B: DsV4Kernels>(a: &Attention<B>) -> Vec<&B::Matrix> {
    let mut m = vec![&a.q_a, &a.q_b, &a.kv, &a.o_b];
    m.extend(a.o_a.as_ref());
    for c in a
        .compressor
        .iter()
        .chain(a.indexer.iter().map(|i| &i.compressor))
    {
        m.extend([&c.kv, &c.gate]);
    }
    for i in a.indexer.iter() {
        m.extend([&i.q_b, &i.weights_proj]);
    }
    m
}
