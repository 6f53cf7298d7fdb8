//! Each GGML block format as the integer dot product sees it: per 32-element sub-block,
//! 32 small integers `q` and, per 16 elements, a `scale` and a `min` with
//! `w = scale · q + min`. Read straight from the file's blocks, so resident weights are
//! the file's bytes. Every format is checked against `quant::dequantize` (itself checked
//! against the `gguf` package) in `packed::tests`.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use crate::kernels::quant::{
    GgmlType, IQ4_LEVELS, MXFP4_LEVELS, iq4_xs_scale, mxfp4_half_scale, q3_k_scales,
};

/// One block format. `q` is signed (the dot uses the sign trick) or, with `HAS_MIN`,
/// unsigned and at most 63 (so `maddubs` cannot saturate).
pub trait BlockFormat {
    const TYPE: GgmlType;
    const BYTES: usize;
    /// 32-element sub-blocks per block.
    const SUBS: usize;
    const SIGNED: bool;
    const HAS_MIN: bool;
    /// Scales per 16 elements (else per 32: both halves hold the same value).
    const HALF_SCALES: bool;
    /// Half `2·sub + h`'s scale and min; only the block's `2 · SUBS` entries are written.
    fn scales<H: F16>(blk: &[u8], scales: &mut [f32; 16], mins: &mut [f32; 16]);
    /// Sub-block `sub`'s quants in element order.
    fn quants(blk: &[u8], sub: usize, q: &mut [i8; 32]);
    /// The same as one AVX2 register. Inlined into the `avx2` kernels that call it.
    ///
    /// # Safety
    /// AVX2 must be present and `blk` must point at a whole block.
    #[cfg(target_arch = "x86_64")]
    unsafe fn quants_avx2(blk: *const u8, sub: usize) -> __m256i;
}

/// Reads the f16 at byte `i` of a block as f32, exactly.
pub trait F16 {
    fn at(b: &[u8], i: usize) -> f32;
}

/// In integer and f32 arithmetic: any CPU.
pub struct SoftF16;
impl F16 for SoftF16 {
    #[inline(always)]
    fn at(b: &[u8], i: usize) -> f32 {
        f16_at(b, i)
    }
}

/// One `vcvtph2ps`: only inlined into kernels that enable F16C.
#[cfg(target_arch = "x86_64")]
pub struct F16c;
#[cfg(target_arch = "x86_64")]
impl F16 for F16c {
    #[inline(always)]
    fn at(b: &[u8], i: usize) -> f32 {
        let h = u16::from_le_bytes([b[i], b[i + 1]]);
        // SAFETY: only instantiated by the x86 kernels, whose target features include F16C.
        unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32))) }
    }
}

/// The f16 at byte `i`, exactly, without a call: the exponent is rebased by one
/// multiply by 2^112, which also covers subnormals; infinities and NaNs keep all ones.
#[inline(always)]
pub(crate) fn f16_at(b: &[u8], i: usize) -> f32 {
    let h = u16::from_le_bytes([b[i], b[i + 1]]);
    let sign = ((h & 0x8000) as u32) << 16;
    let magnitude = ((h & 0x7FFF) as u32) << 13;
    if h & 0x7C00 == 0x7C00 {
        return f32::from_bits(sign | 0x7F80_0000 | magnitude);
    }
    f32::from_bits((f32::from_bits(magnitude) * f32::from_bits(0x7780_0000)).to_bits() | sign)
}

fn fill(scales: &mut [f32; 16], halves: usize, f: impl Fn(usize) -> f32) {
    for (i, s) in scales[..halves].iter_mut().enumerate() {
        *s = f(i);
    }
}

/// Elements j and j + 16 from the low and high nibbles of byte j.
fn nibbles(qs: &[u8], q: &mut [i8; 32], f: impl Fn(u8) -> i8) {
    for j in 0..16 {
        q[j] = f(qs[j] & 0xF);
        q[j + 16] = f(qs[j] >> 4);
    }
}

