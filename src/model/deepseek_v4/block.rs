//! One DeepSeek-V4 block over the step's residual streams (`[rows, n_hc, hidden]`), in
//! place: manifold-constrained hyper-connections (mHC) around attention, then around the
//! MoE. Before each, the streams collapse into its input with weights `pre`; after it, its
//! output spreads back with weights `post` onto the streams mixed by `comb`, a matrix
//! Sinkhorn-projected toward doubly stochastic so depth cannot blow the norm up.

use super::cache::DsV4Cache;
use super::config::DsV4Config;
use super::expert_parallel::ExpertGroup;
use super::pass::{Consts, Pass};
use super::weights::{HyperConnection, Layer};
use super::{attention, moe};
use crate::kernels::deepseek_v4::DsV4Kernels;

/// Block `layer` (of `cache`'s layers) over `streams`; its MoE adds its tokens per routed
/// expert to `counts` (`[layers, experts]` on the device) and is summed over `group` when
/// there is one.
pub fn block<B: DsV4Kernels>(
    p: &Pass<'_, B>,
    layer: usize,
    w: &Layer<B>,
    cache: &mut DsV4Cache<B>,
    streams: &mut B::Buf,
    counts: &mut B::Ids,
    group: Option<&mut ExpertGroup<B>>,
) {
    let (b, cfg) = (p.b, p.cfg);
    let t = p.plan.num_rows();
    let (d, n) = (cfg.hidden_size, cfg.hc_mult);
    let mut mix = Mix::new(b, t, n, d);
    let mut x = b.scratch(t * d);

    mix.mix(p, &w.attn_hc, streams);
    b.rms_norm(&mix.collapsed, &w.attn_norm, cfg.rms_norm_eps, t, d, &mut x);
    let geometry = (cache.block_size, cache.ring_len(), cache.ring_format());
    let y = attention::attention(p, layer, &w.attn, &mut cache.layers[layer], geometry, &x);
    b.dsv4_mhc_merge(streams, &mix.post, &mix.comb, &y, t, n, d);

    mix.mix(p, &w.ffn_hc, streams);
    b.rms_norm(&mix.collapsed, &w.ffn_norm, cfg.rms_norm_eps, t, d, &mut x);
    let y = moe::moe(p, layer, &w.moe, &x, counts, group);
    b.dsv4_mhc_merge(streams, &mix.post, &mix.comb, &y, t, n, d);
}

/// One mHC mapping's weights for every row, and the collapsed block input.
struct Mix<B: DsV4Kernels> {
    flat: B::Buf,
    mixes: B::Buf,
    post: B::Buf,
    comb: B::Buf,
    collapsed: B::Buf,
}

impl<B: DsV4Kernels> Mix<B> {
    fn new(b: &B, t: usize, n: usize, d: usize) -> Self {
        Mix {
            flat: b.scratch(t * n * d),
            mixes: b.scratch(t * (2 + n) * n),
            post: b.scratch(t * n),
            comb: b.scratch(t * n * n),
            collapsed: b.scratch(t * d),
        }
    }

    fn mix(&mut self, p: &Pass<'_, B>, hc: &HyperConnection<B>, streams: &B::Buf) {
        let (b, cfg) = (p.b, p.cfg);
        let t = p.plan.num_rows();
        let (d, n) = (cfg.hidden_size, cfg.hc_mult);
        let eps = cfg.rms_norm_eps;
        b.rms_norm_into_gemm(streams, &p.consts.ones, eps, t, n * d, &mut self.flat);
        b.matmul(&self.flat, t, &hc.fn_, None, &mut self.mixes);
        b.dsv4_mhc_mix(
            &self.mixes,
            streams,
            &hc.base,
            &hc.scale,
            &mut self.post,
            &mut self.comb,
            &mut self.collapsed,
            t,
            n,
            d,
            cfg.hc_sinkhorn_iters,
            cfg.hc_eps,
        );
    }
}

/// The head's collapse of last-layer streams (`[rows, n_hc, hidden]`, `pre` weights only)
/// normed by `norm`: `[rows, hidden]`.
pub fn hyper_head<B: DsV4Kernels>(
    b: &B,
    cfg: &DsV4Config,
    consts: &Consts<B>,
    hc: &HyperConnection<B>,
    norm: &B::Buf,
    streams: &B::Buf,
    rows: usize,
) -> B::Buf {
    let (d, n, eps) = (cfg.hidden_size, cfg.hc_mult, cfg.rms_norm_eps);
    let mut flat = b.scratch(rows * n * d);
    b.rms_norm_into_gemm(streams, &consts.ones, eps, rows, n * d, &mut flat);
    let mut mixes = b.scratch(rows * n);
    b.matmul(&flat, rows, &hc.fn_, None, &mut mixes);
    let mut h = b.scratch(rows * d);
    b.dsv4_mhc_head(
        &mixes, streams, &hc.base, &hc.scale, &mut h, rows, n, d, cfg.hc_eps,
    );
    let mut hn = b.scratch(rows * d);
    b.rms_norm_into_gemm(&h, norm, eps, rows, d, &mut hn);
    hn
}
