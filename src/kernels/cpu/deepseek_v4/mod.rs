//! DeepSeek-V4's ops on the CPU: the f32 reference every other device is checked
//! against, each op the arithmetic of DeepSeek's released code in its order.
//!
//! | file | what it is |
//! |---|---|
//! | `mhc.rs` | hyper-connections: mix (Sinkhorn), merge, head |
//! | `attention.rs` | RoPE, attention with sinks over window and entries, the ring, the indexer |
//! | `compress.rs` | the compressors' windows and their entries |
//! | `moe.rs` | routing, the clipped SwiGLU, the combine |

mod attention;
mod compress;
mod mhc;
mod moe;

use std::ops::Range;

use rayon::prelude::*;

use super::CpuBackend;
use super::qmatrix::CpuMatrix;
use crate::kernels::Backend;
use crate::kernels::deepseek_v4::{
    AttentionKeys, Compressor, DsV4KernelError, DsV4Kernels, DsV4Shape, ExpertMatrices,
    ExpertOwners, Scoring, StepMeta,
};
use crate::kernels::entry_format::EntryFormat;

/// RMS norm of each `dim`-wide row in place, times `weight` when given (DeepSeek's order:
/// `weight · (x · rsqrt(mean(x²) + eps))`).
pub fn rms_norm_rows(x: &mut [f32], dim: usize, weight: Option<&[f32]>, eps: f32) {
    for row in x.chunks_exact_mut(dim) {
        let mean_sq = row.iter().map(|v| v * v).sum::<f32>() / dim as f32;
        let inv = 1.0 / (mean_sq + eps).sqrt();
        match weight {
            Some(w) => row.iter_mut().zip(w).for_each(|(v, w)| *v = w * (*v * inv)),
            None => row.iter_mut().for_each(|v| *v *= inv),
        }
    }
}

