//! The CPU backend: the embedded default and the numeric reference for the others.
//! Multi-threaded with rayon; SIMD through `simd` and the `gemm` crate.

mod attention;
pub mod deepseek_v4;
pub mod exact_dot;
mod invariant_gemm;
pub mod kv_cache;
pub mod matmul;
pub mod packed;
pub mod packed_matmul;
pub mod qmatrix;
mod segment_attention;
pub mod simd;
pub mod torch_topk;

use rayon::prelude::*;

use super::paged_kv::{KvCacheShape, SeqAttention};
use super::{Backend, HostMatrix};

pub use kv_cache::CpuKvCache;
pub use qmatrix::CpuMatrix;

#[derive(Debug, Clone, Copy, Default)]
pub struct CpuBackend {
    /// Fixed reduction order for every row whatever the batch: see `matmul::matmul`.
    pub batch_invariant: bool,
    /// `--exact-activations`: f32 activations against Q4_1 / Q8_0 weights expanded in the
    /// dot (other formats dequantized at load), instead of 8-bit activations and integer
    /// dot products.
    pub exact_activations: bool,
    /// `--quantization fp8`: layer projections quantized per channel at load and run
    /// dequantized (the numeric reference of the CUDA backend's FP8 weights).
    pub quantization: Option<crate::kernels::fp8::Quantization>,
    /// Steps a model would record on a GPU take that path here too, run eagerly (the CPU
    /// records nothing): the fixed-address decode step (`model::deepseek_v4::recorded`)
    /// checked against the ordinary one on any machine.
    pub records_steps: bool,
}

/// Below this many elements an element-wise op runs on the calling thread: waking the
/// pool costs more than the work (decode steps are full of such ops).
const PARALLEL_MIN_ELEMENTS: usize = 1 << 15;

fn rms_norm_row(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let mean_sq = simd::dot(x, x) / x.len() as f32;
    let inv = 1.0 / (mean_sq + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = v * inv * w;
    }
}

impl Backend for CpuBackend {
    type Buf = Vec<f32>;
    type Matrix = CpuMatrix;
    type KvCache = CpuKvCache;

    fn join_group(
        &self,
        join: crate::kernels::collective::GroupJoin,
    ) -> Result<
        Box<dyn crate::kernels::collective::Collective<Self>>,
        crate::kernels::collective::GroupError,
    > {
        match join {
            crate::kernels::collective::GroupJoin::Channels(c) => Ok(Box::new(c)),
            crate::kernels::collective::GroupJoin::Nccl(_) => {
                Err(crate::kernels::collective::GroupError::WrongKind {
                    rank: "CPU",
                    expected: "in-process channels",
                    offered: "NCCL",
                })
            }
        }
    }
    fn device_name(&self) -> String {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        format!(
            "cpu, {threads} threads, invariant {}, exact activations {}",
            self.batch_invariant, self.exact_activations
        )
    }

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn quantization(&self) -> Option<crate::kernels::fp8::Quantization> {
        self.quantization
    }

    fn upload_matrix(&self, m: HostMatrix) -> CpuMatrix {
        let matrix = if self.exact_activations {
            CpuMatrix::from_host_exact(m)
        } else {
            CpuMatrix::from_host(m)
        };
        if self.batch_invariant {
            matrix.into_panels()
        } else {
            matrix
        }
    }

    fn upload_blocks(
        &self,
        rows: usize,
        cols: usize,
        ggml_type: crate::kernels::quant::GgmlType,
        blocks: &[u8],
    ) -> CpuMatrix {
        let data = crate::kernels::HostData::Quantized {
            ggml_type,
            bytes: blocks.to_vec(),
        };
        self.upload_matrix(HostMatrix { rows, cols, data })
    }

    fn pin_host(&self, _region: &[u8]) -> Option<crate::kernels::HostPin> {
        // Host memory is this backend's own: nothing copies it elsewhere.
        None
    }

    fn matrix_footprint(&self, m: &CpuMatrix) -> (usize, String) {
        (m.resident_bytes(), m.format())
    }

    fn upload(&self, data: &[f32]) -> Vec<f32> {
        data.to_vec()
    }

    fn alloc(&self, len: usize) -> Vec<f32> {
        vec![0.0; len]
    }

