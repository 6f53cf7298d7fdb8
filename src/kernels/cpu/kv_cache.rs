//! The CPU's paged KV cache: per layer K and V as f32 (the numeric reference), bf16, or
//! e4m3 with one scale per token and kv head (`KvDtype`). Attention reads f32 rows in
//! place and decodes the others a block at a time (`KvRows::decode_block`).

use half::bf16;

use crate::kernels::fp8::{E4M3_MAX, e4m3_to_f32, f32_to_e4m3};
use crate::kernels::paged_kv::{KvCacheShape, KvDtype};

/// One layer's K or V, `[num_blocks · block_size, num_kv_heads, head_dim]`.
pub enum KvRows {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    Fp8 {
        codes: Vec<u8>,
        /// Per (slot, kv head): what a code's value is multiplied by.
        scales: Vec<f32>,
        /// Every code's e4m3 value, decoded once.
        table: Box<[f32; 256]>,
    },
}

impl KvRows {
    fn new(shape: &KvCacheShape) -> Self {
        let len = shape.layer_len();
        match shape.dtype {
            KvDtype::Auto => KvRows::F32(vec![0.0; len]),
            KvDtype::Bf16 => KvRows::Bf16(vec![bf16::ZERO; len]),
            KvDtype::Fp4 => unreachable!("FP4 entries are DeepSeek-V4's: the engine refuses them"),
            KvDtype::Fp8 => KvRows::Fp8 {
                codes: vec![0; len],
                scales: vec![0.0; shape.num_slots() * shape.num_kv_heads],
                table: Box::new(std::array::from_fn(|b| e4m3_to_f32(b as u8))),
            },
        }
    }

    /// Stores `values` (`[kv_heads, head_dim]`) at `slot`.
    fn write(&mut self, slot: usize, values: &[f32], head_dim: usize) {
        let at = slot * values.len();
        match self {
            KvRows::F32(rows) => rows[at..at + values.len()].copy_from_slice(values),
            KvRows::Bf16(rows) => {
                for (r, &x) in rows[at..at + values.len()].iter_mut().zip(values) {
                    *r = bf16::from_f32(x);
                }
            }
            KvRows::Fp8 { codes, scales, .. } => {
                let heads = values.len() / head_dim;
                for (h, head) in values.chunks_exact(head_dim).enumerate() {
                    let amax = head.iter().fold(0f32, |m, x| m.max(x.abs()));
                    // An all-zero head keeps zero codes under any scale.
                    let scale = if amax > 0.0 { amax / E4M3_MAX } else { 1.0 };
                    scales[slot * heads + h] = scale;
                    let out = &mut codes[at + h * head_dim..at + (h + 1) * head_dim];
                    for (c, &x) in out.iter_mut().zip(head) {
                        *c = f32_to_e4m3(x / scale);
                    }
                }
            }
        }
    }

    /// Slots `slots` (of `width` values and `heads` scales each) as stored, appended.
    fn append_block(
        &self,
        slots: std::ops::Range<usize>,
        width: usize,
        heads: usize,
        out: &mut Vec<u8>,
    ) {
        let values = slots.start * width..slots.end * width;
        match self {
            KvRows::F32(rows) => put(out, rows[values].iter().map(|x| x.to_le_bytes())),
            KvRows::Bf16(rows) => put(out, rows[values].iter().map(|x| x.to_bits().to_le_bytes())),
            KvRows::Fp8 { codes, scales, .. } => {
                out.extend_from_slice(&codes[values]);
                let scales = &scales[slots.start * heads..slots.end * heads];
                put(out, scales.iter().map(|x| x.to_le_bytes()));
            }
        }
    }

