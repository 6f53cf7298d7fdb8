//! Weight matrices in the CPU backend's layouts, and the row-dot kernels over them.
//!
//! By default every GGML-quantized tensor stays as the file's blocks (`Packed`) and is
//! multiplied by 8-bit activations with integer dot products (`packed`), whatever the
//! number of rows: a row's product is then the same bits alone, in a batch, or beside
//! a prefill chunk.
//! With `--exact-activations` (`from_host_exact`), Q4_1 and Q8_0 are kept quantized
//! (0.75 and 1.125 bytes a weight) and expanded to f32 inside the dot product, so the
//! arithmetic stays that of the dequantized f32 model: activations are never quantized,
//! and results differ from a dequantize-then-f32 matmul only in the order of the
//! additions. Q4_1 uses `Σ (d·q + m)·x = d·Σ q·x + m·Σ x`, with `Σ x` per block computed
//! once per activation row. There, other formats are dequantized at load; their blocks
//! are repacked: f32 scales in their own arrays, quants contiguous.

use half::f16;

use super::packed;
use super::simd::{has_avx2_fma, has_avx512};
use crate::kernels::quant::GgmlType;
use crate::kernels::{HostData, HostMatrix};

pub const QBLOCK: usize = 32;

pub enum CpuMatrix {
    F32 {
        rows: usize,
        cols: usize,
        data: Vec<f32>, // (rows, cols)
    },
    Q4_1 {
        rows: usize,
        cols: usize,
        scales: Vec<f32>, // (rows, cols / 32)
        mins: Vec<f32>,   // (rows, cols / 32)
        nibbles: Vec<u8>, // (rows, cols / 2): per block, element j low nibble, j + 16 high
    },
    Q8_0 {
        rows: usize,
        cols: usize,
        scales: Vec<f32>, // (rows, cols / 32)
        quants: Vec<i8>,  // (rows, cols)
    },
    /// The file's blocks, row after row, in one part per format (stacked q/k/v of a
    /// Q4_K_M file have two): the integer-dot path.
    Packed {
        rows: usize,
        cols: usize,
        parts: Vec<PackedPart>,
    },
    /// Batch-invariant mode: f32, k-major panels of `PANEL` rows, the invariant GEMM's
    /// operand kept resident so no step expands weights again.
    Panels {
        rows: usize,
        cols: usize,
        data: Vec<f32>, // (rows / PANEL rounded up, cols, PANEL)
    },
}

/// Rows `first_row..first_row + rows` of a `Packed` matrix, in one format.
pub struct PackedPart {
    pub ggml_type: GgmlType,
    pub first_row: usize,
    pub rows: usize,
    pub bytes: Vec<u8>,
}

impl PackedPart {
    /// The blocks of the matrix's row `r` (which this part holds).
    pub fn row(&self, r: usize) -> &[u8] {
        let row_bytes = self.bytes.len() / self.rows;
        let i = r - self.first_row;
        &self.bytes[i * row_bytes..(i + 1) * row_bytes]
    }
}

/// Output columns (weight rows) per invariant-GEMM panel: two AVX-512 registers.
pub const PANEL: usize = 32;

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

impl CpuMatrix {
    /// Quantized tensors stay packed for the integer-dot path; float ones become f32.
    pub fn from_host(m: HostMatrix) -> Self {
        let packable = |d: &HostData| matches!(d, HostData::Quantized { ggml_type, .. } if packed::is_packed(*ggml_type));
        let parts = match m.data {
            HostData::Quantized { .. } if packable(&m.data) => vec![m],
            HostData::Stacked(parts) if parts.iter().all(|p| packable(&p.data)) => parts,
            data => {
                return CpuMatrix::F32 {
                    rows: m.rows,
                    cols: m.cols,
                    data: data.into_f32(m.rows * m.cols),
                };
            }
        };
        let (rows, cols) = (parts.iter().map(|p| p.rows).sum(), parts[0].cols);
        let mut first_row = 0;
        let parts = parts
            .into_iter()
            .map(|p| {
                let HostData::Quantized { ggml_type, bytes } = p.data else {
                    unreachable!("every part was checked to be quantized")
                };
                first_row += p.rows;
                PackedPart {
                    ggml_type,
                    first_row: first_row - p.rows,
                    rows: p.rows,
                    bytes,
                }
            })
            .collect();
        CpuMatrix::Packed { rows, cols, parts }
    }

