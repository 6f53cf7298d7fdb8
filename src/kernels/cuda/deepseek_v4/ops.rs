//! `DsV4Kernels` on the CUDA backend: each op a launch (or a few) of
//! `kernels-cuda/deepseek_v4.cu`; the indexer's and attention's launchers, with their
//! launch shapes, are in `mod.rs`.

use std::ops::Range;

use crate::kernels::entry_format::EntryFormat;

use cudarc::driver::{CudaSlice, PushKernelArg};

use super::super::{CudaBackend, CudaMatrix, check, grid_for, per_row};
use super::blocks;
use crate::kernels::deepseek_v4::{
    AttentionKeys, Compressor, DsV4KernelError, DsV4Kernels, DsV4Shape, ExpertMatrices,
    ExpertOwners, Scoring, StepMeta,
};
use crate::kernels::host_calls::HostCalls;

type Meta = StepMeta<CudaBackend>;

impl DsV4Kernels for CudaBackend {
    type Ids = CudaSlice<u32>;
    type ExpertTable = super::CudaExperts;
    type RowGroups = super::CudaRowGroups;

    fn host_calls(&self) -> Option<&dyn HostCalls<CudaSlice<f32>, CudaSlice<u32>>> {
        self.host_calls_in_steps.then_some(self as _)
    }

