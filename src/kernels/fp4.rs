//! MXFP4 weights as DeepSeek-V4 ships its routed experts: two E2M1 values a byte (the low
//! nibble first) and one E8M0 exponent — a power-of-two scale 2^(e − 127) — for every 32
//! consecutive values of a row (the OCP microscaling layout transformers reads).

/// Values a row shares one exponent with.
pub const MXFP4_GROUP: usize = 32;

/// E2M1's sixteen values: sign, two exponent bits, one mantissa bit.
pub const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// An E8M0 exponent's scale, 2^(e − 127); 255 (NaN in E8M0) is refused at load.
pub fn e8m0_scale(e: u8) -> f32 {
    2f32.powi(e as i32 - 127)
}

/// The E8M0 exponent of `scale`, where it is a power of two E8M0 holds.
pub fn e8m0_of(scale: f32) -> Option<u8> {
    if !(scale > 0.0 && scale.is_finite()) {
        return None;
    }
    let e = scale.log2().round() as i32 + 127;
    ((0..255).contains(&e) && e8m0_scale(e as u8) == scale).then_some(e as u8)
}

/// `--dummy-weights`' MXFP4 exponent: 2^-7 puts random E2M1 codes (RMS 2.9) at an RMS of
/// 0.023, near the 0.02 of the dense dummy weights.
pub const DUMMY_EXPONENT: u8 = 120;

/// Byte `i` of dummy packed codes from `seed`; the CUDA kernel computes the same.
pub fn random_byte(seed: u64, i: u64) -> u8 {
    let h = crate::sampling::splitmix64(seed ^ crate::sampling::splitmix64(i / 8));
    (h >> (8 * (i % 8))) as u8
}

/// A `[rows, cols]` MXFP4 matrix in host memory.
#[derive(Clone, Debug, PartialEq)]
pub struct Mxfp4Matrix {
    /// `rows · cols / 2` bytes, row-major.
    pub bytes: Vec<u8>,
    /// `rows · cols / 32` exponents, row-major.
    pub exponents: Vec<u8>,
    pub cols: usize,
}

impl Mxfp4Matrix {
    /// The matrix of packed `bytes` and per-32 `scales` (each a power of two), or why not.
    pub fn new(bytes: Vec<u8>, scales: &[f32], cols: usize) -> Result<Self, String> {
        if cols == 0 || !cols.is_multiple_of(MXFP4_GROUP) {
            return Err(format!(
                "{cols} columns are not whole groups of {MXFP4_GROUP}"
            ));
        }
        let rows = bytes.len() * 2 / cols;
        if rows * cols != bytes.len() * 2 || scales.len() != rows * cols / MXFP4_GROUP {
            return Err(format!(
                "{} bytes and {} scales do not make [{rows}, {cols}] MXFP4",
                bytes.len(),
                scales.len()
            ));
        }
        let exponents = scales
            .iter()
            .map(|&s| e8m0_of(s).ok_or_else(|| format!("scale {s} is not an E8M0 power of two")))
            .collect::<Result<_, _>>()?;
        Ok(Mxfp4Matrix {
            bytes,
            exponents,
            cols,
        })
    }

    /// `--dummy-weights`' matrix of `seed`: random codes, every group at `DUMMY_EXPONENT`.
    pub fn random(rows: usize, cols: usize, seed: u64) -> Self {
        assert!(cols.is_multiple_of(MXFP4_GROUP), "{cols} columns");
        Mxfp4Matrix {
            bytes: (0..(rows * cols / 2) as u64)
                .map(|i| random_byte(seed, i))
                .collect(),
            exponents: vec![DUMMY_EXPONENT; rows * cols / MXFP4_GROUP],
            cols,
        }
    }

    pub fn rows(&self) -> usize {
        self.bytes.len() * 2 / self.cols
    }

    /// The exact values, row-major.
    pub fn to_f32(&self) -> Vec<f32> {
        self.bytes
            .chunks_exact(MXFP4_GROUP / 2)
            .zip(&self.exponents)
            .flat_map(|(group, &e)| {
                let scale = e8m0_scale(e);
                group.iter().flat_map(move |&b| {
                    [
                        E2M1[(b & 0xF) as usize] * scale,
                        E2M1[(b >> 4) as usize] * scale,
                    ]
                })
            })
            .collect()
    }

    /// Bytes resident where it is kept packed.
    pub fn packed_bytes(&self) -> usize {
        self.bytes.len() + self.exponents.len()
    }