    /// The f32-activation layouts of `--exact-activations`.
    pub fn from_host_exact(m: HostMatrix) -> Self {
        let (rows, cols) = (m.rows, m.cols);
        match m.data {
            HostData::Quantized {
                ggml_type: GgmlType::Q4_1,
                bytes,
            } => {
                let nb = bytes.len() / 20;
                let (mut scales, mut mins, mut nibbles) = (
                    Vec::with_capacity(nb),
                    Vec::with_capacity(nb),
                    Vec::with_capacity(nb * 16),
                );
                for blk in bytes.chunks_exact(20) {
                    scales.push(f16_at(blk, 0));
                    mins.push(f16_at(blk, 2));
                    nibbles.extend_from_slice(&blk[4..20]);
                }
                CpuMatrix::Q4_1 {
                    rows,
                    cols,
                    scales,
                    mins,
                    nibbles,
                }
            }
            HostData::Quantized {
                ggml_type: GgmlType::Q8_0,
                bytes,
            } => {
                let nb = bytes.len() / 34;
                let (mut scales, mut quants) =
                    (Vec::with_capacity(nb), Vec::with_capacity(nb * 32));
                for blk in bytes.chunks_exact(34) {
                    scales.push(f16_at(blk, 0));
                    quants.extend(blk[2..34].iter().map(|&q| q as i8));
                }
                CpuMatrix::Q8_0 {
                    rows,
                    cols,
                    scales,
                    quants,
                }
            }
            data => CpuMatrix::F32 {
                rows,
                cols,
                data: data.into_f32(rows * cols),
            },
        }
    }

    pub fn rows(&self) -> usize {
        match *self {
            CpuMatrix::F32 { rows, .. }
            | CpuMatrix::Q4_1 { rows, .. }
            | CpuMatrix::Q8_0 { rows, .. }
            | CpuMatrix::Packed { rows, .. }
            | CpuMatrix::Panels { rows, .. } => rows,
        }
    }

    pub fn cols(&self) -> usize {
        match *self {
            CpuMatrix::F32 { cols, .. }
            | CpuMatrix::Q4_1 { cols, .. }
            | CpuMatrix::Q8_0 { cols, .. }
            | CpuMatrix::Packed { cols, .. }
            | CpuMatrix::Panels { cols, .. } => cols,
        }
    }