    fn dsv4_prepare(&self, shape: &DsV4Shape) -> Result<(), DsV4KernelError> {
        super::check_shape(shape)?;
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

    fn write_ids(&self, ids: &mut CudaSlice<u32>, data: &[u32]) {
        if !data.is_empty() {
            let mut dst = ids.slice_mut(0..data.len());
            check(self.stream.memcpy_htod(data, &mut dst), "upload");
        }
    }

    fn zero_ids(&self, ids: &mut CudaSlice<u32>) {
        check(self.stream.memset_zeros(ids), "memset");
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

    fn copy_floats(
        &self,
        src: &CudaSlice<f32>,
        at: Range<usize>,
        dst: &mut CudaSlice<f32>,
        offset: usize,
    ) {
        if !at.is_empty() {
            let mut to = dst.slice_mut(offset..offset + at.len());
            check(self.stream.memcpy_dtod(&src.slice(at), &mut to), "copy");
        }
    }

    fn row_groups(&self, m: CudaMatrix, parts: usize) -> super::CudaRowGroups {
        super::CudaRowGroups::new(self, m, parts)
    }

    fn dsv4_take_picks(&self, ids: &mut CudaSlice<u32>, picked: &[u32]) {
        self.take_picks(ids, picked);
    }

    fn dsv4_embed(
        &self,
        table: &CudaSlice<f32>,
        dim: usize,
        ids: &CudaSlice<u32>,
        tokens: usize,
        out: &mut CudaSlice<f32>,
    ) {
        self.embed_rows(table, dim, ids, tokens, out);
    }

    fn dsv4_expand(
        &self,
        streams: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        tokens: usize,
        n: usize,
        hidden: usize,
    ) {
        let (ti, ni, hi) = (tokens as i32, n as i32, hidden as i32);
        // SAFETY: streams [tokens, n, hidden], x [tokens, hidden].
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.ds().expand)
                    .arg(streams)
                    .arg(x)
                    .arg(&ti)
                    .arg(&ni)
                    .arg(&hi)
                    .launch(grid_for(tokens * n * hidden))
            },
            "dsv4_expand",
        );
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
        let (ni, hi, it) = (n as i32, hidden as i32, iters as i32);
        // SAFETY: mixes [tokens, (2+n)·n], streams [tokens, n, hidden], post [tokens, n],
        // comb [tokens, n, n], collapsed [tokens, hidden]; n ≤ 16 (checked at load).
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.ds().mhc_mix)
                    .arg(mixes)
                    .arg(streams)
                    .arg(base)
                    .arg(scale)
                    .arg(post)
                    .arg(comb)
                    .arg(collapsed)
                    .arg(&ni)
                    .arg(&hi)
                    .arg(&it)
                    .arg(&hc_eps)
                    .launch(blocks(hidden.div_ceil(256), tokens, 256))
            },
            "dsv4_mhc_mix",
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
        let (ni, hi) = (n as i32, hidden as i32);
        // SAFETY: shapes as in dsv4_mhc_mix; out [tokens, hidden].
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.ds().mhc_merge)
                    .arg(streams)
                    .arg(post)
                    .arg(comb)
                    .arg(out)
                    .arg(&ni)
                    .arg(&hi)
                    .launch(blocks(hidden.div_ceil(256), tokens, 256))
            },
            "dsv4_mhc_merge",
        );
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
        let (ni, hi) = (n as i32, hidden as i32);
        // SAFETY: mixes [tokens, n], streams [tokens, n, hidden], out [tokens, hidden].
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.ds().mhc_head)
                    .arg(mixes)
                    .arg(streams)
                    .arg(base)
                    .arg(scale)
                    .arg(out)
                    .arg(&ni)
                    .arg(&hi)
                    .arg(&hc_eps)
                    .launch(blocks(hidden.div_ceil(256), tokens, 256))
            },
            "dsv4_mhc_head",
        );
    }

    /// `x [a, b, width]` → `y [b, a, width]`.
    fn dsv4_swap(
        &self,
        y: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        a: usize,
        b: usize,
        width: usize,
    ) {
        let (ai, bi, wi) = (a as i32, b as i32, width as i32);
        // SAFETY: both hold a·b·width values.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.ds().swap)
                    .arg(y)
                    .arg(x)
                    .arg(&ai)
                    .arg(&bi)
                    .arg(&wi)
                    .launch(grid_for(a * b * width))
            },
            "dsv4_swap",
        );
    }

    fn dsv4_gemm_row_groups(
        &self,
        x: &CudaSlice<f32>,
        w: &super::CudaRowGroups,
        rows: usize,
        out: &mut CudaSlice<f32>,
    ) {
        w.gemm(self, x, rows, out);
    }

    fn dsv4_grouped_projection(
        &self,
        x: &CudaSlice<f32>,
        w: &super::CudaRowGroups,
        shape: crate::kernels::deepseek_v4::GroupedShape,
        out: &mut CudaSlice<f32>,
    ) {
        w.grouped_projection(self, x, shape, out);
    }

    /// Interleaved partial RoPE on `heads` rows of `dim` per step row (`sign` −1 undoes it).
    fn dsv4_rope(
        &self,
        x: &mut CudaSlice<f32>,
        meta: &Meta,
        heads: usize,
        dim: usize,
        freqs: &CudaSlice<f32>,
        sign: f32,
    ) {
        let half = freqs.len();
        let n = meta.num_rows * heads * half;
        let (rows, h, d, hf) = (meta.num_rows as i32, heads as i32, dim as i32, half as i32);
        // SAFETY: x holds num_rows·heads·dim values; rows num_rows pairs.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.ds().rope)
                    .arg(x)
                    .arg(&meta.rows)
                    .arg(&rows)
                    .arg(&h)
                    .arg(&d)
                    .arg(&hf)
                    .arg(freqs)
                    .arg(&sign)
                    .launch(grid_for(n))
            },
            "dsv4_rope",
        );
    }

    /// Feeds the step's projected `kv` and `gate` rows to one compressor and emits the raw
    /// entries of the windows they close (`dsv4_entry_finish` norms and rotates them).
    fn dsv4_compress_feed(
        &self,
        c: &mut Compressor<CudaBackend>,
        kv: &CudaSlice<f32>,
        gate: &CudaSlice<f32>,
        bias: &CudaSlice<f32>,
        meta: &Meta,
        block_size: usize,
    ) {
        let (bs, rate, width, dim) = (
            block_size as i32,
            c.rate as i32,
            c.width as i32,
            c.dim as i32,
        );
        let (overlap, epb) = (c.overlap as i32, c.entries_per_block as i32);
        // A thread a (window the chunk closes, channel): at most max_len / rate + 1 windows.
        let mut cfg = blocks(c.dim.div_ceil(128), meta.num_seqs, 128);
        cfg.grid_dim.2 = (meta.max_len / c.rate + 1) as u32;
        // SAFETY: kv and gate hold num_rows·width values; the state buffers cover every
        // slot and the entries every block of the tables (checked by the model).
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.ds().compress_feed)
                    .arg(kv)
                    .arg(gate)
                    .arg(bias)
                    .arg(&c.buf_kv)
                    .arg(&c.buf_gate)
                    .arg(&c.prev_kv)
                    .arg(&c.prev_gate)
                    .arg(&mut c.entries)
                    .arg(&meta.seqs)
                    .arg(&meta.tables)
                    .arg(&bs)
                    .arg(&rate)
                    .arg(&width)
                    .arg(&dim)
                    .arg(&overlap)
                    .arg(&epb)
                    .launch(cfg)
            },
            "dsv4_compress_feed",
        );
        // SAFETY: as above; after the emits, which read the state this rewrites.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.ds().compress_keep)
                    .arg(kv)
                    .arg(gate)
                    .arg(bias)
                    .arg(&mut c.buf_kv)
                    .arg(&mut c.buf_gate)
                    .arg(&mut c.prev_kv)
                    .arg(&mut c.prev_gate)
                    .arg(&meta.seqs)
                    .arg(&rate)
                    .arg(&width)
                    .arg(&dim)
                    .arg(&overlap)
                    .launch(blocks(c.dim.div_ceil(128), meta.num_seqs, 128))
            },
            "dsv4_compress_keep",
        );
    }

    /// RMS norm and RoPE of the `count` entries `emits` lists (entry index, position).
    fn dsv4_entry_finish(
        &self,
        c: &mut Compressor<CudaBackend>,
        emits: &CudaSlice<u32>,
        count: usize,
        norm: &CudaSlice<f32>,
        eps: f32,
        freqs: &CudaSlice<f32>,
    ) {
        if count == 0 {
            return;
        }
        let (dim, half) = (c.dim as i32, freqs.len() as i32);
        // SAFETY: emits holds count pairs of entry indices inside `entries`.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.ds().entry_finish)
                    .arg(&mut c.entries)
                    .arg(emits)
                    .arg(&dim)
                    .arg(norm)
                    .arg(&eps)
                    .arg(freqs)
                    .arg(&half)
                    .launch(blocks(count, 1, 128))
            },
            "dsv4_entry_finish",
        );
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
        format: EntryFormat,
        ring_len: usize,
        head_dim: usize,
    ) {
        self.launch_ring_write(ring, kv, meta, format, ring_len, head_dim);
    }

    /// Router scores → each token's `k` experts and weights.
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
        let (ei, ki) = (num_experts as i32, k as i32);
        // deepseek_v4.cu's codes.
        let scoring: i32 = match scoring {
            Scoring::SqrtSoftplus => 0,
            Scoring::Sigmoid => 1,
            Scoring::Softmax => 2,
        };
        let null = 0u64;
        let mut launch = self.stream.launch_builder(&self.ds().moe_route);
        launch.arg(chosen).arg(weights).arg(logits).arg(token_ids);
        match tid2eid {
            Some(t) => launch.arg(t),
            None => launch.arg(&null),
        };
        match bias {
            Some(b) => launch.arg(b),
            None => launch.arg(&null),
        };
        launch.arg(&scoring).arg(&ei).arg(&ki).arg(&scaling);
        // SAFETY: logits [tokens, num_experts ≤ 1024], chosen and weights [tokens, k ≤ 32],
        // token ids inside the table (checked by the model).
        check(unsafe { launch.launch(per_row(tokens)) }, "dsv4_moe_route");
    }

    fn dsv4_swiglu(
        &self,
        h: &mut CudaSlice<f32>,
        gate: &CudaSlice<f32>,
        up: &CudaSlice<f32>,
        n: usize,
        limit: f32,
    ) {
        let n64 = n as i64;
        // SAFETY: all three hold n values.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.ds().swiglu)
                    .arg(h)
                    .arg(gate)
                    .arg(up)
                    .arg(&n64)
                    .arg(&limit)
                    .launch(grid_for(n))
            },
            "dsv4_swiglu",
        );
    }

    fn dsv4_expert_table(
        &self,
        experts: &ExpertMatrices<'_, Self>,
    ) -> Result<super::CudaExperts, DsV4KernelError> {
        self.expert_table(experts)
    }

    fn dsv4_routed_experts(
        &self,
        ys: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        chosen: &CudaSlice<u32>,
        _experts: &ExpertMatrices<'_, Self>,
        table: &super::CudaExperts,
        owners: Option<&ExpertOwners<'_, Self>>,
        counts: &mut CudaSlice<u32>,
        counts_at: usize,
        tokens: usize,
        k: usize,
        limit: f32,
    ) {
        self.routed_experts(
            ys,
            x,
            chosen,
            table,
            owners,
            counts,
            counts_at,
            (tokens, k, limit),
        );
    }

    fn dsv4_moe_combine(
        &self,
        out: &mut CudaSlice<f32>,
        ys: &CudaSlice<f32>,
        chosen: &CudaSlice<u32>,
        weights: &CudaSlice<f32>,
        tokens: usize,
        k: usize,
        hidden: usize,
    ) {
        let (ki, hi) = (k as i32, hidden as i32);
        // SAFETY: out [tokens, hidden]; chosen and weights [tokens, k]; ys [tokens·k, hidden].
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.ds().moe_combine)
                    .arg(out)
                    .arg(ys)
                    .arg(chosen)
                    .arg(weights)
                    .arg(&ki)
                    .arg(&hi)
                    .launch(blocks(hidden.div_ceil(256), tokens, 256))
            },
            "dsv4_moe_combine",
        );
    }
}
