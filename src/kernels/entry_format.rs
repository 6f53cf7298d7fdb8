//! How DeepSeek-V4's compressed cache stores a row of `dim` values (an entry), the seed's
//! layouts (§8.1) with the data first and its scales after it:
//! - `Fp8`: e4m3, one f32 scale per 128 values (their largest magnitude maps to 448): 528
//!   bytes an entry of 512.
//! - `Fp4`: E2M1 two a byte (the low nibble first), one e4m3 scale per 16 values (the
//!   largest magnitude over 6, rounded to e4m3): 288 bytes an entry of 512.
//! - `Mxfp4` (the indexer's keys): E2M1 with one E8M0 exponent per 32 values, OCP
//!   microscaling's rule (2^(⌊log2 max⌋ − 2), values past ±6 clamped).
//! - `Bf16`, and `F32` (the reference, as computed).

use super::fp4::{E2M1, MXFP4_GROUP, e8m0_scale};
use super::fp8::{E4M3_MAX, e4m3_to_f32, f32_to_e4m3};

/// Values an FP8 scale covers (or the whole row, when it is shorter).
pub const FP8_TILE: usize = 128;
/// Values an FP4 e4m3 scale covers.
pub const FP4_GROUP: usize = 16;
const E2M1_MAX: f32 = 6.0;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum EntryFormat {
    #[default]
    F32,
    Bf16,
    Fp8,
    Fp4,
    Mxfp4,
}

impl EntryFormat {
    /// Values a scale covers in a row of `dim`; `None` without scales.
    fn group(self, dim: usize) -> Option<usize> {
        match self {
            EntryFormat::F32 | EntryFormat::Bf16 => None,
            EntryFormat::Fp8 => Some(FP8_TILE.min(dim)),
            EntryFormat::Fp4 => Some(FP4_GROUP),
            EntryFormat::Mxfp4 => Some(MXFP4_GROUP),
        }
    }

    /// Why a row of `dim` values cannot be stored so, if it cannot.
    pub fn problem(self, dim: usize) -> Option<String> {
        let group = self.group(dim)?;
        (dim == 0 || !dim.is_multiple_of(group))
            .then(|| format!("{self:?} entries take rows of whole groups of {group}, not {dim}"))
    }

    /// Bytes of one row of `dim` values.
    pub fn bytes(self, dim: usize) -> usize {
        match self {
            EntryFormat::F32 => 4 * dim,
            EntryFormat::Bf16 => 2 * dim,
            EntryFormat::Fp8 => dim + 4 * dim.div_ceil(FP8_TILE.min(dim).max(1)),
            EntryFormat::Fp4 => dim / 2 + dim / FP4_GROUP,
            EntryFormat::Mxfp4 => dim / 2 + dim / MXFP4_GROUP,
        }
    }

    /// f32 words a row of `dim` values takes in a buffer of f32 (packed bytes rounded up).
    pub fn words(self, dim: usize) -> usize {
        match self {
            EntryFormat::F32 => dim,
            packed => packed.bytes(dim).div_ceil(4),
        }
    }

    /// `row` into `out` (`self.bytes(row.len())` bytes).
    pub fn encode(self, row: &[f32], out: &mut [u8]) {
        let dim = row.len();
        debug_assert_eq!(out.len(), self.bytes(dim));
        match self {
            EntryFormat::F32 => {
                for (o, x) in out.chunks_exact_mut(4).zip(row) {
                    o.copy_from_slice(&x.to_le_bytes());
                }
            }
            EntryFormat::Bf16 => {
                for (o, x) in out.chunks_exact_mut(2).zip(row) {
                    o.copy_from_slice(&half::bf16::from_f32(*x).to_le_bytes());
                }
            }
            EntryFormat::Fp8 => {
                let (data, scales) = out.split_at_mut(dim);
                let tile = FP8_TILE.min(dim);
                for ((d, s), x) in data
                    .chunks_exact_mut(tile)
                    .zip(scales.chunks_exact_mut(4))
                    .zip(row.chunks_exact(tile))
                {
                    let scale = match amax(x) {
                        0.0 => 1.0,
                        m => m / E4M3_MAX,
                    };
                    s.copy_from_slice(&scale.to_le_bytes());
                    for (d, v) in d.iter_mut().zip(x) {
                        *d = f32_to_e4m3(v / scale);
                    }
                }
            }
            EntryFormat::Fp4 | EntryFormat::Mxfp4 => {
                let group = self.group(dim).expect("scaled");
                let (data, scales) = out.split_at_mut(dim / 2);
                for ((d, s), x) in data
                    .chunks_exact_mut(group / 2)
                    .zip(scales.iter_mut())
                    .zip(row.chunks_exact(group))
                {
                    let scale;
                    (*s, scale) = if self == EntryFormat::Fp4 {
                        let code = f32_to_e4m3(amax(x) / E2M1_MAX);
                        (code, e4m3_to_f32(code))
                    } else {
                        let e = mx_exponent(amax(x));
                        (e, e8m0_scale(e))
                    };
                    for (d, pair) in d.iter_mut().zip(x.chunks_exact(2)) {
                        let code = |v: f32| if scale > 0.0 { e2m1(v / scale) } else { 0 };
                        *d = code(pair[0]) | code(pair[1]) << 4;
                    }
                }
            }
        }
    }