    /// The same matrix as resident k-major f32 panels (4 bytes a weight).
    pub fn into_panels(self) -> CpuMatrix {
        let (rows, cols) = (self.rows(), self.cols());
        let mut data = vec![0f32; rows.div_ceil(PANEL) * cols * PANEL];
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            self.dequantize_row(r, &mut row);
            let (p, c) = (r / PANEL, r % PANEL);
            for (kk, &v) in row.iter().enumerate() {
                data[(p * cols + kk) * PANEL + c] = v;
            }
        }
        CpuMatrix::Panels { rows, cols, data }
    }

    /// The part of a `Packed` matrix that holds row `r`.
    pub fn part_of(&self, r: usize) -> &PackedPart {
        let CpuMatrix::Packed { parts, .. } = self else {
            panic!("part_of asks a Packed matrix")
        };
        parts
            .iter()
            .find(|p| r < p.first_row + p.rows)
            .expect("row inside the matrix")
    }

    /// Bytes the weights take in memory.
    pub fn resident_bytes(&self) -> usize {
        match self {
            CpuMatrix::F32 { data, .. } | CpuMatrix::Panels { data, .. } => data.len() * 4,
            CpuMatrix::Q4_1 {
                scales,
                mins,
                nibbles,
                ..
            } => (scales.len() + mins.len()) * 4 + nibbles.len(),
            CpuMatrix::Q8_0 { scales, quants, .. } => scales.len() * 4 + quants.len(),
            CpuMatrix::Packed { parts, .. } => parts.iter().map(|p| p.bytes.len()).sum(),
        }
    }

    /// What the weights run in, for the model card.
    pub fn format(&self) -> String {
        match self {
            CpuMatrix::F32 { .. } => "f32".into(),
            CpuMatrix::Panels { .. } => "f32 panels".into(),
            CpuMatrix::Q4_1 { .. } => "Q4_1 × f32".into(),
            CpuMatrix::Q8_0 { .. } => "Q8_0 × f32".into(),
            CpuMatrix::Packed { parts, .. } => {
                let mut names: Vec<String> =
                    parts.iter().map(|p| format!("{:?}", p.ggml_type)).collect();
                names.dedup();
                format!("{} × q8", names.join("+"))
            }
        }
    }

    pub fn needs_block_sums(&self) -> bool {
        matches!(self, CpuMatrix::Q4_1 { .. })
    }

    /// Row `r` as f32.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let k = self.cols();
        let nb = k / QBLOCK;
        match self {
            CpuMatrix::F32 { data, .. } => out[..k].copy_from_slice(&data[r * k..(r + 1) * k]),
            CpuMatrix::Q4_1 {
                scales,
                mins,
                nibbles,
                ..
            } => {
                for b in 0..nb {
                    let (d, m) = (scales[r * nb + b], mins[r * nb + b]);
                    let qs = &nibbles[(r * nb + b) * 16..(r * nb + b + 1) * 16];
                    let y = &mut out[b * QBLOCK..(b + 1) * QBLOCK];
                    for j in 0..16 {
                        y[j] = (qs[j] & 0xF) as f32 * d + m;
                        y[j + 16] = (qs[j] >> 4) as f32 * d + m;
                    }
                }
            }
            CpuMatrix::Q8_0 { scales, quants, .. } => {
                for b in 0..nb {
                    let d = scales[r * nb + b];
                    for j in 0..QBLOCK {
                        out[b * QBLOCK + j] = quants[r * k + b * QBLOCK + j] as f32 * d;
                    }
                }
            }
            CpuMatrix::Packed { .. } => {
                let part = self.part_of(r);
                crate::kernels::quant::dequantize(part.ggml_type, part.row(r), &mut out[..k]);
            }
            CpuMatrix::Panels { data, .. } => {
                let (p, c) = (r / PANEL, r % PANEL);
                for (kk, o) in out[..k].iter_mut().enumerate() {
                    *o = data[(p * k + kk) * PANEL + c];
                }
            }
        }
    }

    /// `row r · xs[i]` for `R` activation rows; `sums[i]` holds `Σ x` per 32-block of
    /// `xs[i]` when `needs_block_sums`. A row's result does not depend on `R` or on the
    /// other rows.
    #[inline]
    pub fn dot_rows<const R: usize>(
        &self,
        r: usize,
        xs: [&[f32]; R],
        sums: [&[f32]; R],
    ) -> [f32; R] {
        let k = self.cols();
        let nb = k / QBLOCK;
        match self {
            CpuMatrix::F32 { data, .. } => {
                xs.map(|x| super::simd::dot(&data[r * k..(r + 1) * k], x))
            }
            CpuMatrix::Q4_1 {
                scales,
                mins,
                nibbles,
                ..
            } => {
                let (d, m) = (&scales[r * nb..(r + 1) * nb], &mins[r * nb..(r + 1) * nb]);
                let qs = &nibbles[r * nb * 16..(r + 1) * nb * 16];
                let mut out = dot_q4_1_rows::<R>(d, qs, xs);
                for (o, s) in out.iter_mut().zip(sums) {
                    *o += super::simd::dot(m, s);
                }
                out
            }
            CpuMatrix::Q8_0 { scales, quants, .. } => dot_q8_0_rows::<R>(
                &scales[r * nb..(r + 1) * nb],
                &quants[r * k..(r + 1) * k],
                xs,
            ),
            CpuMatrix::Packed { .. } => {
                unreachable!("packed matrices take 8-bit activations: see matmul::gemv_rows")
            }
            // One FMA chain in k order: the invariant GEMM's arithmetic, element for element.
            CpuMatrix::Panels { data, .. } => {
                let (p, c) = (r / PANEL, r % PANEL);
                xs.map(|x| {
                    (0..k).fold(0f32, |acc, kk| {
                        x[kk].mul_add(data[(p * k + kk) * PANEL + c], acc)
                    })
                })
            }
        }
    }
}

