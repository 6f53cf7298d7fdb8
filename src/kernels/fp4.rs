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
}