/// Rotates the trailing `2 · freqs.len()` channels of each `dim`-wide row of `x`, in
/// consecutive pairs, at `position` (one position for all rows); `sign = -1` undoes it.
pub fn rope_rows(x: &mut [f32], dim: usize, freqs: &[f32], position: usize, sign: f32) {
    let rope_dim = 2 * freqs.len();
    let (cos, sin): (Vec<f32>, Vec<f32>) = freqs
        .iter()
        .map(|f| {
            let angle = position as f32 * f;
            (angle.cos(), sign * angle.sin())
        })
        .unzip();
    for row in x.chunks_exact_mut(dim) {
        let tail = &mut row[dim - rope_dim..];
        for (i, pair) in tail.chunks_exact_mut(2).enumerate() {
            let (a, b) = (pair[0], pair[1]);
            pair[0] = a * cos[i] - b * sin[i];
            pair[1] = b * cos[i] + a * sin[i];
        }
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    x.iter_mut().for_each(|v| *v /= sum);
}

/// Router scores of one token's expert logits, in place.
fn score(logits: &mut [f32], scoring: Scoring) {
    match scoring {
        // torch's softplus returns x itself above 20.
        Scoring::SqrtSoftplus => logits.iter_mut().for_each(|x| {
            let sp = if *x > 20.0 { *x } else { x.exp().ln_1p() };
            *x = sp.sqrt();
        }),
        Scoring::Sigmoid => logits.iter_mut().for_each(|x| *x = sigmoid(*x)),
        Scoring::Softmax => softmax(logits),
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Where compressed entry `e` (source tokens `e·rate ..`) of a sequence lives in `entries`.
fn entry_index(table: &[u32], block_size: usize, rate: usize, per_block: usize, e: usize) -> usize {
    let first = e * rate;
    table[first / block_size] as usize * per_block + (first % block_size) / rate
}

impl CpuBackend {
    /// `dsv4_routed_experts` over borrowed slices (a caller's staging, not the backend's
    /// buffers): the host experts' part of a device step.
    #[allow(clippy::too_many_arguments)]
    pub fn routed_experts_into(
        &self,
        ys: &mut [f32],
        x: &[f32],
        chosen: &[u32],
        experts: &ExpertMatrices<'_, Self>,
        owners: Option<&ExpertOwners<'_, Self>>,
        counts: &mut [u32],
        dims: (usize, usize, f32),
    ) {
        moe::routed_experts(self, ys, x, chosen, experts, owners, counts, dims);
    }
}

impl DsV4Kernels for CpuBackend {
    type Ids = Vec<u32>;
    type ExpertTable = ();
    type RowGroups = Vec<CpuMatrix>;

    fn host_calls(&self) -> Option<&dyn crate::kernels::host_calls::HostCalls<Vec<f32>, Vec<u32>>> {
        // A CPU step records nothing: its host work runs where it stands.
        None
    }

    fn dsv4_prepare(&self, _shape: &DsV4Shape) -> Result<(), DsV4KernelError> {
        Ok(())
    }

    fn upload_ids(&self, ids: &[u32]) -> Vec<u32> {
        ids.to_vec()
    }

    fn alloc_ids(&self, len: usize) -> Vec<u32> {
        vec![0; len]
    }

    fn write_ids(&self, ids: &mut Vec<u32>, data: &[u32]) {
        ids[..data.len()].copy_from_slice(data);
    }

    fn zero_ids(&self, ids: &mut Vec<u32>) {
        ids.fill(0);
    }

    fn download_ids(&self, ids: &Vec<u32>, len: usize) -> Vec<u32> {
        ids[..len].to_vec()
    }

    fn scratch(&self, len: usize) -> Vec<f32> {
        vec![0.0; len]
    }

    fn read_floats(&self, buf: &Vec<f32>, at: Range<usize>) -> Vec<f32> {
        buf[at].to_vec()
    }

    fn write_floats(&self, buf: &mut Vec<f32>, offset: usize, values: &[f32]) {
        buf[offset..offset + values.len()].copy_from_slice(values);
    }

    fn copy_floats(&self, src: &Vec<f32>, at: Range<usize>, dst: &mut Vec<f32>, offset: usize) {
        dst[offset..offset + at.len()].copy_from_slice(&src[at]);
    }

    fn row_groups(&self, m: CpuMatrix, parts: usize) -> Vec<CpuMatrix> {
        let (rows, cols) = (m.rows() / parts, m.cols());
        let mut row = vec![0.0f32; cols];
        (0..parts)
            .map(|g| {
                let mut data = Vec::with_capacity(rows * cols);
                for r in g * rows..(g + 1) * rows {
                    m.dequantize_row(r, &mut row);
                    data.extend_from_slice(&row);
                }
                self.upload_matrix(crate::kernels::HostMatrix {
                    rows,
                    cols,
                    data: crate::kernels::HostData::F32(data),
                })
            })
            .collect()
    }

    fn dsv4_take_picks(&self, _ids: &mut Vec<u32>, picked: &[u32]) {
        assert!(
            picked.iter().all(|&p| p == crate::kernels::NOT_PICKED),
            "the CPU backend's picks are on the host"
        );
    }

    fn dsv4_embed(
        &self,
        table: &Vec<f32>,
        dim: usize,
        ids: &Vec<u32>,
        tokens: usize,
        out: &mut Vec<f32>,
    ) {
        for (t, &id) in ids[..tokens].iter().enumerate() {
            let id = id as usize;
            out[t * dim..(t + 1) * dim].copy_from_slice(&table[id * dim..(id + 1) * dim]);
        }
    }

    fn dsv4_expand(&self, streams: &mut Vec<f32>, x: &Vec<f32>, tokens: usize, n: usize, d: usize) {
        for t in 0..tokens {
            for j in 0..n {
                streams[(t * n + j) * d..(t * n + j + 1) * d]
                    .copy_from_slice(&x[t * d..(t + 1) * d]);
            }
        }
    }

    fn dsv4_mhc_mix(
        &self,
        mixes: &Vec<f32>,
        streams: &Vec<f32>,
        base: &Vec<f32>,
        scale: &Vec<f32>,
        post: &mut Vec<f32>,
        comb: &mut Vec<f32>,
        collapsed: &mut Vec<f32>,
        tokens: usize,
        n: usize,
        hidden: usize,
        iters: usize,
        hc_eps: f32,
    ) {
        mhc::mix(
            mixes, streams, base, scale, post, comb, collapsed, tokens, n, hidden, iters, hc_eps,
        );
    }

    fn dsv4_mhc_merge(
        &self,
        streams: &mut Vec<f32>,
        post: &Vec<f32>,
        comb: &Vec<f32>,
        out: &Vec<f32>,
        tokens: usize,
        n: usize,
        hidden: usize,
    ) {
        mhc::merge(streams, post, comb, out, tokens, n, hidden);
    }

    fn dsv4_mhc_head(
        &self,
        mixes: &Vec<f32>,
        streams: &Vec<f32>,
        base: &Vec<f32>,
        scale: &Vec<f32>,
        out: &mut Vec<f32>,
        tokens: usize,
        n: usize,
        hidden: usize,
        hc_eps: f32,
    ) {
        mhc::head(mixes, streams, base, scale, out, tokens, n, hidden, hc_eps);
    }

    fn dsv4_swap(&self, y: &mut Vec<f32>, x: &Vec<f32>, a: usize, b: usize, width: usize) {
        for i in 0..a {
            for j in 0..b {
                let (src, dst) = ((i * b + j) * width, (j * a + i) * width);
                y[dst..dst + width].copy_from_slice(&x[src..src + width]);
            }
        }
    }

    fn dsv4_gemm_row_groups(
        &self,
        x: &Vec<f32>,
        w: &Vec<CpuMatrix>,
        rows: usize,
        out: &mut Vec<f32>,
    ) {
        // Groups run in parallel; each writes its own rows of `out`, so the result does not
        // depend on the thread count.
        let products: Vec<Vec<f32>> = w
            .par_iter()
            .enumerate()
            .map(|(g, w)| {
                let input = &x[g * rows * w.cols()..(g + 1) * rows * w.cols()];
                let mut y = vec![0.0f32; rows * w.rows()];
                super::matmul::matmul(input, rows, w, &mut y, self.batch_invariant);
                y
            })
            .collect();
        for (g, (w, y)) in w.iter().zip(products).enumerate() {
            out[g * rows * w.rows()..(g + 1) * rows * w.rows()].copy_from_slice(&y);
        }
    }

    fn dsv4_grouped_projection(
        &self,
        x: &Vec<f32>,
        w: &Vec<CpuMatrix>,
        shape: crate::kernels::deepseek_v4::GroupedShape,
        out: &mut Vec<f32>,
    ) {
        crate::kernels::deepseek_v4::grouped_projection_by_swaps(self, x, w, shape, out);
    }

    fn dsv4_rope(
        &self,
        x: &mut Vec<f32>,
        meta: &StepMeta<Self>,
        heads: usize,
        dim: usize,
        freqs: &Vec<f32>,
        sign: f32,
    ) {
        attention::rope(x, meta, heads, dim, freqs, sign);
    }

    fn dsv4_compress_feed(
        &self,
        c: &mut Compressor<Self>,
        kv: &Vec<f32>,
        gate: &Vec<f32>,
        position_bias: &Vec<f32>,
        meta: &StepMeta<Self>,
        block_size: usize,
    ) {
        compress::feed(c, kv, gate, position_bias, meta, block_size);
    }

    fn dsv4_entry_finish(
        &self,
        c: &mut Compressor<Self>,
        emits: &Vec<u32>,
        count: usize,
        norm: &Vec<f32>,
        eps: f32,
        freqs: &Vec<f32>,
    ) {
        compress::finish(c, &emits[..2 * count], norm, eps, freqs);
    }

    fn dsv4_index_select(
        &self,
        sel: &mut Vec<u32>,
        q: &Vec<f32>,
        head_weights: &Vec<f32>,
        keys: &Compressor<Self>,
        meta: &StepMeta<Self>,
        block_size: usize,
        heads: usize,
        _max_visible: usize,
        k: usize,
    ) {
        attention::index_select(sel, q, head_weights, keys, meta, block_size, heads, k);
    }

    fn dsv4_attention(
        &self,
        out: &mut Vec<f32>,
        q: &Vec<f32>,
        keys: &AttentionKeys<'_, Self>,
        sinks: &Vec<f32>,
        meta: &StepMeta<Self>,
        heads: usize,
        head_dim: usize,
    ) {
        attention::attend(out, q, keys, sinks, meta, heads, head_dim);
    }

    fn dsv4_ring_write(
        &self,
        ring: &mut Vec<f32>,
        kv: &Vec<f32>,
        meta: &StepMeta<Self>,
        format: EntryFormat,
        ring_len: usize,
        head_dim: usize,
    ) {
        attention::ring_write(ring, kv, meta, format, ring_len, head_dim);
    }

    fn dsv4_moe_route(
        &self,
        chosen: &mut Vec<u32>,
        weights: &mut Vec<f32>,
        logits: &Vec<f32>,
        token_ids: &Vec<u32>,
        tid2eid: Option<&Vec<u32>>,
        bias: Option<&Vec<f32>>,
        scoring: Scoring,
        tokens: usize,
        num_experts: usize,
        k: usize,
        scaling: f32,
    ) {
        moe::route(
            chosen,
            weights,
            logits,
            token_ids,
            tid2eid.map(Vec::as_slice),
            bias.map(Vec::as_slice),
            scoring,
            tokens,
            num_experts,
            k,
            scaling,
        );
    }

    fn dsv4_swiglu(&self, h: &mut Vec<f32>, gate: &Vec<f32>, up: &Vec<f32>, n: usize, limit: f32) {
        for ((h, &g), &u) in h[..n].iter_mut().zip(gate).zip(up) {
            *h = moe::silu(g.min(limit)) * u.clamp(-limit, limit);
        }
    }

    fn dsv4_moe_combine(
        &self,
        out: &mut Vec<f32>,
        ys: &Vec<f32>,
        chosen: &Vec<u32>,
        weights: &Vec<f32>,
        tokens: usize,
        k: usize,
        hidden: usize,
    ) {
        moe::combine(out, ys, chosen, weights, (tokens, k, hidden));
    }

    fn dsv4_expert_table(
        &self,
        _experts: &ExpertMatrices<'_, Self>,
    ) -> Result<(), DsV4KernelError> {
        Ok(())
    }

    fn dsv4_routed_experts(
        &self,
        ys: &mut Vec<f32>,
        x: &Vec<f32>,
        chosen: &Vec<u32>,
        experts: &ExpertMatrices<'_, Self>,
        _table: &(),
        owners: Option<&ExpertOwners<'_, Self>>,
        counts: &mut Vec<u32>,
        counts_at: usize,
        tokens: usize,
        k: usize,
        limit: f32,
    ) {
        let counts = &mut counts[counts_at..counts_at + experts.len()];
        moe::routed_experts(
            self,
            ys,
            x,
            chosen,
            experts,
            owners,
            counts,
            (tokens, k, limit),
        );
    }
}