/// `Σ x` over each 32-block of `x`.
pub fn block_sums(x: &[f32], out: &mut Vec<f32>) {
    out.clear();
    out.extend(x.chunks_exact(QBLOCK).map(|b| b.iter().sum::<f32>()));
}

/// `Σ_b d[b] · Σ_j q[b][j] · x[b][j]` over Q4_1 nibbles (the `m` term is added apart),
/// for `R` activation rows at once: each block's nibbles are expanded once and used by
/// every row. Row `i`'s result comes from the same operations in the same order whatever
/// `R` is and whichever rows share the call — the batch-invariance of the CPU matmul
/// rests on this.
#[inline]
pub fn dot_q4_1_rows<const R: usize>(d: &[f32], nibbles: &[u8], xs: [&[f32]; R]) -> [f32; R] {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: AVX-512F is present (checked above); slices hold whole blocks.
        return unsafe { dot_q4_1_avx512::<R>(d, nibbles, xs) };
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: AVX2 and FMA are present (checked above); slices hold whole blocks.
        return unsafe { dot_q4_1_avx2::<R>(d, nibbles, xs) };
    }
    xs.map(|x| dot_q4_1_scalar(d, nibbles, x))
}

#[inline]
pub fn dot_q4_1(d: &[f32], nibbles: &[u8], x: &[f32]) -> f32 {
    dot_q4_1_rows::<1>(d, nibbles, [x])[0]
}

pub fn dot_q4_1_scalar(d: &[f32], nibbles: &[u8], x: &[f32]) -> f32 {
    let mut total = 0f32;
    for (b, &d) in d.iter().enumerate() {
        let qs = &nibbles[b * 16..(b + 1) * 16];
        let xb = &x[b * QBLOCK..(b + 1) * QBLOCK];
        let mut s = 0f32;
        for j in 0..16 {
            s += (qs[j] & 0xF) as f32 * xb[j] + (qs[j] >> 4) as f32 * xb[j + 16];
        }
        total += d * s;
    }
    total
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_q4_1_avx512<const R: usize>(d: &[f32], nibbles: &[u8], xs: [&[f32]; R]) -> [f32; R] {
    use std::arch::x86_64::*;
    let mask = _mm_set1_epi8(0x0F);
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    // SAFETY: block b reads nibbles[16b..16b+16] and x[32b..32b+32], inside the slices.
    unsafe {
        for (b, &scale) in d.iter().enumerate() {
            let raw = _mm_loadu_si128(nibbles.as_ptr().add(b * 16) as *const __m128i);
            let lo = _mm_and_si128(raw, mask);
            let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
            let q_lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo));
            let q_hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi));
            let scale = _mm512_set1_ps(scale);
            for (acc, x) in acc.iter_mut().zip(xs) {
                let xp = x.as_ptr().add(b * QBLOCK);
                let p = _mm512_fmadd_ps(
                    q_hi,
                    _mm512_loadu_ps(xp.add(16)),
                    _mm512_mul_ps(q_lo, _mm512_loadu_ps(xp)),
                );
                // Two accumulators break the FMA dependency chain across blocks.
                acc[b & 1] = _mm512_fmadd_ps(scale, p, acc[b & 1]);
            }
        }
        acc.map(|a| _mm512_reduce_add_ps(_mm512_add_ps(a[0], a[1])))
    }
}

/// `Σ_b d[b] · Σ_j q[b][j] · x[b][j]` over Q8_0 quants, for `R` rows at once (see
/// `dot_q4_1_rows` for why the result of a row does not depend on `R`).
#[inline]
pub fn dot_q8_0_rows<const R: usize>(d: &[f32], quants: &[i8], xs: [&[f32]; R]) -> [f32; R] {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: AVX-512F is present (checked above); slices hold whole blocks.
        return unsafe { dot_q8_0_avx512::<R>(d, quants, xs) };
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: AVX2 and FMA are present (checked above); slices hold whole blocks.
        return unsafe { dot_q8_0_avx2::<R>(d, quants, xs) };
    }
    xs.map(|x| dot_q8_0_scalar(d, quants, x))
}

