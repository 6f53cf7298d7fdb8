//! GGML-quantized weights kept as the file's blocks, multiplied by 8-bit-quantized
//! activations with integer dot products, as llama.cpp does.
//!
//! Activations are quantized to 8 bits with one scale per 4 elements (`d = max|x| / 127`,
//! round half to even): the kernel's integer sums cover 4 elements each, so a scale per
//! sum costs one vector load instead of a broadcast, and the rounding is far finer than
//! llama.cpp's per-32 (Q8_0/Q8_1) or per-256 (Q8_K) scales — outliers no longer coarsen
//! their neighbours. Per 32 weights and row the kernel forms eight 4-element integer
//! sums (exact), converts them and accumulates `sum · scale · d` in eight f32 lanes (in
//! registers: one chain per row); formats with a min
//! add `min · Σx` per 16 elements in two more lanes. The scalar kernel mirrors the vector lanes
//! operation for operation, so every path gives the same bits (tested): a result does
//! not depend on the CPU it ran on, nor on the rows that share the call.

mod formats;
#[cfg(target_arch = "x86_64")]
mod mxfp4_x86;
#[cfg(target_arch = "x86_64")]
mod x86;

use formats::BlockFormat;

use super::simd::{CpuPath, cpu_path};
use crate::kernels::quant::GgmlType;

/// Elements per activation block (the weights' sub-block).
pub const ACT_BLOCK: usize = 32;
/// Elements per activation scale: one integer sum of the kernel.
pub const ACT_GROUP: usize = 4;

/// Rows of activations quantized to 8 bits: per 4 elements a scale `d` and `−Σ q` (the
/// offset correction of kernels that make signed codes unsigned), per 16 the sum
/// `Σ d · q` that the min terms multiply.
#[derive(Default)]
pub struct Q8Act {
    cols: usize,
    quants: Vec<i8>,
    scales: Vec<f32>,
    neg_group_sums: Vec<i32>,
    sums: Vec<f32>,
}

/// One row of `Q8Act`.
#[derive(Clone, Copy)]
pub struct Q8Row<'a> {
    pub quants: &'a [i8],
    pub scales: &'a [f32],
    pub neg_group_sums: &'a [i32],
    pub sums: &'a [f32],
}

impl Q8Act {
    /// `x` holds `rows` rows of `cols` elements; `cols` is a multiple of 32.
    pub fn quantize(&mut self, x: &[f32], rows: usize, cols: usize) {
        assert_eq!(
            cols % ACT_BLOCK,
            0,
            "activation width {cols} is not whole blocks"
        );
        self.cols = cols;
        self.quants.resize(rows * cols, 0);
        self.scales.resize(rows * cols / ACT_GROUP, 0.0);
        self.neg_group_sums.resize(rows * cols / ACT_GROUP, 0);
        self.sums.resize(rows * cols / 16, 0.0);
        let groups = x[..rows * cols].chunks_exact(ACT_GROUP);
        let quants = self.quants.chunks_exact_mut(ACT_GROUP);
        let outs = self.scales.iter_mut().zip(&mut self.neg_group_sums);
        for ((xg, qg), (d_out, neg_sum)) in groups.zip(quants).zip(outs) {
            let amax = xg.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            for (q, &v) in qg.iter_mut().zip(xg) {
                *q = round_half_even(v * inv) as i8;
            }
            *d_out = d;
            *neg_sum = -qg.iter().map(|&q| q as i32).sum::<i32>();
        }
        // Per 16 elements, `Σ d · q` over its four groups (no scratch: this runs per matmul).
        let halves = self
            .quants
            .chunks_exact(16)
            .zip(self.scales.chunks_exact(16 / ACT_GROUP));
        for (s, (q, d)) in self.sums.iter_mut().zip(halves) {
            *s = q
                .chunks_exact(ACT_GROUP)
                .zip(d)
                .map(|(q, &d)| d * q.iter().map(|&v| v as i32).sum::<i32>() as f32)
                .sum();
        }
    }

