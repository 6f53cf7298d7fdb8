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

pub use super::exact_dot::QBLOCK;
use super::exact_dot::{dot_q4_1_rows, dot_q8_0_rows};
use super::packed;
use crate::kernels::quant::GgmlType;
use crate::kernels::{HostData, HostMatrix};

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

    /// The blocks of a matrix packed in one format, as held (what a device reads in place
    /// when a host-resident expert is streamed to it); `None` for any other layout.
    pub fn packed_blocks(&self) -> Option<(GgmlType, &[u8])> {
        match self {
            CpuMatrix::Packed { parts, .. } if parts.len() == 1 => {
                Some((parts[0].ggml_type, &parts[0].bytes))
            }
            _ => None,
        }
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