#[inline]
pub fn dot_q8_0(d: &[f32], quants: &[i8], x: &[f32]) -> f32 {
    dot_q8_0_rows::<1>(d, quants, [x])[0]
}

pub fn dot_q8_0_scalar(d: &[f32], quants: &[i8], x: &[f32]) -> f32 {
    let mut total = 0f32;
    for (b, &d) in d.iter().enumerate() {
        let s: f32 = (0..QBLOCK)
            .map(|j| quants[b * QBLOCK + j] as f32 * x[b * QBLOCK + j])
            .sum();
        total += d * s;
    }
    total
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_q8_0_avx512<const R: usize>(d: &[f32], quants: &[i8], xs: [&[f32]; R]) -> [f32; R] {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    // SAFETY: block b reads quants and x at [32b, 32b + 32), inside the slices.
    unsafe {
        for (b, &scale) in d.iter().enumerate() {
            let qp = quants.as_ptr().add(b * QBLOCK) as *const __m128i;
            let q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qp)));
            let q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qp.add(1))));
            let scale = _mm512_set1_ps(scale);
            for (acc, x) in acc.iter_mut().zip(xs) {
                let xp = x.as_ptr().add(b * QBLOCK);
                let p = _mm512_fmadd_ps(
                    q1,
                    _mm512_loadu_ps(xp.add(16)),
                    _mm512_mul_ps(q0, _mm512_loadu_ps(xp)),
                );
                acc[b & 1] = _mm512_fmadd_ps(scale, p, acc[b & 1]);
            }
        }
        acc.map(|a| _mm512_reduce_add_ps(_mm512_add_ps(a[0], a[1])))
    }
}

/// The AVX2 twin of `dot_q4_1_avx512`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_q4_1_avx2<const R: usize>(d: &[f32], nibbles: &[u8], xs: [&[f32]; R]) -> [f32; R] {
    use std::arch::x86_64::*;
    let mask = _mm_set1_epi8(0x0F);
    let widen = |v: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
    // SAFETY: block b reads nibbles[16b..16b+16], inside the slice.
    let weights = |b: usize| unsafe {
        let raw = _mm_loadu_si128(nibbles.as_ptr().add(b * 16) as *const __m128i);
        let lo = _mm_and_si128(raw, mask);
        let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
        [
            widen(lo),
            widen(_mm_srli_si128(lo, 8)),
            widen(hi),
            widen(_mm_srli_si128(hi, 8)),
        ]
    };
    // SAFETY: AVX2 and FMA are enabled here; `weights` covers every block of `d`.
    unsafe { dot_blocks_avx2(d, xs, weights) }
}

/// The AVX2 twin of `dot_q8_0_avx512`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_q8_0_avx2<const R: usize>(d: &[f32], quants: &[i8], xs: [&[f32]; R]) -> [f32; R] {
    use std::arch::x86_64::*;
    // SAFETY: block b reads quants[32b..32b+32], inside the slice.
    let weights = |b: usize| unsafe {
        let qp = quants.as_ptr().add(b * QBLOCK);
        [0, 8, 16, 24].map(|o| {
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                qp.add(o) as *const __m128i
            )))
        })
    };
    // SAFETY: AVX2 and FMA are enabled here; `weights` covers every block of `d`.
    unsafe { dot_blocks_avx2(d, xs, weights) }
}

/// `Σ_b d[b] · Σ_j w[b][j] · x[b][j]` for `R` rows, block b's 32 weights from `weights(b)`
/// (four vectors of eight), expanded once for every row.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_blocks_avx2<const R: usize>(
    d: &[f32],
    xs: [&[f32]; R],
    weights: impl Fn(usize) -> [std::arch::x86_64::__m256; 4],
) -> [f32; R] {
    use std::arch::x86_64::*;
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    // SAFETY: block b reads x[32b..32b+32], inside each row.
    unsafe {
        for (b, &scale) in d.iter().enumerate() {
            let q = weights(b);
            let scale = _mm256_set1_ps(scale);
            for (acc, x) in acc.iter_mut().zip(xs) {
                let xp = x.as_ptr().add(b * QBLOCK);
                let mut p = _mm256_mul_ps(q[0], _mm256_loadu_ps(xp));
                p = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xp.add(8)), p);
                p = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xp.add(16)), p);
                p = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xp.add(24)), p);
                // Two accumulators break the FMA dependency chain across blocks.
                acc[b & 1] = _mm256_fmadd_ps(scale, p, acc[b & 1]);
            }
        }
        acc.map(|a| hsum256(_mm256_add_ps(a[0], a[1])))
    }
}