/// `(bytes[l] >> shift) & mask` for the 32 bytes, through `f(l, value)`.
fn bit_field(bytes: &[u8], shift: usize, mask: u8, q: &mut [i8; 32], f: impl Fn(usize, u8) -> i8) {
    for l in 0..32 {
        q[l] = f(l, (bytes[l] >> shift) & mask);
    }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn nibbles_avx2(p: *const u8) -> __m256i {
    // SAFETY: the caller's contract: AVX2, 16 readable bytes at p.
    unsafe {
        let raw = _mm_loadu_si128(p as *const __m128i);
        let mask = _mm_set1_epi8(0x0F);
        let lo = _mm_and_si128(raw, mask);
        let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
        _mm256_set_m128i(hi, lo)
    }
}

/// 0xFF in byte j where bit j of the 32-bit word at `p` is set (ggml's bytes_from_bits_32).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn bit_bytes_avx2(p: *const u8) -> __m256i {
    // SAFETY: the caller's contract: AVX2, 4 readable bytes at p.
    unsafe {
        let word = (p as *const u32).read_unaligned() as i32;
        let spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(word),
            _mm256_set_epi64x(
                0x0303030303030303,
                0x0202020202020202,
                0x0101010101010101,
                0,
            ),
        );
        let bits = _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
        _mm256_cmpeq_epi8(bits, _mm256_set1_epi64x(-1))
    }
}

/// Bits `shift..` of 32 bytes at `p`, masked to `mask`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn bit_field_avx2(p: *const u8, shift: usize, mask: i8) -> __m256i {
    // SAFETY: the caller's contract: AVX2, 32 readable bytes at p.
    unsafe {
        let raw = _mm256_loadu_si256(p as *const __m256i);
        let shifted = _mm256_srl_epi16(raw, _mm_cvtsi32_si128(shift as i32));
        _mm256_and_si256(shifted, _mm256_set1_epi8(mask))
    }
}

