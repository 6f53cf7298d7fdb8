//! FP8 e4m3fn weights with one f32 scale per block of the matrix, the two layouts
//! checkpoints ship: HF's `quant_method: fp8` (128×128 blocks, `weight_scale_inv`) and
//! compressed-tensors' per-channel scales (`weight_scale`, one per output row, a block of
//! 1×cols); `--quantization fp8` makes the per-channel kind from dense weights at load.
//! The value of element (r, c) is `e4m3(bytes[r·cols + c]) · scales[(r / block_rows) ·
//! grid_cols + c / block_cols]`.

use std::ops::Range;

/// `--quantization`: how a backend stores a dense checkpoint's layer projections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Quantization {
    /// Per-channel FP8 e4m3 made at load (embeddings and the LM head stay as they are).
    Fp8,
}

impl std::str::FromStr for Quantization {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fp8" => Ok(Quantization::Fp8),
            other => Err(format!(
                "quantization `{other}` is not supported (fp8 is; quantized GGUF files load as they are)"
            )),
        }
    }
}

/// The largest finite e4m3fn value: per-channel quantization maps each row's largest
/// magnitude onto it.
pub const E4M3_MAX: f32 = 448.0;

/// FP8 e4m3fn (no infinities; S.1111.111 is NaN): exact in f32.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((b >> 3) & 0xF) as i32;
    let mant = (b & 0x7) as f32;
    if exp == 0xF && b & 0x7 == 0x7 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * mant / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + mant / 8.0) * 2f32.powi(exp - 7)
    }
}

