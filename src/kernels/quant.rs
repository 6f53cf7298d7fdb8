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
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    IQ4NL,
    IQ4XS,
    /// OCP MXFP4 as GGML stores it (gpt-oss, DeepSeek-V4's routed experts repacked): an
    /// E8M0 exponent, then 16 bytes of E2M1 codes, element j in the low nibble of byte j
    /// and element j + 16 in its high nibble.
    MXFP4,
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
            10 => Self::Q2K,
            11 => Self::Q3K,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            20 => Self::IQ4NL,
            23 => Self::IQ4XS,
            30 => Self::BF16,
            39 => Self::MXFP4,
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
            "Q2_K" => Self::Q2K,
            "Q3_K" => Self::Q3K,
            "Q4_K" => Self::Q4K,
            "Q5_K" => Self::Q5K,
            "Q6_K" => Self::Q6K,
            "IQ4_NL" => Self::IQ4NL,
            "IQ4_XS" => Self::IQ4XS,
            "MXFP4" => Self::MXFP4,
            _ => return None,
        })
    }

    /// Elements per block.
    pub fn block_len(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 | Self::Q8_0 | Self::IQ4NL => 32,
            Self::MXFP4 => 32,
            Self::Q2K | Self::Q3K | Self::Q4K | Self::Q5K | Self::Q6K | Self::IQ4XS => QK_K,
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
            Self::Q2K => 84,
            Self::Q3K => 110,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
            Self::IQ4NL => 18,
            Self::IQ4XS => 136,
            Self::MXFP4 => 17,
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
            GgmlType::Q2K => q2_k(blk, y),
            GgmlType::Q3K => q3_k(blk, y),
            GgmlType::Q4K => q4_k(blk, y),
            GgmlType::Q5K => q5_k(blk, y),
            GgmlType::Q6K => q6_k(blk, y),
            GgmlType::IQ4NL => iq4_nl(blk, y),
            GgmlType::MXFP4 => mxfp4(blk, y),
            GgmlType::IQ4XS => iq4_xs(blk, y),
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

fn q2_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    for (sub, y) in y.chunks_exact_mut(16).enumerate() {
        // Sixteen elements share a scale byte: low nibble scale, high nibble min.
        let sc = b[sub];
        let (dl, ml) = (d * (sc & 0xF) as f32, dmin * (sc >> 4) as f32);
        let (half, j, l0) = (sub / 8, (sub / 2) % 4, 16 * (sub % 2));
        let q = &b[16 + 32 * half + l0..16 + 32 * half + l0 + 16];
        for (yv, &qv) in y.iter_mut().zip(q) {
            *yv = dl * ((qv >> (2 * j)) & 3) as f32 - ml;
        }
    }
}

/// The sixteen 6-bit scales of a Q3_K block (stored as 12 bytes), each minus 32.
pub fn q3_k_scales(packed: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (j, o) in out.iter_mut().enumerate() {
        let low = if j < 8 {
            packed[j] & 0xF
        } else {
            packed[j - 8] >> 4
        };
        let high = (packed[8 + j % 4] >> (2 * (j / 4))) & 3;
        *o = (low | (high << 4)) as i8 - 32;
    }
    out
}

fn q3_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 108);
    let (hmask, qs) = (&b[0..32], &b[32..96]);
    let scales = q3_k_scales(&b[96..108]);
    for (sub, y) in y.chunks_exact_mut(16).enumerate() {
        let dl = d * scales[sub] as f32;
        let (half, j, l0) = (sub / 8, (sub / 2) % 4, 16 * (sub % 2));
        let bit = 1u8 << (4 * half + j);
        for (l, yv) in (l0..l0 + 16).zip(y.iter_mut()) {
            let low = ((qs[32 * half + l] >> (2 * j)) & 3) as i32;
            let high = if hmask[l] & bit != 0 { 0 } else { 4 };
            *yv = dl * (low - high) as f32;
        }
    }
}

/// The sixteen non-linear levels of IQ4_NL and IQ4_XS.
/// E2M1's values doubled, so each is an integer (ggml's `kvalues_mxfp4`); a block's scale
/// is then half its E8M0 power of two.
pub const MXFP4_LEVELS: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Half of 2^(e − 127), exactly: E8M0 exponent `e` of an MXFP4 block over `MXFP4_LEVELS`.
pub fn mxfp4_half_scale(e: u8) -> f32 {
    // 2^(e − 128) is a normal f32 for e ≥ 2; below, a subnormal power of two.
    if e >= 2 {
        f32::from_bits(((e as u32) - 1) << 23)
    } else {
        f32::from_bits(1 << (21 + e as u32))
    }
}

fn mxfp4(b: &[u8], y: &mut [f32]) {
    let d = mxfp4_half_scale(b[0]);
    for j in 0..16 {
        y[j] = d * MXFP4_LEVELS[(b[1 + j] & 0xF) as usize] as f32;
        y[j + 16] = d * MXFP4_LEVELS[(b[1 + j] >> 4) as usize] as f32;
    }
}

pub const IQ4_LEVELS: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

fn iq4_block(d: f32, qs: &[u8], y: &mut [f32]) {
    for j in 0..16 {
        y[j] = d * IQ4_LEVELS[(qs[j] & 0xF) as usize] as f32;
        y[j + 16] = d * IQ4_LEVELS[(qs[j] >> 4) as usize] as f32;
    }
}

fn iq4_nl(b: &[u8], y: &mut [f32]) {
    iq4_block(f16_at(b, 0), &b[2..18], y);
}

/// Sub-block `ib`'s 6-bit scale of an IQ4_XS block, minus 32.
pub fn iq4_xs_scale(b: &[u8], ib: usize) -> i32 {
    let high = u16::from_le_bytes([b[2], b[3]]);
    let low = (b[4 + ib / 2] >> (4 * (ib % 2))) & 0xF;
    (low as i32 | ((((high >> (2 * ib)) & 3) as i32) << 4)) - 32
}

fn iq4_xs(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (ib, y) in y.chunks_exact_mut(32).enumerate() {
        iq4_block(
            d * iq4_xs_scale(b, ib) as f32,
            &b[8 + 16 * ib..24 + 16 * ib],
            y,
        );
    }
}