    /// A row of `out.len()` values back from `bytes`.
    pub fn decode(self, bytes: &[u8], out: &mut [f32]) {
        let dim = out.len();
        debug_assert_eq!(bytes.len(), self.bytes(dim));
        match self {
            EntryFormat::F32 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes(b.try_into().expect("4 bytes"));
                }
            }
            EntryFormat::Bf16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            EntryFormat::Fp8 => {
                let (data, scales) = bytes.split_at(dim);
                let tile = FP8_TILE.min(dim);
                for ((o, d), s) in out
                    .chunks_exact_mut(tile)
                    .zip(data.chunks_exact(tile))
                    .zip(scales.chunks_exact(4))
                {
                    let scale = f32::from_le_bytes(s.try_into().expect("4 bytes"));
                    for (o, &d) in o.iter_mut().zip(d) {
                        *o = e4m3_to_f32(d) * scale;
                    }
                }
            }
            EntryFormat::Fp4 | EntryFormat::Mxfp4 => {
                let group = self.group(dim).expect("scaled");
                let (data, scales) = bytes.split_at(dim / 2);
                for ((o, d), &s) in out
                    .chunks_exact_mut(group)
                    .zip(data.chunks_exact(group / 2))
                    .zip(scales)
                {
                    let scale = if self == EntryFormat::Fp4 {
                        e4m3_to_f32(s)
                    } else {
                        e8m0_scale(s)
                    };
                    for (pair, &b) in o.chunks_exact_mut(2).zip(d) {
                        pair[0] = E2M1[(b & 0xF) as usize] * scale;
                        pair[1] = E2M1[(b >> 4) as usize] * scale;
                    }
                }
            }
        }
    }
}

fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

/// OCP microscaling's shared exponent for a group whose largest magnitude is `amax`:
/// 2^(⌊log2 amax⌋ − 2), E2M1's largest exponent being 2; an all-zero group takes the
/// smallest.
fn mx_exponent(amax: f32) -> u8 {
    if amax == 0.0 {
        return 0;
    }
    // ⌊log2⌋ from the exponent bits: exact where a rounded log2 would not be.
    let floor_log2 = if amax.is_normal() {
        ((amax.to_bits() >> 23) & 0xFF) as i32 - 127
    } else {
        amax.log2().floor() as i32
    };
    (floor_log2 - 2 + 127).clamp(0, 254) as u8
}

/// The nearest E2M1 code of `v` (ties to the even mantissa), ±6 past the range.
fn e2m1(v: f32) -> u8 {
    let sign = if v.is_sign_negative() { 8 } else { 0 };
    let a = v.abs();
    let magnitude = match a {
        a if a <= 0.25 => 0,
        a if a < 0.75 => 1,
        a if a <= 1.25 => 2,
        a if a < 1.75 => 3,
        a if a <= 2.5 => 4,
        a if a < 3.5 => 5,
        a if a <= 5.0 => 6,
        _ => 7,
    };
    sign | magnitude
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_seeds_entry_sizes() {
        assert_eq!(EntryFormat::Fp8.bytes(512), 528);
        assert_eq!(EntryFormat::Fp4.bytes(512), 288);
        assert_eq!(EntryFormat::Mxfp4.bytes(128), 68);
        assert_eq!(EntryFormat::Bf16.bytes(512), 1024);
        assert!(EntryFormat::Fp4.problem(40).is_some());
        assert!(EntryFormat::Fp8.problem(64).is_none());
    }

    #[test]
    fn e2m1_rounds_to_nearest_with_ties_to_even() {
        for (v, want) in [
            (0.25, 0.0),
            (0.3, 0.5),
            (0.75, 1.0),
            (1.25, 1.0),
            (2.5, 2.0),
        ] {
            assert_eq!(E2M1[e2m1(v) as usize], want, "{v}");
        }
        for (v, want) in [
            (3.5, 4.0),
            (5.0, 4.0),
            (5.1, 6.0),
            (100.0, 6.0),
            (-1.75, -2.0),
        ] {
            assert_eq!(E2M1[e2m1(v) as usize], want, "{v}");
        }
    }
}