/// The nearest e4m3fn value, ties to an even mantissa, as torch's `to(float8_e4m3fn)`
/// rounds; magnitudes past 448 saturate (a scale that maps a row's maximum onto 448 can
/// land a hair above it) and NaN stays NaN.
pub fn f32_to_e4m3(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    if a.is_nan() {
        return sign | 0x7F;
    }
    // Below the smallest normal (2^-6) the step is 2^-9: a mantissa of 8 is the smallest
    // normal's encoding, so the carry needs no special case.
    if a < 2f32.powi(-6) {
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    let bits = a.to_bits();
    let exp = (bits >> 23) as i32 - 127 + 7;
    if exp > 15 {
        return sign | 0x7E;
    }
    let mant = bits & 0x7F_FFFF;
    let (mut keep, rest) = (mant >> 20, mant & 0xF_FFFF);
    if rest > 0x8_0000 || (rest == 0x8_0000 && keep & 1 == 1) {
        keep += 1;
    }
    let code = ((exp as u32) << 3) + keep;
    sign | code.min(0x7E) as u8
}

/// An FP8 matrix in host memory (see the module doc for the layout).
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8Matrix {
    pub bytes: Vec<u8>,
    pub scales: Vec<f32>,
    pub cols: usize,
    pub block_rows: usize,
    pub block_cols: usize,
}

impl Fp8Matrix {
    /// A raw e4m3 tensor as a checkpoint stores it, before its scales are known: one block
    /// of scale 1.
    pub fn unscaled(bytes: Vec<u8>, cols: usize) -> Self {
        let rows = bytes.len() / cols.max(1);
        Fp8Matrix {
            bytes,
            scales: vec![1.0],
            cols,
            block_rows: rows.max(1),
            block_cols: cols.max(1),
        }
    }

    pub fn rows(&self) -> usize {
        self.bytes.len() / self.cols.max(1)
    }

    pub fn grid_cols(&self) -> usize {
        self.cols.div_ceil(self.block_cols)
    }

    /// These bytes with the scale grid `scales` of `grid` = (rows, cols) blocks: per
    /// tensor ([1, 1]), per channel ([rows, 1]), or blocks of `block` (HF's
    /// `weight_block_size`, 128×128 where the config names none).
    pub fn with_scales(
        self,
        scales: Vec<f32>,
        grid: (usize, usize),
        block: (usize, usize),
    ) -> Result<Self, String> {
        let (rows, cols) = (self.rows(), self.cols);
        let (block_rows, block_cols) = match grid {
            (1, 1) => (rows.max(1), cols.max(1)),
            (r, 1) if r == rows => (1, cols.max(1)),
            (r, c) if r == rows.div_ceil(block.0) && c == cols.div_ceil(block.1) => block,
            (r, c) => {
                return Err(format!(
                    "a {r}×{c} scale grid fits neither per-tensor, per-channel nor {}×{} blocks of a [{rows}, {cols}] weight",
                    block.0, block.1
                ));
            }
        };
        if scales.len() != grid.0 * grid.1 {
            return Err(format!(
                "{} scales for a {}×{} grid",
                scales.len(),
                grid.0,
                grid.1
            ));
        }
        Ok(Fp8Matrix {
            scales,
            block_rows,
            block_cols,
            ..self
        })
    }

    /// Per-channel quantization of a dense `[rows, cols]` matrix: each row's scale maps its
    /// largest magnitude onto 448 (an all-zero row gets scale 1).
    pub fn quantize_rows(values: &[f32], cols: usize) -> Self {
        let mut bytes = Vec::with_capacity(values.len());
        let mut scales = Vec::with_capacity(values.len() / cols.max(1));
        for row in values.chunks(cols.max(1)) {
            let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
            let scale = if amax > 0.0 { amax / E4M3_MAX } else { 1.0 };
            bytes.extend(row.iter().map(|&v| f32_to_e4m3(v / scale)));
            scales.push(scale);
        }
        Fp8Matrix {
            bytes,
            scales,
            cols,
            block_rows: 1,
            block_cols: cols.max(1),
        }
    }

    pub fn scale(&self, row: usize, col: usize) -> f32 {
        self.scales[(row / self.block_rows) * self.grid_cols() + col / self.block_cols]
    }

    pub fn to_f32(&self) -> Vec<f32> {
        let cols = self.cols.max(1);
        self.bytes
            .iter()
            .enumerate()
            .map(|(i, &b)| e4m3_to_f32(b) * self.scale(i / cols, i % cols))
            .collect()
    }

    /// Rows `rows` and columns `cols`, still FP8, where both cut on block boundaries (a
    /// tensor-parallel shard); `None` where a cut falls inside a block.
    pub fn sliced(&self, rows: Range<usize>, cols: Range<usize>) -> Option<Self> {
        // A block spanning the whole dimension (per-tensor rows, per-channel columns) can be
        // cut anywhere: it becomes the slice's one block.
        let whole_rows = self.block_rows >= self.rows();
        let whole_cols = self.block_cols >= self.cols;
        let (br, bc) = (
            if whole_rows {
                rows.len().max(1)
            } else {
                self.block_rows
            },
            if whole_cols {
                cols.len().max(1)
            } else {
                self.block_cols
            },
        );
        let on = |r: &Range<usize>, b: usize, len: usize| {
            r.start.is_multiple_of(b) && (r.end.is_multiple_of(b) || r.end == len)
        };
        if !(whole_rows || on(&rows, br, self.rows())) || !(whole_cols || on(&cols, bc, self.cols))
        {
            return None;
        }
        let bytes = rows
            .clone()
            .flat_map(|r| &self.bytes[r * self.cols + cols.start..r * self.cols + cols.end])
            .copied()
            .collect();
        let grid_rows = if whole_rows {
            0..1
        } else {
            rows.start / br..rows.end.div_ceil(br)
        };
        let grid_cols = if whole_cols {
            0..1
        } else {
            cols.start / bc..cols.end.div_ceil(bc)
        };
        let scales = grid_rows
            .flat_map(|g| {
                let at = g * self.grid_cols();
                self.scales[at + grid_cols.start..at + grid_cols.end].to_vec()
            })
            .collect();
        Some(Fp8Matrix {
            bytes,
            scales,
            cols: cols.len(),
            block_rows: br,
            block_cols: bc,
        })
    }

    /// Matrices of equal width and block shape stacked by rows, still FP8, where every part
    /// but the last ends on a block boundary; `None` otherwise.
    pub fn concat(parts: &[&Fp8Matrix]) -> Option<Self> {
        let first = parts.first()?;
        let (cols, bc) = (first.cols, first.block_cols);
        let br = first.block_rows;
        let fits = parts.iter().enumerate().all(|(i, p)| {
            p.cols == cols
                && p.block_cols == bc
                && p.block_rows == br
                && (i + 1 == parts.len() || p.rows().is_multiple_of(br))
        });
        if !fits {
            return None;
        }
        Some(Fp8Matrix {
            bytes: parts.iter().flat_map(|p| p.bytes.iter().copied()).collect(),
            scales: parts
                .iter()
                .flat_map(|p| p.scales.iter().copied())
                .collect(),
            cols,
            block_rows: br,
            block_cols: bc,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_finite_code_round_trips() {
        for b in 0..=255u8 {
            if b & 0x7F == 0x7F {
                assert!(e4m3_to_f32(b).is_nan());
                continue;
            }
            assert_eq!(f32_to_e4m3(e4m3_to_f32(b)), b, "code {b:#04x}");
        }
    }

    #[test]
    fn midpoints_round_to_the_even_code_and_large_values_saturate() {
        for b in 0..0x7Eu8 {
            let (lo, hi) = (e4m3_to_f32(b), e4m3_to_f32(b + 1));
            let even = if b & 1 == 0 { b } else { b + 1 };
            assert_eq!(f32_to_e4m3((lo + hi) / 2.0), even, "between {lo} and {hi}");
            assert_eq!(f32_to_e4m3(-(lo + hi) / 2.0), 0x80 | even);
        }
        assert_eq!(f32_to_e4m3(1.0e6), 0x7E);
        assert_eq!(f32_to_e4m3(-460.0), 0xFE);
    }

    fn blocked(rows: usize, cols: usize, block: usize) -> Fp8Matrix {
        let bytes = (0..rows * cols).map(|i| (i % 0x7E) as u8).collect();
        let grid = (rows.div_ceil(block), cols.div_ceil(block));
        let scales = (0..grid.0 * grid.1).map(|i| 1.0 + i as f32).collect();
        Fp8Matrix::unscaled(bytes, cols)
            .with_scales(scales, grid, (block, block))
            .unwrap()
    }

    #[test]
    fn slices_and_stacks_on_block_boundaries_keep_the_values() {
        let m = blocked(10, 12, 4);
        let all = m.to_f32();
        let s = m.sliced(4..10, 4..12).expect("on block boundaries");
        let want: Vec<f32> = (4..10)
            .flat_map(|r| all[r * 12 + 4..r * 12 + 12].to_vec())
            .collect();
        assert_eq!(s.to_f32(), want);
        assert!(m.sliced(2..6, 0..12).is_none());
        let (a, b) = (blocked(8, 12, 4), blocked(6, 12, 4));
        let stacked = Fp8Matrix::concat(&[&a, &b]).expect("a ends on a block boundary");
        let mut want = a.to_f32();
        want.extend(b.to_f32());
        assert_eq!(stacked.to_f32(), want);
        assert!(Fp8Matrix::concat(&[&b, &a]).is_none());
    }

    #[test]
    fn per_channel_quantization_bounds_each_element_by_half_a_step() {
        let values: Vec<f32> = (0..6 * 40)
            .map(|i| ((i * 7919) % 1000) as f32 / 100.0 - 5.0)
            .collect();
        let q = Fp8Matrix::quantize_rows(&values, 40);
        for (i, (&v, d)) in values.iter().zip(q.to_f32()).enumerate() {
            let scale = q.scales[i / 40];
            // e4m3 keeps 3 mantissa bits: a relative step of 2^-3, half of it after rounding,
            // and an absolute 2^-10 in the subnormal range.
            let bound = (v.abs() / 16.0).max(scale * 2f32.powi(-10));
            assert!((v - d).abs() <= bound * 1.0001, "{v} -> {d} at {i}");
        }
    }
}