    /// The same codes and exponents as ggml's MXFP4 blocks (`GgmlType::MXFP4`, what the
    /// CPU's integer dot reads): per 32 values the exponent, then value j's code in byte
    /// j's low nibble and value j + 16's in its high nibble. Nothing is rounded.
    pub fn to_ggml_blocks(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.exponents.len() * GGML_BLOCK_BYTES];
        let groups = self
            .bytes
            .chunks_exact(MXFP4_GROUP / 2)
            .zip(&self.exponents);
        for (blk, (codes, &e)) in out.chunks_exact_mut(GGML_BLOCK_BYTES).zip(groups) {
            ggml_block(blk, e, |i| codes[i]);
        }
        out
    }

    /// `random(rows, cols, seed).to_ggml_blocks()`, made in parallel without the
    /// row-major copy (a whole model's host experts are tens of gigabytes).
    pub fn random_ggml_blocks(rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        use rayon::prelude::*;
        assert!(cols.is_multiple_of(MXFP4_GROUP), "{cols} columns");
        let mut out = vec![0u8; rows * cols / MXFP4_GROUP * GGML_BLOCK_BYTES];
        out.par_chunks_mut(GGML_BLOCK_BYTES * 1024)
            .enumerate()
            .for_each(|(chunk, blocks)| {
                for (i, blk) in blocks.chunks_exact_mut(GGML_BLOCK_BYTES).enumerate() {
                    let first = ((chunk * 1024 + i) * MXFP4_GROUP / 2) as u64;
                    ggml_block(blk, DUMMY_EXPONENT, |j| random_byte(seed, first + j as u64));
                }
            });
        out
    }
}

/// Bytes of one ggml MXFP4 block: the exponent and 16 bytes of codes.
pub const GGML_BLOCK_BYTES: usize = 1 + MXFP4_GROUP / 2;

/// One ggml block from exponent `e` and the group's 16 row-major code bytes
/// (`code_byte(i)`: values 2i, 2i + 1).
fn ggml_block(blk: &mut [u8], e: u8, code_byte: impl Fn(usize) -> u8) {
    blk[0] = e;
    blk[1..].fill(0);
    for i in 0..MXFP4_GROUP / 2 {
        let b = code_byte(i);
        for (v, code) in [(2 * i, b & 0xF), (2 * i + 1, b >> 4)] {
            let (j, shift) = (v % 16, 4 * (v / 16));
            blk[1 + j] |= code << shift;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exponents_round_trip_and_non_powers_are_refused() {
        for e in [1u8, 100, 127, 130, 254] {
            assert_eq!(e8m0_of(e8m0_scale(e)), Some(e));
        }
        for bad in [0.0f32, -1.0, 3.0, f32::NAN, f32::INFINITY] {
            assert_eq!(e8m0_of(bad), None, "{bad}");
        }
    }

    #[test]
    fn values_come_low_nibble_first_times_their_groups_scale() {
        let cols = 64;
        let bytes: Vec<u8> = (0..cols as u8).map(|i| i.wrapping_mul(37)).collect();
        let m = Mxfp4Matrix::new(bytes.clone(), &[0.5, 4.0, 1.0, 0.25], cols).unwrap();
        assert_eq!(m.rows(), 2);
        let v = m.to_f32();
        for (i, &b) in bytes.iter().enumerate() {
            let scale = [0.5, 4.0, 1.0, 0.25][i * 2 / 32];
            assert_eq!(v[2 * i], E2M1[(b & 15) as usize] * scale);
            assert_eq!(v[2 * i + 1], E2M1[(b >> 4) as usize] * scale);
        }
        assert!(Mxfp4Matrix::new(bytes, &[0.5, 3.0, 1.0, 0.25], cols).is_err());
    }

    /// ggml's blocks hold the same values: read back by ggml's own dequantization rule
    /// (`quant::dequantize`, checked against the `gguf` package's for the other formats).
    #[test]
    fn ggml_blocks_hold_the_same_values() {
        for (rows, cols, seed) in [(3, 64, 1u64), (5, 96, 7), (1, 32, 99)] {
            let mut m = Mxfp4Matrix::random(rows, cols, seed);
            for (i, e) in m.exponents.iter_mut().enumerate() {
                *e = [1u8, 0, 127, 130, 200, 254][(i + seed as usize) % 6];
            }
            let mut got = vec![0f32; rows * cols];
            crate::kernels::quant::dequantize(
                crate::kernels::quant::GgmlType::MXFP4,
                &m.to_ggml_blocks(),
                &mut got,
            );
            let want = m.to_f32();
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.to_bits() & 0x7fff_ffff, w.to_bits() & 0x7fff_ffff, "{i}");
            }
            assert_eq!(
                Mxfp4Matrix::random_ggml_blocks(rows, cols, seed),
                Mxfp4Matrix::random(rows, cols, seed).to_ggml_blocks()
            );
        }
    }
}