    pub fn row(&self, i: usize) -> Q8Row<'_> {
        let k = self.cols;
        Q8Row {
            quants: &self.quants[i * k..(i + 1) * k],
            scales: &self.scales[i * k / ACT_GROUP..(i + 1) * k / ACT_GROUP],
            neg_group_sums: &self.neg_group_sums[i * k / ACT_GROUP..(i + 1) * k / ACT_GROUP],
            sums: &self.sums[i * k / 16..(i + 1) * k / 16],
        }
    }
}

/// `v` rounded to the nearest integer, ties to even, for |v| ≤ 2^22: adding and taking
/// away 1.5 · 2^23 leaves no fraction bits, and the default rounding mode rounds the sum
/// to even. Unlike `round_ties_even` (a libm call without SSE4.1) it vectorizes.
#[inline(always)]
fn round_half_even(v: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (v + MAGIC) - MAGIC
}

/// `out[j][i] = w_j · x_i` for the `out.len()` weight rows held in `w` (whole blocks of
/// the file, row after row) and `R` activation rows. One call serves a run of rows, so
/// the checks and the dispatch are paid once per run, not once per row.
pub type RowDot<const R: usize> = fn(&[u8], [Q8Row<'_>; R], &mut [[f32; R]]);

/// Whether `ty` has an integer dot product here.
pub fn is_packed(ty: GgmlType) -> bool {
    row_dot::<1>(ty).is_some()
}

/// The row-dot kernel for `ty` on this CPU's best path.
pub fn row_dot<const R: usize>(ty: GgmlType) -> Option<RowDot<R>> {
    row_dot_on(ty, cpu_path())
}

fn row_dot_on<const R: usize>(ty: GgmlType, path: CpuPath) -> Option<RowDot<R>> {
    use formats::*;
    fn pick<F: BlockFormat, const R: usize>(path: CpuPath) -> RowDot<R> {
        #[cfg(target_arch = "x86_64")]
        match path {
            CpuPath::Avx512Vnni => return x86::dot_vnni_checked::<F, R>,
            CpuPath::Avx2 | CpuPath::Avx512 => return x86::dot_avx2_checked::<F, R>,
            CpuPath::Scalar => {}
        }
        let _ = path;
        dot_scalar::<F, R>
    }
    Some(match ty {
        GgmlType::Q4_0 => pick::<Q4_0, R>(path),
        GgmlType::Q4_1 => pick::<Q4_1, R>(path),
        GgmlType::Q5_0 => pick::<Q5_0, R>(path),
        GgmlType::Q5_1 => pick::<Q5_1, R>(path),
        GgmlType::Q8_0 => pick::<Q8_0, R>(path),
        GgmlType::Q2K => pick::<Q2K, R>(path),
        GgmlType::Q3K => pick::<Q3K, R>(path),
        GgmlType::Q4K => pick::<Q4K, R>(path),
        GgmlType::Q5K => pick::<Q5K, R>(path),
        GgmlType::Q6K => pick::<Q6K, R>(path),
        GgmlType::IQ4NL => pick::<IQ4NL, R>(path),
        GgmlType::IQ4XS => pick::<IQ4XS, R>(path),
        #[cfg(target_arch = "x86_64")]
        GgmlType::MXFP4
            if R < 4 && path == CpuPath::Avx512Vnni && mxfp4_kernel() != Mxfp4Kernel::Shared =>
        {
            mxfp4_x86::dot_mxfp4_checked::<R>
        }
        GgmlType::MXFP4 => pick::<Mxfp4, R>(path),
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => return None,
    })
}

/// Which kernel MXFP4 rows take on the AVX-512 VNNI path (`TROUPE_MXFP4_KERNEL`, to
/// measure one against another; the same bits from each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mxfp4Kernel {
    /// `shared`: the kernel every format shares.
    Shared,
    /// The default: its own kernel, one block a step (`mxfp4_x86::row_dot`).
    Narrow,
    /// `wide`: two blocks a 512-bit step where AVX-512 VBMI is present, else `Narrow`.
    /// Slower where measured (BENCHMARKS.md: 0.8–0.9× streamed on an Ice Lake Xeon);
    /// kept to measure on hosts with a lighter 512-bit clock penalty.
    Wide,
}

fn mxfp4_kernel() -> Mxfp4Kernel {
    static KERNEL: crate::sync::OnceLock<Mxfp4Kernel> = crate::sync::OnceLock::new();
    *KERNEL.get_or_init(|| match std::env::var("TROUPE_MXFP4_KERNEL").as_deref() {
        Ok("shared") => Mxfp4Kernel::Shared,
        Ok("wide") => Mxfp4Kernel::Wide,
        _ => Mxfp4Kernel::Narrow,
    })
}

/// The bytes of one weight row; panics unless `w` is `rows` rows of whole blocks and
/// every activation row covers as many elements.
fn check_shapes<F: BlockFormat, const R: usize>(
    w: &[u8],
    rows: usize,
    xs: &[Q8Row<'_>; R],
) -> usize {
    assert!(
        rows > 0 && w.len().is_multiple_of(rows),
        "{} bytes are not {rows} rows",
        w.len()
    );
    let row_bytes = w.len() / rows;
    assert_eq!(row_bytes % F::BYTES, 0, "a partial {:?} block", F::TYPE);
    let k = row_bytes / F::BYTES * F::SUBS * ACT_BLOCK;
    for x in xs {
        assert!(
            x.quants.len() >= k
                && x.scales.len() >= k / ACT_GROUP
                && x.neg_group_sums.len() >= k / ACT_GROUP
                && x.sums.len() >= k / 16,
            "activation row shorter than the weight row"
        );
    }
    row_bytes
}

/// The vector kernels' arithmetic in scalar code, lane for lane.
fn dot_scalar<F: BlockFormat, const R: usize>(w: &[u8], xs: [Q8Row<'_>; R], out: &mut [[f32; R]]) {
    let row_bytes = check_shapes::<F, R>(w, out.len(), &xs);
    for (row, o) in w.chunks_exact(row_bytes).zip(out) {
        *o = dot_row_scalar::<F, R>(row, xs);
    }
}

fn dot_row_scalar<F: BlockFormat, const R: usize>(w: &[u8], xs: [Q8Row<'_>; R]) -> [f32; R] {
    let mut acc = [[0f32; 8]; R];
    let mut min_acc = [[0f32; 2]; R];
    let (mut scales, mut mins, mut q) = ([0f32; 16], [0f32; 16], [0i8; 32]);
    for (b, blk) in w.chunks_exact(F::BYTES).enumerate() {
        F::scales::<formats::SoftF16>(blk, &mut scales, &mut mins);
        for sub in 0..F::SUBS {
            F::quants(blk, sub, &mut q);
            let g = b * F::SUBS + sub;
            for (r, x) in xs.iter().enumerate() {
                let xq = &x.quants[g * ACT_BLOCK..(g + 1) * ACT_BLOCK];
                let d = &x.scales[g * 8..g * 8 + 8];
                for lane in 0..8 {
                    let isum: i32 = (4 * lane..4 * lane + 4)
                        .map(|e| q[e] as i32 * xq[e] as i32)
                        .sum();
                    let scale = scales[2 * sub + lane / 4] * d[lane];
                    acc[r][lane] = (isum as f32).mul_add(scale, acc[r][lane]);
                }
                if F::HAS_MIN {
                    for h in 0..2 {
                        let m = &mut min_acc[r][h];
                        *m = mins[2 * sub + h].mul_add(x.sums[2 * g + h], *m);
                    }
                }
            }
        }
    }
    std::array::from_fn(|r| {
        let four: [f32; 4] = std::array::from_fn(|i| acc[r][i] + acc[r][i + 4]);
        ((four[0] + four[2]) + (four[1] + four[3])) + (min_acc[r][0] + min_acc[r][1])
    })
}

#[cfg(test)]
mod tests;