    fn write_at(&self, buf: &mut Vec<f32>, offset: usize, data: &[f32]) {
        buf[offset..offset + data.len()].copy_from_slice(data);
    }

    fn alloc_kv_cache(&self, shape: KvCacheShape) -> CpuKvCache {
        CpuKvCache::new(shape)
    }

    fn read_kv_blocks(&self, cache: &CpuKvCache, blocks: &[u32]) -> Option<Vec<u8>> {
        let mut out = Vec::new();
        for &b in blocks {
            cache.append_block_bytes(b, &mut out);
        }
        Some(out)
    }

    fn write_kv_blocks(&self, cache: &mut CpuKvCache, blocks: &[(u32, &[u8])]) -> bool {
        blocks
            .iter()
            .all(|&(b, bytes)| cache.set_block_bytes(b, bytes))
    }

    fn download(&self, buf: &Vec<f32>, len: usize) -> Vec<f32> {
        buf[..len].to_vec()
    }

    fn embedding(&self, table: &CpuMatrix, ids: &[u32], picked: &[u32], out: &mut Vec<f32>) {
        // No `device_picks`: callers resolve the picks into `ids`.
        assert!(
            picked.iter().all(|&p| p == super::NOT_PICKED),
            "the CPU backend keeps no picks: pass their ids"
        );
        let d = table.cols();
        for (t, &id) in ids.iter().enumerate() {
            table.dequantize_row(id as usize, &mut out[t * d..(t + 1) * d]);
        }
    }

    fn matmul(
        &self,
        x: &Vec<f32>,
        num_rows: usize,
        w: &CpuMatrix,
        bias: Option<&Vec<f32>>,
        out: &mut Vec<f32>,
    ) {
        matmul::matmul(x, num_rows, w, out, self.batch_invariant);
        if let Some(bias) = bias {
            for row in out[..num_rows * w.rows()].chunks_exact_mut(w.rows()) {
                for (o, b) in row.iter_mut().zip(bias) {
                    *o += b;
                }
            }
        }
    }

    fn rms_norm(
        &self,
        x: &Vec<f32>,
        weight: &Vec<f32>,
        eps: f32,
        num_rows: usize,
        dim: usize,
        out: &mut Vec<f32>,
    ) {
        let (out, x) = (&mut out[..num_rows * dim], &x[..num_rows * dim]);
        if num_rows * dim < PARALLEL_MIN_ELEMENTS {
            out.chunks_mut(dim)
                .zip(x.chunks(dim))
                .for_each(|(o, x)| rms_norm_row(x, weight, eps, o));
        } else {
            out.par_chunks_mut(dim)
                .zip(x.par_chunks(dim))
                .for_each(|(o, x)| rms_norm_row(x, weight, eps, o));
        }
    }

    fn rms_norm_into_gemm(
        &self,
        x: &Vec<f32>,
        weight: &Vec<f32>,
        eps: f32,
        num_rows: usize,
        dim: usize,
        out: &mut Vec<f32>,
    ) {
        // The GEMM quantizes its own activations: nothing to hand it beyond the norm.
        self.rms_norm(x, weight, eps, num_rows, dim, out);
    }

    fn gate_up_silu(
        &self,
        x: &Vec<f32>,
        num_rows: usize,
        w: &CpuMatrix,
        width: usize,
        gate_up: &mut Vec<f32>,
        out: &mut Vec<f32>,
    ) {
        self.matmul(x, num_rows, w, None, gate_up);
        self.silu_mul(gate_up, num_rows, width, out);
    }

    #[allow(clippy::too_many_arguments)]
    fn qkv_into_cache(
        &self,
        qkv: &Vec<f32>,
        heads: crate::kernels::QkvHeads,
        qk_norm: Option<(&Vec<f32>, &Vec<f32>, f32)>,
        positions: &[u32],
        cos_sin: &Vec<f32>,
        cache: &mut CpuKvCache,
        layer: usize,
        slots: &[u32],
        q_out: &mut Vec<f32>,
    ) -> bool {
        // The parts one by one, with scratch of this call's size.
        let tokens = positions.len();
        let kv = tokens * heads.num_kv_heads * heads.head_dim;
        let q = tokens * heads.num_heads * heads.head_dim;
        let (mut k, mut v, mut normed) = (vec![0.0; kv], vec![0.0; kv], vec![0.0; q.max(kv)]);
        crate::kernels::composed::qkv_by_parts(
            self,
            qkv,
            heads,
            qk_norm,
            positions,
            cos_sin,
            cache,
            layer,
            slots,
            q_out,
            [&mut k, &mut v, &mut normed],
        );
        true
    }