pub struct Q4_0;
impl BlockFormat for Q4_0 {
    const TYPE: GgmlType = GgmlType::Q4_0;
    const BYTES: usize = 18;
    const SUBS: usize = 1;
    const SIGNED: bool = true;
    const HAS_MIN: bool = false;
    const HALF_SCALES: bool = false;
    fn scales<H: F16>(b: &[u8], s: &mut [f32; 16], _: &mut [f32; 16]) {
        fill(s, 2, |_| H::at(b, 0));
    }
    fn quants(b: &[u8], _: usize, q: &mut [i8; 32]) {
        nibbles(&b[2..18], q, |v| v as i8 - 8);
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn quants_avx2(b: *const u8, _: usize) -> __m256i {
        // SAFETY: per the trait's contract.
        unsafe { _mm256_sub_epi8(nibbles_avx2(b.add(2)), _mm256_set1_epi8(8)) }
    }
}

pub struct Q4_1;
impl BlockFormat for Q4_1 {
    const TYPE: GgmlType = GgmlType::Q4_1;
    const BYTES: usize = 20;
    const SUBS: usize = 1;
    const SIGNED: bool = false;
    const HAS_MIN: bool = true;
    const HALF_SCALES: bool = false;
    fn scales<H: F16>(b: &[u8], s: &mut [f32; 16], m: &mut [f32; 16]) {
        fill(s, 2, |_| H::at(b, 0));
        fill(m, 2, |_| H::at(b, 2));
    }
    fn quants(b: &[u8], _: usize, q: &mut [i8; 32]) {
        nibbles(&b[4..20], q, |v| v as i8);
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn quants_avx2(b: *const u8, _: usize) -> __m256i {
        // SAFETY: per the trait's contract.
        unsafe { nibbles_avx2(b.add(4)) }
    }
}

pub struct Q5_0;
impl BlockFormat for Q5_0 {
    const TYPE: GgmlType = GgmlType::Q5_0;
    const BYTES: usize = 22;
    const SUBS: usize = 1;
    const SIGNED: bool = true;
    const HAS_MIN: bool = false;
    const HALF_SCALES: bool = false;
    fn scales<H: F16>(b: &[u8], s: &mut [f32; 16], _: &mut [f32; 16]) {
        fill(s, 2, |_| H::at(b, 0));
    }
    fn quants(b: &[u8], _: usize, q: &mut [i8; 32]) {
        let qh = u32::from_le_bytes(b[2..6].try_into().unwrap());
        nibbles(&b[6..22], q, |v| v as i8);
        for (j, v) in q.iter_mut().enumerate() {
            *v += (((qh >> j) & 1) << 4) as i8 - 16;
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn quants_avx2(b: *const u8, _: usize) -> __m256i {
        // SAFETY: per the trait's contract.
        unsafe {
            // A clear fifth bit makes the byte `nibble - 16`: set its top four bits.
            let high =
                _mm256_andnot_si256(bit_bytes_avx2(b.add(2)), _mm256_set1_epi8(0xF0u8 as i8));
            _mm256_or_si256(nibbles_avx2(b.add(6)), high)
        }
    }
}

pub struct Q5_1;
impl BlockFormat for Q5_1 {
    const TYPE: GgmlType = GgmlType::Q5_1;
    const BYTES: usize = 24;
    const SUBS: usize = 1;
    const SIGNED: bool = false;
    const HAS_MIN: bool = true;
    const HALF_SCALES: bool = false;
    fn scales<H: F16>(b: &[u8], s: &mut [f32; 16], m: &mut [f32; 16]) {
        fill(s, 2, |_| H::at(b, 0));
        fill(m, 2, |_| H::at(b, 2));
    }
    fn quants(b: &[u8], _: usize, q: &mut [i8; 32]) {
        let qh = u32::from_le_bytes(b[4..8].try_into().unwrap());
        nibbles(&b[8..24], q, |v| v as i8);
        for (j, v) in q.iter_mut().enumerate() {
            *v += (((qh >> j) & 1) << 4) as i8;
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn quants_avx2(b: *const u8, _: usize) -> __m256i {
        // SAFETY: per the trait's contract.
        unsafe {
            let high = _mm256_and_si256(bit_bytes_avx2(b.add(4)), _mm256_set1_epi8(0x10));
            _mm256_or_si256(nibbles_avx2(b.add(8)), high)
        }
    }
}

pub struct Q8_0;
impl BlockFormat for Q8_0 {
    const TYPE: GgmlType = GgmlType::Q8_0;
    const BYTES: usize = 34;
    const SUBS: usize = 1;
    const SIGNED: bool = true;
    const HAS_MIN: bool = false;
    const HALF_SCALES: bool = false;
    fn scales<H: F16>(b: &[u8], s: &mut [f32; 16], _: &mut [f32; 16]) {
        fill(s, 2, |_| H::at(b, 0));
    }
    fn quants(b: &[u8], _: usize, q: &mut [i8; 32]) {
        for (v, &byte) in q.iter_mut().zip(&b[2..34]) {
            *v = byte as i8;
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn quants_avx2(b: *const u8, _: usize) -> __m256i {
        // SAFETY: per the trait's contract.
        unsafe { _mm256_loadu_si256(b.add(2) as *const __m256i) }
    }
}

pub struct Q2K;
impl BlockFormat for Q2K {
    const TYPE: GgmlType = GgmlType::Q2K;
    const BYTES: usize = 84;
    const SUBS: usize = 8;
    const SIGNED: bool = false;
    const HAS_MIN: bool = true;
    const HALF_SCALES: bool = true;
    fn scales<H: F16>(b: &[u8], s: &mut [f32; 16], m: &mut [f32; 16]) {
        let (d, dmin) = (H::at(b, 80), H::at(b, 82));
        fill(s, 16, |i| d * (b[i] & 0xF) as f32);
        fill(m, 16, |i| -(dmin * (b[i] >> 4) as f32));
    }
    fn quants(b: &[u8], sub: usize, q: &mut [i8; 32]) {
        let (half, j) = (sub / 4, sub % 4);
        bit_field(&b[16 + 32 * half..48 + 32 * half], 2 * j, 3, q, |_, v| {
            v as i8
        });
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn quants_avx2(b: *const u8, sub: usize) -> __m256i {
        // SAFETY: per the trait's contract.
        unsafe { bit_field_avx2(b.add(16 + 32 * (sub / 4)), 2 * (sub % 4), 3) }
    }
}

pub struct Q3K;
impl BlockFormat for Q3K {
    const TYPE: GgmlType = GgmlType::Q3K;
    const BYTES: usize = 110;
    const SUBS: usize = 8;
    const SIGNED: bool = true;
    const HAS_MIN: bool = false;
    const HALF_SCALES: bool = true;
    fn scales<H: F16>(b: &[u8], s: &mut [f32; 16], _: &mut [f32; 16]) {
        let d = H::at(b, 108);
        let sc = q3_k_scales(&b[96..108]);
        fill(s, 16, |i| d * sc[i] as f32);
    }
    fn quants(b: &[u8], sub: usize, q: &mut [i8; 32]) {
        let (half, j) = (sub / 4, sub % 4);
        let bit = 1u8 << (4 * half + j);
        bit_field(&b[32 + 32 * half..64 + 32 * half], 2 * j, 3, q, |l, v| {
            v as i8 - if b[l] & bit != 0 { 0 } else { 4 }
        });
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn quants_avx2(b: *const u8, sub: usize) -> __m256i {
        let (half, j) = (sub / 4, sub % 4);
        // SAFETY: per the trait's contract.
        unsafe {
            let low = bit_field_avx2(b.add(32 + 32 * half), 2 * j, 3);
            let hmask = _mm256_loadu_si256(b as *const __m256i);
            let bit = _mm256_set1_epi8((1u8 << (4 * half + j)) as i8);
            let clear = _mm256_cmpeq_epi8(_mm256_and_si256(hmask, bit), _mm256_setzero_si256());
            _mm256_sub_epi8(low, _mm256_and_si256(clear, _mm256_set1_epi8(4)))
        }
    }
}

/// The 6-bit (scale, min) pair of sub-block `j` of Q4_K / Q5_K.
#[inline(always)]
fn scale_min_k4(j: usize, q: &[u8]) -> (f32, f32) {
    let (sc, m) = if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    };
    (sc as f32, m as f32)
}

#[inline(always)]
fn k4_scales<H: F16>(b: &[u8], s: &mut [f32; 16], m: &mut [f32; 16]) {
    let (d, dmin) = (H::at(b, 0), H::at(b, 2));
    for sub in 0..8 {
        let (sc, mn) = scale_min_k4(sub, &b[4..16]);
        s[2 * sub] = d * sc;
        s[2 * sub + 1] = d * sc;
        m[2 * sub] = -(dmin * mn);
        m[2 * sub + 1] = -(dmin * mn);
    }
}

pub struct Q4K;
impl BlockFormat for Q4K {
    const TYPE: GgmlType = GgmlType::Q4K;
    const BYTES: usize = 144;
    const SUBS: usize = 8;
    const SIGNED: bool = false;
    const HAS_MIN: bool = true;
    const HALF_SCALES: bool = false;
    fn scales<H: F16>(b: &[u8], s: &mut [f32; 16], m: &mut [f32; 16]) {
        k4_scales::<H>(b, s, m);
    }
    fn quants(b: &[u8], sub: usize, q: &mut [i8; 32]) {
        let qs = &b[16 + 32 * (sub / 2)..48 + 32 * (sub / 2)];
        bit_field(qs, 4 * (sub % 2), 0xF, q, |_, v| v as i8);
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn quants_avx2(b: *const u8, sub: usize) -> __m256i {
        // SAFETY: per the trait's contract.
        unsafe { bit_field_avx2(b.add(16 + 32 * (sub / 2)), 4 * (sub % 2), 0xF) }
    }
}

pub struct Q5K;
impl BlockFormat for Q5K {
    const TYPE: GgmlType = GgmlType::Q5K;
    const BYTES: usize = 176;
    const SUBS: usize = 8;
    const SIGNED: bool = false;
    const HAS_MIN: bool = true;
    const HALF_SCALES: bool = false;
    fn scales<H: F16>(b: &[u8], s: &mut [f32; 16], m: &mut [f32; 16]) {
        k4_scales::<H>(b, s, m);
    }
    fn quants(b: &[u8], sub: usize, q: &mut [i8; 32]) {
        let qs = &b[48 + 32 * (sub / 2)..80 + 32 * (sub / 2)];
        bit_field(qs, 4 * (sub % 2), 0xF, q, |l, v| {
            (v | (((b[16 + l] >> sub) & 1) << 4)) as i8
        });
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn quants_avx2(b: *const u8, sub: usize) -> __m256i {
        // SAFETY: per the trait's contract.
        unsafe {
            let low = bit_field_avx2(b.add(48 + 32 * (sub / 2)), 4 * (sub % 2), 0xF);
            let high = _mm256_slli_epi16(bit_field_avx2(b.add(16), sub, 1), 4);
            _mm256_or_si256(low, high)
        }
    }
}

pub struct Q6K;
impl BlockFormat for Q6K {
    const TYPE: GgmlType = GgmlType::Q6K;
    const BYTES: usize = 210;
    const SUBS: usize = 8;
    const SIGNED: bool = true;
    const HAS_MIN: bool = false;
    const HALF_SCALES: bool = true;
    fn scales<H: F16>(b: &[u8], s: &mut [f32; 16], _: &mut [f32; 16]) {
        let d = H::at(b, 208);
        fill(s, 16, |i| d * b[192 + i] as i8 as f32);
    }
    fn quants(b: &[u8], sub: usize, q: &mut [i8; 32]) {
        let (half, k) = (sub / 4, sub % 4);
        let ql = &b[64 * half + 32 * (k & 1)..64 * half + 32 * (k & 1) + 32];
        let qh = &b[128 + 32 * half..160 + 32 * half];
        bit_field(ql, 4 * (k >> 1), 0xF, q, |l, v| {
            (v | (((qh[l] >> (2 * k)) & 3) << 4)) as i8 - 32
        });
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn quants_avx2(b: *const u8, sub: usize) -> __m256i {
        let (half, k) = (sub / 4, sub % 4);
        // SAFETY: per the trait's contract.
        unsafe {
            let low = bit_field_avx2(b.add(64 * half + 32 * (k & 1)), 4 * (k >> 1), 0xF);
            let high = _mm256_slli_epi16(bit_field_avx2(b.add(128 + 32 * half), 2 * k, 3), 4);
            _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(32))
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn iq4_levels_avx2(p: *const u8) -> __m256i {
    // SAFETY: the caller's contract.
    unsafe { levels_avx2(&IQ4_LEVELS, p) }
}

/// A nibble-coded sub-block's 32 codes through a 16-entry table.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn levels_avx2(levels: &[i8; 16], p: *const u8) -> __m256i {
    // SAFETY: the caller's contract: AVX2, 16 readable bytes at p.
    unsafe {
        let table = _mm_loadu_si128(levels.as_ptr() as *const __m128i);
        _mm256_shuffle_epi8(_mm256_set_m128i(table, table), nibbles_avx2(p))
    }
}

pub struct IQ4NL;
impl BlockFormat for IQ4NL {
    const TYPE: GgmlType = GgmlType::IQ4NL;
    const BYTES: usize = 18;
    const SUBS: usize = 1;
    const SIGNED: bool = true;
    const HAS_MIN: bool = false;
    const HALF_SCALES: bool = false;
    fn scales<H: F16>(b: &[u8], s: &mut [f32; 16], _: &mut [f32; 16]) {
        fill(s, 2, |_| H::at(b, 0));
    }
    fn quants(b: &[u8], _: usize, q: &mut [i8; 32]) {
        nibbles(&b[2..18], q, |v| IQ4_LEVELS[v as usize]);
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn quants_avx2(b: *const u8, _: usize) -> __m256i {
        // SAFETY: per the trait's contract.
        unsafe { iq4_levels_avx2(b.add(2)) }
    }
}

pub struct IQ4XS;
impl BlockFormat for IQ4XS {
    const TYPE: GgmlType = GgmlType::IQ4XS;
    const BYTES: usize = 136;
    const SUBS: usize = 8;
    const SIGNED: bool = true;
    const HAS_MIN: bool = false;
    const HALF_SCALES: bool = false;
    fn scales<H: F16>(b: &[u8], s: &mut [f32; 16], _: &mut [f32; 16]) {
        let d = H::at(b, 0);
        fill(s, 16, |i| d * iq4_xs_scale(b, i / 2) as f32);
    }
    fn quants(b: &[u8], sub: usize, q: &mut [i8; 32]) {
        nibbles(&b[8 + 16 * sub..24 + 16 * sub], q, |v| {
            IQ4_LEVELS[v as usize]
        });
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn quants_avx2(b: *const u8, sub: usize) -> __m256i {
        // SAFETY: per the trait's contract.
        unsafe { iq4_levels_avx2(b.add(8 + 16 * sub)) }
    }
}

/// MXFP4 (ggml's block: the E8M0 exponent, then the codes): E2M1 doubled to integers,
/// the block's scale halved (`quant::MXFP4_LEVELS`), so the dot is exact integer work.
pub struct Mxfp4;
impl BlockFormat for Mxfp4 {
    const TYPE: GgmlType = GgmlType::MXFP4;
    const BYTES: usize = 17;
    const SUBS: usize = 1;
    const SIGNED: bool = true;
    const HAS_MIN: bool = false;
    const HALF_SCALES: bool = false;
    fn scales<H: F16>(b: &[u8], s: &mut [f32; 16], _: &mut [f32; 16]) {
        fill(s, 2, |_| mxfp4_half_scale(b[0]));
    }
    fn quants(b: &[u8], _: usize, q: &mut [i8; 32]) {
        nibbles(&b[1..17], q, |v| MXFP4_LEVELS[v as usize]);
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn quants_avx2(b: *const u8, _: usize) -> __m256i {
        // SAFETY: per the trait's contract.
        unsafe { levels_avx2(&MXFP4_LEVELS, b.add(1)) }
    }
}