    /// The inverse of `append_block`, consuming its bytes from the front of `bytes`;
    /// false when they run short.
    fn take_block(
        &mut self,
        slots: std::ops::Range<usize>,
        width: usize,
        heads: usize,
        bytes: &mut &[u8],
    ) -> bool {
        let values = slots.start * width..slots.end * width;
        let mut take = |n: usize| -> Option<&[u8]> {
            let (head, rest) = bytes.split_at_checked(n)?;
            *bytes = rest;
            Some(head)
        };
        match self {
            KvRows::F32(rows) => {
                let Some(src) = take(values.len() * 4) else {
                    return false;
                };
                for (r, b) in rows[values].iter_mut().zip(src.chunks_exact(4)) {
                    *r = f32::from_le_bytes(b.try_into().expect("4 bytes"));
                }
            }
            KvRows::Bf16(rows) => {
                let Some(src) = take(values.len() * 2) else {
                    return false;
                };
                for (r, b) in rows[values].iter_mut().zip(src.chunks_exact(2)) {
                    *r = bf16::from_bits(u16::from_le_bytes(b.try_into().expect("2 bytes")));
                }
            }
            KvRows::Fp8 { codes, scales, .. } => {
                let Some(src) = take(values.len()) else {
                    return false;
                };
                codes[values].copy_from_slice(src);
                let scale_range = slots.start * heads..slots.end * heads;
                let Some(src) = take(scale_range.len() * 4) else {
                    return false;
                };
                for (r, b) in scales[scale_range].iter_mut().zip(src.chunks_exact(4)) {
                    *r = f32::from_le_bytes(b.try_into().expect("4 bytes"));
                }
            }
        }
        true
    }

    /// The f32 rows themselves, where they are stored so.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match self {
            KvRows::F32(rows) => Some(rows),
            _ => None,
        }
    }

    /// Head `kv_head` of slots `first_slot..first_slot + n` as f32 into `out`
    /// (`[n, head_dim]`), for a cache of `kv_heads` heads.
    pub fn decode_block(
        &self,
        first_slot: usize,
        n: usize,
        kv_head: usize,
        kv_heads: usize,
        head_dim: usize,
        out: &mut [f32],
    ) {
        let kv_dim = kv_heads * head_dim;
        for (s, row) in out[..n * head_dim].chunks_exact_mut(head_dim).enumerate() {
            let slot = first_slot + s;
            let at = slot * kv_dim + kv_head * head_dim;
            match self {
                KvRows::F32(rows) => row.copy_from_slice(&rows[at..at + head_dim]),
                KvRows::Bf16(rows) => {
                    for (o, r) in row.iter_mut().zip(&rows[at..at + head_dim]) {
                        *o = r.to_f32();
                    }
                }
                KvRows::Fp8 {
                    codes,
                    scales,
                    table,
                } => {
                    let scale = scales[slot * kv_heads + kv_head];
                    for (o, &c) in row.iter_mut().zip(&codes[at..at + head_dim]) {
                        *o = table[c as usize] * scale;
                    }
                }
            }
        }
    }
}

pub struct CpuKvCache {
    pub shape: KvCacheShape,
    pub k: Vec<KvRows>,
    pub v: Vec<KvRows>,
}

impl CpuKvCache {
    pub fn new(shape: KvCacheShape) -> Self {
        CpuKvCache {
            shape,
            k: (0..shape.num_layers).map(|_| KvRows::new(&shape)).collect(),
            v: (0..shape.num_layers).map(|_| KvRows::new(&shape)).collect(),
        }
    }

    /// Token `t`'s K and V (`[num_tokens, kv_dim]`) into `layer` at `slots[t]`.
    pub fn write(&mut self, layer: usize, k: &[f32], v: &[f32], slots: &[u32]) {
        let (d, hd) = (self.shape.kv_dim(), self.shape.head_dim);
        for (t, &slot) in slots.iter().enumerate() {
            let s = slot as usize;
            self.k[layer].write(s, &k[t * d..(t + 1) * d], hd);
            self.v[layer].write(s, &v[t * d..(t + 1) * d], hd);
        }
    }
}

/// `xs`' bytes appended to `out`, written in place (a loop the compiler vectorizes, where
/// extending from a flattened iterator goes byte by byte).
fn put<const N: usize>(out: &mut Vec<u8>, xs: impl ExactSizeIterator<Item = [u8; N]>) {
    let at = out.len();
    out.resize(at + xs.len() * N, 0);
    for (dst, x) in out[at..].chunks_exact_mut(N).zip(xs) {
        dst.copy_from_slice(&x);
    }
}