    #[allow(clippy::too_many_arguments)]
    fn add_rms_norm(
        &self,
        residual: &mut Vec<f32>,
        x: &Vec<f32>,
        weight: &Vec<f32>,
        eps: f32,
        num_rows: usize,
        dim: usize,
        out: &mut Vec<f32>,
    ) {
        let row = |((o, r), x): ((&mut [f32], &mut [f32]), &[f32])| {
            for (r, x) in r.iter_mut().zip(x) {
                *r += x;
            }
            rms_norm_row(r, weight, eps, o);
        };
        let n = num_rows * dim;
        if n < PARALLEL_MIN_ELEMENTS {
            out[..n]
                .chunks_mut(dim)
                .zip(residual[..n].chunks_mut(dim))
                .zip(x[..n].chunks(dim))
                .for_each(row);
        } else {
            out[..n]
                .par_chunks_mut(dim)
                .zip(residual[..n].par_chunks_mut(dim))
                .zip(x[..n].par_chunks(dim))
                .for_each(row);
        }
    }

    fn add(&self, residual: &mut Vec<f32>, x: &Vec<f32>, len: usize) {
        for (r, x) in residual[..len].iter_mut().zip(&x[..len]) {
            *r += x;
        }
    }

    fn rope(
        &self,
        x: &mut Vec<f32>,
        positions: &[u32],
        num_heads: usize,
        head_dim: usize,
        cos_sin: &Vec<f32>,
    ) {
        let half = head_dim / 2;
        let width = num_heads * head_dim;
        let rotate = |(row, &pos): (&mut [f32], &u32)| {
            let table = &cos_sin[pos as usize * head_dim..(pos as usize + 1) * head_dim];
            let (cos, sin) = table.split_at(half);
            for head in row.chunks_exact_mut(head_dim) {
                let (a, b) = head.split_at_mut(half);
                for i in 0..half {
                    let (x1, x2) = (a[i], b[i]);
                    a[i] = x1 * cos[i] - x2 * sin[i];
                    b[i] = x2 * cos[i] + x1 * sin[i];
                }
            }
        };
        let x = &mut x[..positions.len() * width];
        if x.len() < PARALLEL_MIN_ELEMENTS {
            x.chunks_mut(width).zip(positions.iter()).for_each(rotate);
        } else {
            x.par_chunks_mut(width)
                .zip(positions.par_iter())
                .for_each(rotate);
        }
    }

