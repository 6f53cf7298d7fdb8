//! `Backend` for the CUDA backend: each operation a launch of troupe's kernels (or cuBLAS),
//! skipped while a recorded decode step replays; the step's metadata through `upload_u32`.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::graph::{self, Meta};
use super::weights::Store;
use super::{CudaBackend, CudaKvCache, CudaMatrix, check, grid_for, per_norm_row, per_row};
use crate::kernels::quant::GgmlType;
use crate::kernels::{Backend, HostMatrix, KvCacheShape, SeqAttention};

impl Backend for CudaBackend {
    type Buf = CudaSlice<f32>;
    type Matrix = CudaMatrix;
    type KvCache = CudaKvCache;

    fn join_group(
        &self,
        join: crate::kernels::collective::GroupJoin,
    ) -> Result<
        Box<dyn crate::kernels::collective::Collective<Self>>,
        crate::kernels::collective::GroupError,
    > {
        match join {
            crate::kernels::collective::GroupJoin::Nccl(join) => {
                // Recorded decode graphs hold the old communicator's collectives (aborted:
                // replayed, they would not reduce, and its abort waits for them to go).
                self.moved();
                Ok(Box::new(self.join_nccl(join)?))
            }
            crate::kernels::collective::GroupJoin::Channels(_) => {
                Err(crate::kernels::collective::GroupError::WrongKind {
                    rank: "CUDA",
                    expected: "NCCL",
                    offered: "in-process channels",
                })
            }
        }
    }
    fn device_name(&self) -> String {
        let gpu = self
            .ctx
            .name()
            .unwrap_or_else(|e| format!("unnamed GPU ({e})"));
        let mut driver: std::ffi::c_int = 0;
        // SAFETY: writes one int.
        let _ = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver) };
        format!("cuda {gpu}, driver {driver}, graphs {}", self.cuda_graphs)
    }

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn upload_matrix(&self, m: HostMatrix) -> CudaMatrix {
        self.upload_weights(m)
    }

    fn upload_blocks(&self, rows: usize, cols: usize, ty: GgmlType, blocks: &[u8]) -> CudaMatrix {
        self.upload_host_blocks(rows, cols, ty, blocks)
    }

    fn pin_host(&self, region: &[u8]) -> Option<crate::kernels::HostPin> {
        self.pin(region)
    }

    fn quantization(&self) -> Option<crate::kernels::fp8::Quantization> {
        self.quantization
    }

    fn matrix_footprint(&self, m: &CudaMatrix) -> (usize, String) {
        m.footprint()
    }

    fn upload(&self, data: &[f32]) -> CudaSlice<f32> {
        check(self.stream.clone_htod(data), "upload")
    }

    fn alloc(&self, len: usize) -> CudaSlice<f32> {
        check(self.stream.alloc_zeros::<f32>(len.max(1)), "alloc")
    }

    fn write_at(&self, buf: &mut CudaSlice<f32>, offset: usize, data: &[f32]) {
        let mut view = buf.slice_mut(offset..offset + data.len());
        check(self.stream.memcpy_htod(data, &mut view), "write_at");
    }

    fn alloc_kv_cache(&self, shape: KvCacheShape) -> CudaKvCache {
        self.new_kv_cache(shape)
    }
    fn read_kv_blocks(&self, cache: &CudaKvCache, blocks: &[u32]) -> Option<Vec<u8>> {
        Some(self.kv_blocks_bytes(cache, blocks))
    }
    fn write_kv_blocks(&self, cache: &mut CudaKvCache, blocks: &[(u32, &[u8])]) -> bool {
        self.set_kv_blocks_bytes(cache, blocks)
    }
    fn download(&self, buf: &CudaSlice<f32>, len: usize) -> Vec<f32> {
        let mut out = vec![0f32; len];
        check(
            self.stream.memcpy_dtoh(&buf.slice(0..len), &mut out),
            "download",
        );
        out
    }

    fn embedding(&self, table: &CudaMatrix, ids: &[u32], picked: &[u32], out: &mut CudaSlice<f32>) {
        let ids_d = self.upload_u32(Meta::Ids, ids);
        let picked_d = (!picked.is_empty()).then(|| self.upload_u32(Meta::Picked, picked));
        if self.replaying() {
            return;
        }
        let picked_ptr = picked_d.as_ref().map_or(0u64, |p| p.ptr);
        let picks = self.picks.lock().unwrap_or_else(|e| e.into_inner());
        let dim = table.cols as i32;
        let parts = match &table.store {
            Store::Bf16(w) => {
                // SAFETY: ids < table.rows (checked by the scheduler), picked indices <
                // MAX_PICKS, out holds ids.len() rows.
                check(
                    unsafe {
                        self.stream
                            .launch_builder(&self.kernels.embedding)
                            .arg(out)
                            .arg(w)
                            .arg(&ids_d.ptr)
                            .arg(&picked_ptr)
                            .arg(&picks.0)
                            .arg(&dim)
                            // Wide blocks: a batch-1 step's one row is a few rounds of loads.
                            .launch(LaunchConfig {
                                block_dim: (1024, 1, 1),
                                ..per_row(ids.len())
                            })
                    },
                    "embedding",
                );
                return;
            }
            Store::Packed(parts) => parts,
        };
        for p in parts {
            let (block_rows, block_cols) = p.format.blocks();
            let (fmt, first, rows) = (p.format.code(), p.first_row as i32, p.rows as i32);
            // SAFETY: as above; each part writes the tokens whose rows it holds.
            check(
                unsafe {
                    self.stream
                        .launch_builder(&self.kernels.embedding_packed)
                        .arg(&mut *out)
                        .arg(&p.bytes)
                        .arg(&p.scales)
                        .arg(&fmt)
                        .arg(&block_rows)
                        .arg(&block_cols)
                        .arg(&first)
                        .arg(&rows)
                        .arg(&ids_d.ptr)
                        .arg(&picked_ptr)
                        .arg(&picks.0)
                        .arg(&dim)
                        .launch(per_row(ids.len()))
                },
                "embedding",
            );
        }
    }

    fn matmul(
        &self,
        x: &CudaSlice<f32>,
        num_rows: usize,
        w: &CudaMatrix,
        bias: Option<&CudaSlice<f32>>,
        out: &mut CudaSlice<f32>,
    ) {
        if self.replaying() {
            return;
        }
        self.gemm(x, num_rows, w, bias, out);
    }

    fn rms_norm(
        &self,
        x: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        eps: f32,
        num_rows: usize,
        dim: usize,
        out: &mut CudaSlice<f32>,
    ) {
        if self.replaying() {
            return;
        }
        self.launch_rms_norm(x, weight, eps, (num_rows, dim), out, 0);
    }

    fn rms_norm_into_gemm(
        &self,
        x: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        eps: f32,
        num_rows: usize,
        dim: usize,
        out: &mut CudaSlice<f32>,
    ) {
        if self.replaying() {
            return;
        }
        let twin = self.bf16_twin(out, num_rows * dim);
        self.launch_rms_norm(x, weight, eps, (num_rows, dim), out, twin);
    }

    fn add_rms_norm(
        &self,
        residual: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        eps: f32,
        num_rows: usize,
        dim: usize,
        out: &mut CudaSlice<f32>,
    ) {
        if self.replaying() {
            return;
        }
        let d = dim as i32;
        // Its output is the next GEMM's operand: the bf16 copy saves that GEMM a launch.
        let twin = self.bf16_twin(out, num_rows * dim);
        // SAFETY: residual, x and out hold num_rows·dim elements.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.kernels.add_rms_norm)
                    .arg(residual)
                    .arg(x)
                    .arg(weight)
                    .arg(&eps)
                    .arg(&d)
                    .arg(&mut *out)
                    .arg(&twin)
                    .launch(per_norm_row(num_rows, dim))
            },
            "add_rms_norm",
        );
    }

    fn add(&self, residual: &mut CudaSlice<f32>, x: &CudaSlice<f32>, len: usize) {
        if self.replaying() {
            return;
        }
        let n = len as i64;
        // SAFETY: both hold len elements.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.kernels.add)
                    .arg(residual)
                    .arg(x)
                    .arg(&n)
                    .launch(grid_for(len))
            },
            "add",
        );
    }

    fn rope(
        &self,
        x: &mut CudaSlice<f32>,
        positions: &[u32],
        num_heads: usize,
        head_dim: usize,
        cos_sin: &CudaSlice<f32>,
    ) {
        let pos = self.upload_u32(Meta::Positions, positions);
        if self.replaying() {
            return;
        }
        let (h, hd) = (num_heads as i32, head_dim as i32);
        // SAFETY: x holds positions.len() rows of num_heads·head_dim; cos_sin covers them.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.kernels.rope)
                    .arg(x)
                    .arg(&pos.ptr)
                    .arg(&h)
                    .arg(&hd)
                    .arg(cos_sin)
                    .launch(per_row(positions.len()))
            },
            "rope",
        );
    }

    fn silu_mul(
        &self,
        gate_up: &CudaSlice<f32>,
        num_rows: usize,
        width: usize,
        out: &mut CudaSlice<f32>,
    ) {
        if self.replaying() {
            return;
        }
        let (r, w) = (num_rows as i32, width as i32);
        let twin = self.bf16_twin(out, num_rows * width);
        // SAFETY: gate_up holds rows·2·width, out rows·width.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.kernels.silu_mul)
                    .arg(&mut *out)
                    .arg(gate_up)
                    .arg(&r)
                    .arg(&w)
                    .arg(&twin)
                    .launch(grid_for(num_rows * width))
            },
            "silu_mul",
        );
    }

    fn gate_up_silu(
        &self,
        x: &CudaSlice<f32>,
        num_rows: usize,
        w: &CudaMatrix,
        width: usize,
        gate_up: &mut CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
    ) {
        if self.replaying() {
            return;
        }
        if !self.gemv_silu(x, num_rows, w, width, out) {
            self.gemm(x, num_rows, w, None, gate_up);
            self.silu_mul(gate_up, num_rows, width, out);
        }
    }

    fn copy_columns(
        &self,
        src: &CudaSlice<f32>,
        src_width: usize,
        col_start: usize,
        width: usize,
        num_rows: usize,
        dst: &mut CudaSlice<f32>,
    ) {
        if self.replaying() {
            return;
        }
        let (sw, cs, w, r) = (
            src_width as i32,
            col_start as i32,
            width as i32,
            num_rows as i32,
        );
        // SAFETY: src holds rows·src_width, dst rows·width.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.kernels.copy_columns)
                    .arg(dst)
                    .arg(src)
                    .arg(&sw)
                    .arg(&cs)
                    .arg(&w)
                    .arg(&r)
                    .launch(grid_for(num_rows * width))
            },
            "copy_columns",
        );
    }

    fn kv_write(
        &self,
        cache: &mut CudaKvCache,
        layer: usize,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        slots: &[u32],
    ) {
        self.write_kv(cache, layer, k, v, slots);
    }

    fn qkv_into_cache(
        &self,
        qkv: &CudaSlice<f32>,
        heads: crate::kernels::QkvHeads,
        qk_norm: Option<(&CudaSlice<f32>, &CudaSlice<f32>, f32)>,
        positions: &[u32],
        cos_sin: &CudaSlice<f32>,
        cache: &mut CudaKvCache,
        layer: usize,
        slots: &[u32],
        q_out: &mut CudaSlice<f32>,
    ) -> bool {
        self.split_qkv_into_cache(
            qkv, heads, qk_norm, positions, cos_sin, cache, layer, slots, q_out,
        )
    }

    fn paged_attention(
        &self,
        q: &CudaSlice<f32>,
        cache: &CudaKvCache,
        layer: usize,
        seqs: &[SeqAttention<'_>],
        num_heads: usize,
        out: &mut CudaSlice<f32>,
    ) {
        self.attention(q, cache, layer, seqs, num_heads, out);
    }

    fn pick_rows(
        &self,
        logits: &CudaSlice<f32>,
        vocab: usize,
        rows: &[crate::kernels::PickRow<'_>],
    ) -> crate::kernels::Pending<Vec<(u32, f32)>> {
        self.device_picks(logits, vocab, rows)
    }

    fn device_picks(&self) -> Option<&dyn crate::kernels::DevicePicks> {
        Some(self)
    }

    fn timeline_mark(&self) -> Option<crate::kernels::DeviceMark> {
        // Not while a graph is being captured: an event recorded then belongs to the graph.
        let flags = cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
        let event = self.stream.record_event(Some(flags)).ok()?;
        Some(crate::kernels::DeviceMark::new(EventMark(event)))
    }

    fn download_rows(&self, logits: &CudaSlice<f32>, vocab: usize, rows: &[usize]) -> Vec<f32> {
        if rows.iter().enumerate().all(|(i, &r)| i == r) {
            return self.download(logits, rows.len() * vocab);
        }
        let mut packed = self.alloc(rows.len() * vocab);
        self.gather_rows(logits, vocab, rows, &mut packed);
        self.download(&packed, rows.len() * vocab)
    }

    fn greedy_rows(
        &self,
        logits: &CudaSlice<f32>,
        vocab: usize,
        rows: &[usize],
    ) -> Vec<(u32, f32)> {
        self.greedy_picks(logits, vocab, rows)
    }

    fn graphs(&self) -> Option<&dyn crate::kernels::StepGraphs> {
        self.cuda_graphs
            .then_some(self as &dyn crate::kernels::StepGraphs)
    }

    fn recorder(&self) -> Option<&dyn crate::kernels::StepRecorder> {
        self.cuda_graphs
            .then_some(self as &dyn crate::kernels::StepRecorder)
    }

    fn segment_attention(
        &self,
        q: &CudaSlice<f32>,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        bounds: &[usize],
        num_heads: usize,
        head_dim: usize,
        out: &mut CudaSlice<f32>,
    ) {
        self.launch_segment_attention(q, k, v, bounds, num_heads, head_dim, out);
    }

    fn gelu(&self, x: &mut CudaSlice<f32>, len: usize) {
        self.launch_gelu(x, len);
    }

    fn gather_rows(
        &self,
        x: &CudaSlice<f32>,
        width: usize,
        rows: &[usize],
        out: &mut CudaSlice<f32>,
    ) {
        self.launch_gather_rows(x, width, rows, out);
    }
}

/// A timing event on the backend's stream.
struct EventMark(cudarc::driver::CudaEvent);

impl crate::kernels::TimelineMark for EventMark {
    fn secs_until(&self, later: &dyn crate::kernels::TimelineMark) -> Option<f64> {
        let later = later.as_any().downcast_ref::<EventMark>()?;
        self.0
            .elapsed_ms(&later.0)
            .ok()
            .map(|ms| f64::from(ms.max(0.0)) / 1e3)
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl crate::kernels::DevicePicks for CudaBackend {
    fn read_picks(&self, first: usize, count: usize) -> Vec<u32> {
        self.read_early_picks(first, count)
    }
}

impl crate::kernels::StepGraphs for CudaBackend {
    fn padded_tokens(&self, num_tokens: usize, num_seqs: usize) -> Option<usize> {
        graph::padded_tokens(num_tokens, num_seqs)
    }

    fn max_row_tokens(&self) -> usize {
        graph::MAX_GRAPH_ROW_TOKENS
    }

    fn token_counts(&self) -> &'static [usize] {
        &graph::GRAPH_TOKEN_COUNTS
    }

    fn begin_step(&self, tokens: usize, max_blocks_per_seq: usize) {
        self.graphs()
            .begin(&self.ctx, &self.stream, tokens, max_blocks_per_seq);
    }

    fn end_step(&self) {
        let mut graphs = self.graphs();
        let Some(tokens) = graphs.finish(&self.stream) else {
            return;
        };
        if let Some((num_rows, block_size)) = graphs.verified.take() {
            self.apply_verified(&graphs, num_rows, block_size);
        }
        graphs.launch(&self.stream, tokens);
    }

    fn stage_verified(
        &self,
        rows: &[crate::kernels::StagedVerified<'_>],
        block_size: usize,
    ) -> bool {
        self.stage_verified_rows(rows, block_size)
    }

    fn buffers_moved(&self) {
        self.moved();
    }
}

impl CudaBackend {
    /// `rms_norm_kernel` over `rows × dim`, with its bf16 copy at `twin` (0: none).
    fn launch_rms_norm(
        &self,
        x: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        eps: f32,
        (num_rows, dim): (usize, usize),
        out: &mut CudaSlice<f32>,
        twin: u64,
    ) {
        let d = dim as i32;
        // SAFETY: x and out hold num_rows·dim elements, weight dim; twin is 0 or the
        // scratch of num_rows·dim bf16 that `bf16_twin` gave.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.kernels.rms_norm)
                    .arg(out)
                    .arg(x)
                    .arg(weight)
                    .arg(&eps)
                    .arg(&d)
                    .arg(&twin)
                    .launch(per_norm_row(num_rows, dim))
            },
            "rms_norm",
        );
    }
}
