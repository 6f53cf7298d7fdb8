//! Manifold-constrained hyper-connections (mHC): the residual is `n` parallel streams per
//! token. Before a block they collapse into its input with weights `pre`; after it, the
//! output is spread back with weights `post` and added to the streams mixed by `comb`,
//! a matrix Sinkhorn-projected toward doubly stochastic so depth cannot blow the norm up.

use super::config::DsV4Config;
use super::ops::{rms_norm, sigmoid};
use super::weights::HyperConnection;

pub struct Mix {
    /// `[tokens, n]`
    pub post: Vec<f32>,
    /// `[tokens, n, n]`: `comb[j][k]` carries stream `j` into stream `k`.
    pub comb: Vec<f32>,
    /// `[tokens, hidden]`: the block's input.
    pub collapsed: Vec<f32>,
}

/// Mixing weights of `streams` (`[tokens, n, hidden]`) and their collapse.
pub fn mix(hc: &HyperConnection, streams: &[f32], cfg: &DsV4Config) -> Mix {
    let (n, hidden, iters) = (cfg.hc_mult, cfg.hidden_size, cfg.hc_sinkhorn_iters);
    let (hc_eps, norm_eps) = (cfg.hc_eps, cfg.rms_norm_eps);
    let tokens = streams.len() / (n * hidden);
    let mut flat = streams.to_vec();
    rms_norm(&mut flat, n * hidden, None, norm_eps);
    let mixes = hc.fn_.apply(&flat);
    let width = (2 + n) * n;
    let (s_pre, s_post, s_comb) = (hc.scale[0], hc.scale[1], hc.scale[2]);
    let mut post = vec![0.0f32; tokens * n];
    let mut comb = vec![0.0f32; tokens * n * n];
    let mut collapsed = vec![0.0f32; tokens * hidden];
    for t in 0..tokens {
        let m = &mixes[t * width..(t + 1) * width];
        let pre: Vec<f32> = (0..n)
            .map(|j| sigmoid(m[j] * s_pre + hc.base[j]) + hc_eps)
            .collect();
        for j in 0..n {
            post[t * n + j] = 2.0 * sigmoid(m[n + j] * s_post + hc.base[n + j]);
        }
        let c = &mut comb[t * n * n..(t + 1) * n * n];
        for j in 0..n {
            let row = &mut c[j * n..(j + 1) * n];
            for (k, v) in row.iter_mut().enumerate() {
                *v = m[2 * n + j * n + k] * s_comb + hc.base[2 * n + j * n + k];
            }
            super::ops::softmax(row);
            row.iter_mut().for_each(|v| *v += hc_eps);
        }
        normalize_columns(c, n, hc_eps);
        for _ in 1..iters {
            for row in c.chunks_exact_mut(n) {
                let sum: f32 = row.iter().sum::<f32>() + hc_eps;
                row.iter_mut().for_each(|v| *v /= sum);
            }
            normalize_columns(c, n, hc_eps);
        }
        let out = &mut collapsed[t * hidden..(t + 1) * hidden];
        for (j, p) in pre.iter().enumerate() {
            let s = &streams[(t * n + j) * hidden..(t * n + j + 1) * hidden];
            out.iter_mut().zip(s).for_each(|(o, v)| *o += p * v);
        }
    }
    Mix {
        post,
        comb,
        collapsed,
    }
}

fn normalize_columns(c: &mut [f32], n: usize, eps: f32) {
    for k in 0..n {
        let sum: f32 = (0..n).map(|j| c[j * n + k]).sum::<f32>() + eps;
        (0..n).for_each(|j| c[j * n + k] /= sum);
    }
}

/// `streams[k] ← post[k] · block_out + Σ_j comb[j][k] · streams[j]`, per token.
pub fn merge(mix: &Mix, streams: &mut [f32], block_out: &[f32], n: usize, hidden: usize) {
    let tokens = block_out.len() / hidden;
    let mut mixed = vec![0.0f32; n * hidden];
    for t in 0..tokens {
        let s = &mut streams[t * n * hidden..(t + 1) * n * hidden];
        let c = &mix.comb[t * n * n..(t + 1) * n * n];
        let o = &block_out[t * hidden..(t + 1) * hidden];
        for k in 0..n {
            let dst = &mut mixed[k * hidden..(k + 1) * hidden];
            let post = mix.post[t * n + k];
            dst.iter_mut().zip(o).for_each(|(d, v)| *d = post * v);
            for j in 0..n {
                let weight = c[j * n + k];
                dst.iter_mut()
                    .zip(&s[j * hidden..(j + 1) * hidden])
                    .for_each(|(d, v)| *d += weight * v);
            }
        }
        s.copy_from_slice(&mixed);
    }
}

/// The final collapse before the output norm: `pre` weights only.
pub fn head(
    hc: &HyperConnection,
    streams: &[f32],
    n: usize,
    hidden: usize,
    hc_eps: f32,
    norm_eps: f32,
) -> Vec<f32> {
    let tokens = streams.len() / (n * hidden);
    let mut flat = streams.to_vec();
    rms_norm(&mut flat, n * hidden, None, norm_eps);
    let mixes = hc.fn_.apply(&flat);
    let mut out = vec![0.0f32; tokens * hidden];
    for t in 0..tokens {
        let o = &mut out[t * hidden..(t + 1) * hidden];
        for j in 0..n {
            let pre = sigmoid(mixes[t * n + j] * hc.scale[0] + hc.base[j]) + hc_eps;
            let s = &streams[(t * n + j) * hidden..(t * n + j + 1) * hidden];
            o.iter_mut().zip(s).for_each(|(d, v)| *d += pre * v);
        }
    }
    out
}
