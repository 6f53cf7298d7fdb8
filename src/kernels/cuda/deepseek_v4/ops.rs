//! `DsV4Kernels` on the CUDA backend: each op one launcher (or a few) of
//! `kernels-cuda/deepseek_v4.cu`.

use std::ops::Range;

use cudarc::driver::CudaSlice;

use super::super::{CudaBackend, CudaMatrix, check};
use super::{ATT_MAX_HEAD_DIM, INDEX_SMEM_BYTES};
use crate::kernels::deepseek_v4::{
    AttentionKeys, Compressor, DsV4KernelError, DsV4Kernels, DsV4Shape, Scoring, StepMeta,
};

type Meta = StepMeta<CudaBackend>;

impl DsV4Kernels for CudaBackend {
    type Ids = CudaSlice<u32>;

    fn dsv4_prepare(&self, shape: &DsV4Shape) -> Result<(), DsV4KernelError> {
        let limits = [
            (shape.hc_mult, 16, "hc_mult"),
            (shape.num_routed_experts, 1024, "n_routed_experts"),
            (shape.num_experts_per_tok, 32, "num_experts_per_tok"),
            (shape.head_dim, ATT_MAX_HEAD_DIM, "head_dim"),
            (
                shape.index_width,
                INDEX_SMEM_BYTES / 4,
                "index_n_heads × index_head_dim",
            ),
        ];
        for (value, most, name) in limits {
            if value > most {
                return Err(DsV4KernelError::Shape {
                    device: "CUDA",
                    name,
                    value,
                    most,
                });
            }
        }
        self.dsv4_kernels()
            .map(|_| ())
            .map_err(|e| DsV4KernelError::Unavailable {
                device: "CUDA",
                reason: e.to_string(),
            })
    }

    fn upload_ids(&self, ids: &[u32]) -> CudaSlice<u32> {
        self.upload_u32s(ids)
    }

    fn alloc_ids(&self, len: usize) -> CudaSlice<u32> {
        self.alloc_u32s(len)
    }

    fn download_ids(&self, ids: &CudaSlice<u32>, len: usize) -> Vec<u32> {
        self.download_u32s(ids, len)
    }

    fn scratch(&self, len: usize) -> CudaSlice<f32> {
        self.alloc_written(len)
    }

    fn read_floats(&self, buf: &CudaSlice<f32>, at: Range<usize>) -> Vec<f32> {
        let mut out = vec![0f32; at.len()];
        if !at.is_empty() {
            check(
                self.stream.memcpy_dtoh(&buf.slice(at), &mut out),
                "download",
            );
        }
        out
    }

    fn write_floats(&self, buf: &mut CudaSlice<f32>, offset: usize, values: &[f32]) {
        if !values.is_empty() {
            let mut dst = buf.slice_mut(offset..offset + values.len());
            check(self.stream.memcpy_htod(values, &mut dst), "upload");
        }
    }

    fn split_rows(&self, m: CudaMatrix, parts: usize) -> Vec<CudaMatrix> {
        let rows = m.rows / parts;
        (0..parts)
            .map(|g| CudaMatrix {
                rows,
                cols: m.cols,
                w: self.copy_bf16(&m.w, g * rows * m.cols, rows * m.cols),
            })
            .collect()
    }

    fn dsv4_expand(
        &self,
        streams: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        t: usize,
        n: usize,
        d: usize,
    ) {
        self.launch_expand(streams, x, t, n, d);
    }

    fn dsv4_mhc_mix(
        &self,
        mixes: &CudaSlice<f32>,
        streams: &CudaSlice<f32>,
        base: &CudaSlice<f32>,
        scale: &CudaSlice<f32>,
        post: &mut CudaSlice<f32>,
        comb: &mut CudaSlice<f32>,
        collapsed: &mut CudaSlice<f32>,
        tokens: usize,
        n: usize,
        hidden: usize,
        iters: usize,
        hc_eps: f32,
    ) {
        self.launch_mhc_mix(
            mixes, streams, base, scale, post, comb, collapsed, tokens, n, hidden, iters, hc_eps,
        );
    }

    fn dsv4_mhc_merge(
        &self,
        streams: &mut CudaSlice<f32>,
        post: &CudaSlice<f32>,
        comb: &CudaSlice<f32>,
        out: &CudaSlice<f32>,
        tokens: usize,
        n: usize,
        hidden: usize,
    ) {
        self.launch_mhc_merge(streams, post, comb, out, tokens, n, hidden);
    }