impl CpuKvCache {
    /// Block `block` of every layer, K then V, as stored (a prefix store's payload).
    pub fn block_bytes(&self, block: u32) -> Vec<u8> {
        let mut out = Vec::new();
        self.append_block_bytes(block, &mut out);
        out
    }

    /// `block_bytes`, appended to `out`.
    pub fn append_block_bytes(&self, block: u32, out: &mut Vec<u8>) {
        let (slots, width, heads) = self.block_slots(block);
        for (k, v) in self.k.iter().zip(&self.v) {
            k.append_block(slots.clone(), width, heads, out);
            v.append_block(slots.clone(), width, heads, out);
        }
    }

    /// Fills block `block` from `block_bytes`' bytes; false (the block left partly
    /// written) when they are not exactly one block of this cache's layout.
    pub fn set_block_bytes(&mut self, block: u32, mut bytes: &[u8]) -> bool {
        let (slots, width, heads) = self.block_slots(block);
        for (k, v) in self.k.iter_mut().zip(&mut self.v) {
            if !k.take_block(slots.clone(), width, heads, &mut bytes)
                || !v.take_block(slots.clone(), width, heads, &mut bytes)
            {
                return false;
            }
        }
        bytes.is_empty()
    }

    fn block_slots(&self, block: u32) -> (std::ops::Range<usize>, usize, usize) {
        let first = block as usize * self.shape.block_size;
        (
            first..first + self.shape.block_size,
            self.shape.kv_dim(),
            self.shape.num_kv_heads,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(dtype: KvDtype) -> KvCacheShape {
        KvCacheShape {
            num_layers: 1,
            num_blocks: 2,
            block_size: 4,
            num_kv_heads: 2,
            head_dim: 8,
            dtype,
        }
    }

    #[test]
    fn each_dtype_reads_back_what_it_stores_within_its_precision() {
        let values: Vec<f32> = (0..16)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.37)
            .collect();
        for (dtype, rel) in [
            (KvDtype::Auto, 0.0),
            (KvDtype::Bf16, 1.0 / 256.0),
            (KvDtype::Fp8, 1.0 / 16.0),
        ] {
            let mut c = CpuKvCache::new(shape(dtype));
            c.write(0, &values, &values, &[5]);
            for h in 0..2 {
                let mut out = vec![0f32; 8];
                c.k[0].decode_block(5, 1, h, 2, 8, &mut out);
                let head = &values[h * 8..(h + 1) * 8];
                let amax = head.iter().fold(0f32, |m, x| m.max(x.abs()));
                for (got, want) in out.iter().zip(head) {
                    // e4m3 keeps 3 mantissa bits: half a step is 1/16 of the value; the
                    // head's largest magnitude lands on 448 exactly.
                    assert!(
                        (got - want).abs() <= rel * want.abs() + 1e-6 * amax,
                        "{dtype:?} head {h}: {got} for {want}"
                    );
                }
                if dtype == KvDtype::Fp8 {
                    let top = head.iter().copied().fold(0f32, |m, x| m.max(x.abs()));
                    assert!(out.iter().any(|x| (x.abs() - top).abs() <= 1e-6 * top));
                }
            }
            // A block copied out and into another block reads back the same.
            let mut copy = CpuKvCache::new(shape(dtype));
            assert!(copy.set_block_bytes(0, &c.block_bytes(1)));
            let (mut a, mut b) = (vec![0f32; 8], vec![0f32; 8]);
            c.k[0].decode_block(5, 1, 1, 2, 8, &mut a);
            copy.k[0].decode_block(1, 1, 1, 2, 8, &mut b);
            assert_eq!(a, b, "{dtype:?}: a block's bytes moved");
            assert!(
                !copy.set_block_bytes(0, &c.block_bytes(1)[1..]),
                "short bytes"
            );
            let mut zero = vec![1f32; 8];
            c.v[0].decode_block(0, 1, 1, 2, 8, &mut zero);
            assert!(
                zero.iter().all(|&x| x == 0.0),
                "{dtype:?}: an unwritten slot"
            );
        }
    }
}