/// The sum of an AVX register's eight lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn hsum256(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks(nb: usize) -> (Vec<f32>, Vec<u8>, Vec<i8>, [Vec<f32>; 2]) {
        let d: Vec<f32> = (0..nb).map(|b| 0.01 * (b as f32 + 1.0)).collect();
        let bits = |i: usize| crate::sampling::splitmix64(i as u64);
        let nibbles = (0..nb * 16).map(|i| bits(i) as u8).collect();
        let quants = (0..nb * QBLOCK).map(|i| bits(7 + i) as i8).collect();
        let x = |s: usize| {
            (0..nb * QBLOCK)
                .map(|i| ((i * 7 + s) % 23) as f32 / 11.0 - 1.0)
                .collect()
        };
        (d, nibbles, quants, [x(0), x(5)])
    }

    /// A path's name, its Q4_1 and Q8_0 dots of two rows, and the second row's alone.
    type PathDots = (&'static str, [f32; 2], [f32; 2], f32, f32);

    /// Each vector path this CPU has against the scalar one, and a row's bits the same
    /// whichever rows share the call (the batch-invariant matmul rests on it).
    #[test]
    fn every_vector_path_matches_the_scalar_dot_and_keeps_rows_apart() {
        let close = |a: f32, b: f32| (a - b).abs() <= 1e-4 * b.abs().max(1.0);
        for nb in [1, 2, 9] {
            let (d, nibbles, quants, [x0, x1]) = blocks(nb);
            let want_q4 = [0, 1].map(|i| dot_q4_1_scalar(&d, &nibbles, [&x0, &x1][i]));
            let want_q8 = [0, 1].map(|i| dot_q8_0_scalar(&d, &quants, [&x0, &x1][i]));
            let mut paths: Vec<PathDots> = Vec::new();
            #[cfg(target_arch = "x86_64")]
            if has_avx2_fma() {
                // SAFETY: AVX2 and FMA are present; the slices hold whole blocks.
                unsafe {
                    paths.push((
                        "avx2",
                        dot_q4_1_avx2::<2>(&d, &nibbles, [&x0, &x1]),
                        dot_q8_0_avx2::<2>(&d, &quants, [&x0, &x1]),
                        dot_q4_1_avx2::<1>(&d, &nibbles, [&x1])[0],
                        dot_q8_0_avx2::<1>(&d, &quants, [&x1])[0],
                    ));
                }
            }
            #[cfg(target_arch = "x86_64")]
            if has_avx512() {
                // SAFETY: AVX-512F is present; the slices hold whole blocks.
                unsafe {
                    paths.push((
                        "avx512",
                        dot_q4_1_avx512::<2>(&d, &nibbles, [&x0, &x1]),
                        dot_q8_0_avx512::<2>(&d, &quants, [&x0, &x1]),
                        dot_q4_1_avx512::<1>(&d, &nibbles, [&x1])[0],
                        dot_q8_0_avx512::<1>(&d, &quants, [&x1])[0],
                    ));
                }
            }
            for (path, q4, q8, q4_alone, q8_alone) in paths {
                for i in 0..2 {
                    assert!(close(q4[i], want_q4[i]), "{path} q4_1 {nb} blocks row {i}");
                    assert!(close(q8[i], want_q8[i]), "{path} q8_0 {nb} blocks row {i}");
                }
                assert_eq!(q4[1].to_bits(), q4_alone.to_bits(), "{path} q4_1 row apart");
                assert_eq!(q8[1].to_bits(), q8_alone.to_bits(), "{path} q8_0 row apart");
            }
        }
    }
}