    fn silu_mul(&self, gate_up: &Vec<f32>, num_rows: usize, width: usize, out: &mut Vec<f32>) {
        let row = |(o, gu): (&mut [f32], &[f32])| {
            let (g, u) = gu.split_at(width);
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                *o = g / (1.0 + (-g).exp()) * u;
            }
        };
        let (out, gate_up) = (
            &mut out[..num_rows * width],
            &gate_up[..num_rows * 2 * width],
        );
        if num_rows * width < PARALLEL_MIN_ELEMENTS {
            out.chunks_mut(width)
                .zip(gate_up.chunks(2 * width))
                .for_each(row);
        } else {
            out.par_chunks_mut(width)
                .zip(gate_up.par_chunks(2 * width))
                .for_each(row);
        }
    }

    fn copy_columns(
        &self,
        src: &Vec<f32>,
        src_width: usize,
        col_start: usize,
        width: usize,
        num_rows: usize,
        dst: &mut Vec<f32>,
    ) {
        for r in 0..num_rows {
            let from = r * src_width + col_start;
            dst[r * width..(r + 1) * width].copy_from_slice(&src[from..from + width]);
        }
    }

    fn kv_write(
        &self,
        cache: &mut CpuKvCache,
        layer: usize,
        k: &Vec<f32>,
        v: &Vec<f32>,
        slots: &[u32],
    ) {
        cache.write(layer, k, v, slots);
    }

    fn paged_attention(
        &self,
        q: &Vec<f32>,
        cache: &CpuKvCache,
        layer: usize,
        seqs: &[SeqAttention<'_>],
        num_heads: usize,
        out: &mut Vec<f32>,
    ) {
        attention::paged_attention(
            q,
            &cache.k[layer],
            &cache.v[layer],
            &cache.shape,
            seqs,
            num_heads,
            out,
        );
    }

    fn pick_rows(
        &self,
        logits: &Vec<f32>,
        vocab: usize,
        rows: &[super::PickRow<'_>],
    ) -> super::Pending<Vec<(u32, f32)>> {
        let mut sampler = crate::sampling::Sampler::default();
        let picks: Vec<(u32, f32)> = rows
            .iter()
            .map(|r| {
                debug_assert!(r.verified_row.is_none(), "the CPU stages no verified rows");
                let mut row = &logits[r.row * vocab..(r.row + 1) * vocab];
                let masked: Vec<f32>;
                if let Some(bits) = r.mask {
                    let mut m = row.to_vec();
                    crate::structured::mask_with_bits(bits, &mut m);
                    masked = m;
                    row = &masked;
                }
                if r.params.is_greedy() {
                    let token = crate::sampling::argmax(row);
                    return (
                        token,
                        row[token as usize] - crate::sampling::log_sum_exp(row),
                    );
                }
                if let Some(draft) = r.draft {
                    let p = crate::spec::TargetDistribution::new(row, r.params);
                    let q = crate::spec::TargetDistribution::one_hot(draft);
                    let token = crate::spec::verify::rejection_pick(
                        &p,
                        draft,
                        &q,
                        r.params.seed,
                        r.position,
                    );
                    return (token, p.prob(token).ln() as f32);
                }
                let ctx = crate::sampling::SampleContext {
                    position: r.position,
                    ..Default::default()
                };
                let out = sampler.sample_row(row, r.params, &ctx);
                (out.token, out.logprob)
            })
            .collect();
        Box::new(move || picks)
    }

    fn download_rows(&self, logits: &Vec<f32>, vocab: usize, rows: &[usize]) -> Vec<f32> {
        let mut out = Vec::with_capacity(rows.len() * vocab);
        for &r in rows {
            out.extend_from_slice(&logits[r * vocab..(r + 1) * vocab]);
        }
        out
    }

    fn segment_attention(
        &self,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        bounds: &[usize],
        num_heads: usize,
        head_dim: usize,
        out: &mut Vec<f32>,
    ) {
        segment_attention::segment_attention(q, k, v, bounds, num_heads, head_dim, out);
    }

    fn gelu(&self, x: &mut Vec<f32>, len: usize) {
        segment_attention::gelu(&mut x[..len]);
    }

    fn gather_rows(&self, x: &Vec<f32>, width: usize, rows: &[usize], out: &mut Vec<f32>) {
        for (i, &r) in rows.iter().enumerate() {
            out[i * width..(i + 1) * width].copy_from_slice(&x[r * width..(r + 1) * width]);
        }
    }

    fn greedy_rows(&self, logits: &Vec<f32>, vocab: usize, rows: &[usize]) -> Vec<(u32, f32)> {
        rows.iter()
            .map(|&r| {
                let row = &logits[r * vocab..(r + 1) * vocab];
                let token = crate::sampling::argmax(row);
                let logprob = row[token as usize] - crate::sampling::log_sum_exp(row);
                (token, logprob)
            })
            .collect()
    }

    fn device_picks(&self) -> Option<&dyn crate::kernels::DevicePicks> {
        // Every pick goes to the host as `pick_rows` makes it.
        None
    }

    fn timeline_mark(&self) -> Option<crate::kernels::DeviceMark> {
        // The CPU's work is done when its call returns: no timeline of its own.
        None
    }

    fn graphs(&self) -> Option<&dyn crate::kernels::StepGraphs> {
        // Nothing to replay: a step's launches are its calls.
        None
    }

    fn recorder(&self) -> Option<&dyn crate::kernels::StepRecorder> {
        self.records_steps
            .then_some(self as &dyn crate::kernels::StepRecorder)
    }
}

impl crate::kernels::StepRecorder for CpuBackend {
    fn run_recorded(&self, _key: u64, body: &mut dyn FnMut()) {
        body();
    }

    fn forget_recorded(&self) {}
}

#[cfg(test)]
mod tests;
