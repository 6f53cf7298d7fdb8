//! Manifold-constrained hyper-connections (mHC): the residual is `n` parallel streams per
//! token. Before a block they collapse into its input with weights `pre`; after it, the
//! output is spread back with weights `post` and added to the streams mixed by `comb`,
//! a matrix Sinkhorn-projected toward doubly stochastic so depth cannot blow the norm up.
//! `mixes` are the mapping's logits over the RMS-normed flat streams.

#![allow(clippy::too_many_arguments)]

use super::{sigmoid, softmax};

pub(super) fn mix(
    mixes: &[f32],
    streams: &[f32],
    base: &[f32],
    scale: &[f32],
    post: &mut [f32],
    comb: &mut [f32],
    collapsed: &mut [f32],
    tokens: usize,
    n: usize,
    hidden: usize,
    iters: usize,
    hc_eps: f32,
) {
    let width = (2 + n) * n;
    let (s_pre, s_post, s_comb) = (scale[0], scale[1], scale[2]);
    for t in 0..tokens {
        let m = &mixes[t * width..(t + 1) * width];
        let pre: Vec<f32> = (0..n)
            .map(|j| sigmoid(m[j] * s_pre + base[j]) + hc_eps)
            .collect();
        for j in 0..n {
            post[t * n + j] = 2.0 * sigmoid(m[n + j] * s_post + base[n + j]);
        }
        let c = &mut comb[t * n * n..(t + 1) * n * n];
        for j in 0..n {
            let row = &mut c[j * n..(j + 1) * n];
            for (k, v) in row.iter_mut().enumerate() {
                *v = m[2 * n + j * n + k] * s_comb + base[2 * n + j * n + k];
            }
            softmax(row);
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
        out.fill(0.0);
        for (j, p) in pre.iter().enumerate() {
            let s = &streams[(t * n + j) * hidden..(t * n + j + 1) * hidden];
            out.iter_mut().zip(s).for_each(|(o, v)| *o += p * v);
        }
    }
}

fn normalize_columns(c: &mut [f32], n: usize, eps: f32) {
    for k in 0..n {
        let sum: f32 = (0..n).map(|j| c[j * n + k]).sum::<f32>() + eps;
        (0..n).for_each(|j| c[j * n + k] /= sum);
    }
}

pub(super) fn merge(
    streams: &mut [f32],
    post: &[f32],
    comb: &[f32],
    block_out: &[f32],
    tokens: usize,
    n: usize,
    hidden: usize,
) {
    let mut mixed = vec![0.0f32; n * hidden];
    for t in 0..tokens {
        let s = &mut streams[t * n * hidden..(t + 1) * n * hidden];
        let c = &comb[t * n * n..(t + 1) * n * n];
        let o = &block_out[t * hidden..(t + 1) * hidden];
        for k in 0..n {
            let dst = &mut mixed[k * hidden..(k + 1) * hidden];
            let post = post[t * n + k];
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

pub(super) fn head(
    mixes: &[f32],
    streams: &[f32],
    base: &[f32],
    scale: &[f32],
    out: &mut [f32],
    tokens: usize,
    n: usize,
    hidden: usize,
    hc_eps: f32,
) {
    for t in 0..tokens {
        let o = &mut out[t * hidden..(t + 1) * hidden];
        o.fill(0.0);
        for j in 0..n {
            let pre = sigmoid(mixes[t * n + j] * scale[0] + base[j]) + hc_eps;
            let s = &streams[(t * n + j) * hidden..(t * n + j + 1) * hidden];
            o.iter_mut().zip(s).for_each(|(d, v)| *d += pre * v);
        }
    }
}
