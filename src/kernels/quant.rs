//! GGML block formats and their dequantization to f32.
//!
//! Layouts follow ggml's `ggml-common.h`; every format is checked against the `gguf`
//! Python package (`gguf.quants.dequantize`) by golden blocks in `tests/goldens/quants.json`.

use half::{bf16, f16};

const QK_K: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
}

impl GgmlType {
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            30 => Self::BF16,
            _ => return None,
        })
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "F32" => Self::F32,
            "F16" => Self::F16,
            "BF16" => Self::BF16,
            "Q4_0" => Self::Q4_0,
            "Q4_1" => Self::Q4_1,
            "Q5_0" => Self::Q5_0,
            "Q5_1" => Self::Q5_1,
            "Q8_0" => Self::Q8_0,
            "Q4_K" => Self::Q4K,
            "Q5_K" => Self::Q5K,
            "Q6_K" => Self::Q6K,
            _ => return None,
        })
    }

    /// Elements per block.
    pub fn block_len(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 | Self::Q8_0 => 32,
            Self::Q4K | Self::Q5K | Self::Q6K => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
        }
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Dequantizes `raw` (a whole number of blocks) into `out`, which must hold exactly the
/// number of elements those blocks carry.
pub fn dequantize(ty: GgmlType, raw: &[u8], out: &mut [f32]) {
    let (bl, bb) = (ty.block_len(), ty.block_bytes());
    assert_eq!(raw.len() % bb, 0, "partial {ty:?} block");
    assert_eq!(raw.len() / bb * bl, out.len(), "output length mismatch");
    for (blk, y) in raw.chunks_exact(bb).zip(out.chunks_exact_mut(bl)) {
        match ty {
            GgmlType::F32 => y[0] = f32::from_le_bytes(blk.try_into().unwrap()),
            GgmlType::F16 => y[0] = f16_at(blk, 0),
            GgmlType::BF16 => y[0] = bf16::from_le_bytes([blk[0], blk[1]]).to_f32(),
            GgmlType::Q4_0 => q4_0(blk, y),
            GgmlType::Q4_1 => q4_1(blk, y),
            GgmlType::Q5_0 => q5_0(blk, y),
            GgmlType::Q5_1 => q5_1(blk, y),
            GgmlType::Q8_0 => q8_0(blk, y),
            GgmlType::Q4K => q4_k(blk, y),
            GgmlType::Q5K => q5_k(blk, y),
            GgmlType::Q6K => q6_k(blk, y),
        }
    }
}

fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = ((qs[j] & 0xF) as i32 - 8) as f32 * d;
        y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

fn q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = (qs[j] & 0xF) as f32 * d + m;
        y[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

/// The fifth bits of a Q5 block: bit j of `qh` belongs to element j.
fn q5_values(qh: u32, qs: &[u8], j: usize) -> (i32, i32) {
    let h0 = ((qh >> j) << 4) & 0x10;
    let h1 = (qh >> (j + 12)) & 0x10;
    (
        ((qs[j] & 0xF) as u32 | h0) as i32,
        ((qs[j] >> 4) as u32 | h1) as i32,
    )
}

fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes(b[2..6].try_into().unwrap());
    let qs = &b[6..22];
    for j in 0..16 {
        let (x0, x1) = q5_values(qh, qs, j);
        y[j] = (x0 - 16) as f32 * d;
        y[j + 16] = (x1 - 16) as f32 * d;
    }
}

fn q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = u32::from_le_bytes(b[4..8].try_into().unwrap());
    let qs = &b[8..24];
    for j in 0..16 {
        let (x0, x1) = q5_values(qh, qs, j);
        y[j] = x0 as f32 * d + m;
        y[j + 16] = x1 as f32 * d + m;
    }
}

fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (j, &q) in b[2..34].iter().enumerate() {
        y[j] = q as i8 as f32 * d;
    }
}

/// The 6-bit (scale, min) pair `j` of the 12 packed scale bytes of Q4_K / Q5_K.
fn scale_min_k4(j: usize, q: &[u8]) -> (f32, f32) {
    if j < 4 {
        ((q[j] & 63) as f32, (q[j + 4] & 63) as f32)
    } else {
        (
            ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)) as f32,
            ((q[j + 4] >> 4) | ((q[j] >> 6) << 4)) as f32,
        )
    }
}

fn q4_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qs = &b[16..144];
    for (chunk, (q, y)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, m1, d2, m2) = (d * sc1, dmin * m1, d * sc2, dmin * m2);
        for l in 0..32 {
            y[l] = d1 * (q[l] & 0xF) as f32 - m1;
            y[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

fn q5_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for (chunk, (ql, y)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, m1, d2, m2) = (d * sc1, dmin * m1, d * sc2, dmin * m2);
        let (u1, u2) = (1u8 << (2 * chunk), 2u8 << (2 * chunk));
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            y[l] = d1 * ((ql[l] & 0xF) + h1) as f32 - m1;
            y[l + 32] = d2 * ((ql[l] >> 4) + h2) as f32 - m2;
        }
    }
}

fn q6_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 208);
    for half in 0..2 {
        let ql = &b[64 * half..64 * half + 64];
        let qh = &b[128 + 32 * half..128 + 32 * half + 32];
        let sc = &b[192 + 8 * half..192 + 8 * half + 8];
        let y = &mut y[128 * half..128 * half + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            y[l] = d * (sc[is] as i8 as f32) * q1 as f32;
            y[l + 32] = d * (sc[is + 2] as i8 as f32) * q2 as f32;
            y[l + 64] = d * (sc[is + 4] as i8 as f32) * q3 as f32;
            y[l + 96] = d * (sc[is + 6] as i8 as f32) * q4 as f32;
        }
    }
}