    fn dsv4_mhc_head(
        &self,
        mixes: &CudaSlice<f32>,
        streams: &CudaSlice<f32>,
        base: &CudaSlice<f32>,
        scale: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        tokens: usize,
        n: usize,
        hidden: usize,
        hc_eps: f32,
    ) {
        self.launch_mhc_head(mixes, streams, base, scale, out, tokens, n, hidden, hc_eps);
    }

    fn dsv4_swap(
        &self,
        y: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        a: usize,
        b: usize,
        width: usize,
    ) {
        self.launch_swap(y, x, a, b, width);
    }

    fn dsv4_gemm_row_groups(
        &self,
        x: &CudaSlice<f32>,
        groups: &[(&CudaMatrix, usize, usize)],
        out: &mut CudaSlice<f32>,
    ) {
        for &(w, row0, rows) in groups {
            self.gemm_rows(x, row0, rows, w, out, row0);
        }
    }

    fn dsv4_rope(
        &self,
        x: &mut CudaSlice<f32>,
        meta: &Meta,
        heads: usize,
        dim: usize,
        freqs: &CudaSlice<f32>,
        sign: f32,
    ) {
        self.launch_rope(x, meta, heads, dim, freqs, sign);
    }

    fn dsv4_compress_feed(
        &self,
        c: &mut Compressor<Self>,
        kv: &CudaSlice<f32>,
        gate: &CudaSlice<f32>,
        position_bias: &CudaSlice<f32>,
        meta: &Meta,
        block_size: usize,
    ) {
        self.launch_compress_feed(c, kv, gate, position_bias, meta, block_size);
    }

    fn dsv4_entry_finish(
        &self,
        c: &mut Compressor<Self>,
        emits: &CudaSlice<u32>,
        count: usize,
        norm: &CudaSlice<f32>,
        eps: f32,
        freqs: &CudaSlice<f32>,
    ) {
        self.launch_entry_finish(c, emits, count, norm, eps, freqs);
    }

    fn dsv4_index_select(
        &self,
        sel: &mut CudaSlice<u32>,
        q: &CudaSlice<f32>,
        head_weights: &CudaSlice<f32>,
        keys: &Compressor<Self>,
        meta: &Meta,
        block_size: usize,
        heads: usize,
        max_visible: usize,
        k: usize,
    ) {
        let mut scores = self.alloc_written(meta.num_rows * max_visible.max(1));
        self.launch_index_select(
            sel,
            &mut scores,
            q,
            head_weights,
            keys,
            meta,
            block_size,
            heads,
            max_visible,
            k,
        );
    }

    fn dsv4_attention(
        &self,
        out: &mut CudaSlice<f32>,
        q: &CudaSlice<f32>,
        keys: &AttentionKeys<'_, Self>,
        sinks: &CudaSlice<f32>,
        meta: &Meta,
        heads: usize,
        head_dim: usize,
    ) {
        self.launch_attention(out, q, keys, sinks, meta, heads, head_dim)
            .expect("dsv4_prepare bounds head_dim");
    }

    fn dsv4_ring_write(
        &self,
        ring: &mut CudaSlice<f32>,
        kv: &CudaSlice<f32>,
        meta: &Meta,
        ring_len: usize,
        head_dim: usize,
    ) {
        self.launch_ring_write(ring, kv, meta, ring_len, head_dim);
    }

    fn dsv4_moe_route(
        &self,
        chosen: &mut CudaSlice<u32>,
        weights: &mut CudaSlice<f32>,
        logits: &CudaSlice<f32>,
        token_ids: &CudaSlice<u32>,
        tid2eid: Option<&CudaSlice<u32>>,
        bias: Option<&CudaSlice<f32>>,
        scoring: Scoring,
        tokens: usize,
        num_experts: usize,
        k: usize,
        scaling: f32,
    ) {
        self.launch_moe_route(
            chosen,
            weights,
            logits,
            token_ids,
            tid2eid,
            bias,
            scoring,
            tokens,
            num_experts,
            k,
            scaling,
        );
    }

    fn dsv4_swiglu(
        &self,
        h: &mut CudaSlice<f32>,
        gate: &CudaSlice<f32>,
        up: &CudaSlice<f32>,
        n: usize,
        limit: f32,
    ) {
        self.launch_swiglu(h, gate, up, n, limit);
    }

    fn dsv4_moe_combine(
        &self,
        out: &mut CudaSlice<f32>,
        ys: &CudaSlice<f32>,
        order: &CudaSlice<u32>,
        weights: &CudaSlice<f32>,
        tokens: usize,
        k: usize,
        hidden: usize,
    ) {
        self.launch_moe_combine(out, ys, order, weights, tokens, k, hidden);
    }
}
