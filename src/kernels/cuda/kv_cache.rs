//! The paged KV cache on the GPU, and what writes into it: K and V rows at their slots, or
//! the stacked q/k/v projection split, normalised, rotated and written in one launch.

use crate::sync::Shared as Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};

use super::graph::Meta;
use super::{CudaBackend, check, grid_for};
use crate::kernels::{KvCacheShape, KvDtype};

/// What a cache entry is on the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvEntry {
    /// The batch-invariant mode's: the CPU reference's numbers.
    F32,
    Bf16,
    /// e4m3 codes, and per (slot, kv head) an f32 scale (`--kv-cache-dtype fp8`).
    Fp8,
}

impl KvEntry {
    fn bytes(self) -> usize {
        match self {
            KvEntry::F32 => 4,
            KvEntry::Bf16 => 2,
            KvEntry::Fp8 => 1,
        }
    }
}

/// Per layer, keys and values as raw bytes of `entry`s, and an fp8 cache's scales.
pub struct CudaKvCache {
    pub shape: KvCacheShape,
    pub entry: KvEntry,
    k: Vec<CudaSlice<u8>>,
    v: Vec<CudaSlice<u8>>,
    /// Per layer `[slots, kv_heads]` (fp8 only; else empty).
    k_scales: Vec<CudaSlice<f32>>,
    v_scales: Vec<CudaSlice<f32>>,
}

impl CudaKvCache {
    /// Device addresses of a layer's keys and values.
    pub(super) fn layer(&self, layer: usize, stream: &Arc<CudaStream>) -> (u64, u64) {
        (
            self.k[layer].device_ptr(stream).0,
            self.v[layer].device_ptr(stream).0,
        )
    }

    /// Device addresses of a layer's key and value scales (0 unless fp8).
    pub(super) fn scales(&self, layer: usize, stream: &Arc<CudaStream>) -> (u64, u64) {
        match (self.k_scales.get(layer), self.v_scales.get(layer)) {
            (Some(k), Some(v)) => (k.device_ptr(stream).0, v.device_ptr(stream).0),
            _ => (0, 0),
        }
    }

    /// Bytes of one block in a layer's K (or V), and of its scales (0 unless fp8).
    pub(super) fn block_bytes(&self) -> (usize, usize) {
        let slots = self.shape.block_size;
        let scales = match self.entry {
            KvEntry::Fp8 => slots * self.shape.num_kv_heads * 4,
            _ => 0,
        };
        (slots * self.shape.kv_dim() * self.entry.bytes(), scales)
    }

    pub fn bf16(&self) -> bool {
        self.entry == KvEntry::Bf16
    }
}

impl CudaBackend {
    pub(super) fn new_kv_cache(&self, shape: KvCacheShape) -> CudaKvCache {
        let entry = match shape.dtype {
            KvDtype::Fp8 => KvEntry::Fp8,
            _ if self.kv_bf16() => KvEntry::Bf16,
            _ => KvEntry::F32,
        };
        let bytes = shape.layer_len() * entry.bytes();
        let layer = || check(self.stream.alloc_zeros::<u8>(bytes), "KV cache");
        let scales = || match entry {
            KvEntry::Fp8 => (0..shape.num_layers)
                .map(|_| {
                    let n = shape.num_slots() * shape.num_kv_heads;
                    check(self.stream.alloc_zeros::<f32>(n), "KV cache scales")
                })
                .collect(),
            _ => Vec::new(),
        };
        CudaKvCache {
            shape,
            entry,
            k: (0..shape.num_layers).map(|_| layer()).collect(),
            v: (0..shape.num_layers).map(|_| layer()).collect(),
            k_scales: scales(),
            v_scales: scales(),
        }
    }

    pub(super) fn write_kv(
        &self,
        cache: &mut CudaKvCache,
        layer: usize,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        slots: &[u32],
    ) {
        let slots_d = self.upload_u32(Meta::Slots, slots);
        if self.replaying() {
            return;
        }
        let (d, n) = (cache.shape.kv_dim() as i32, slots.len() as i32);
        let (kc, vc) = cache.layer(layer, &self.stream);
        if cache.entry == KvEntry::Fp8 {
            // A block a token: with none, the one block would read a slot nobody wrote.
            if slots.is_empty() {
                return;
            }
            let (ks, vs) = cache.scales(layer, &self.stream);
            let (heads, hd) = (cache.shape.num_kv_heads as i32, cache.shape.head_dim as i32);
            // SAFETY: as below; the scales hold a float per (slot, kv head).
            check(
                unsafe {
                    self.stream
                        .launch_builder(&self.kernels.kv_write.fp8)
                        .arg(&kc)
                        .arg(&vc)
                        .arg(&ks)
                        .arg(&vs)
                        .arg(k)
                        .arg(v)
                        .arg(&slots_d.ptr)
                        .arg(&heads)
                        .arg(&hd)
                        .launch(LaunchConfig {
                            grid_dim: (slots.len().max(1) as u32, 1, 1),
                            block_dim: (256, 1, 1),
                            shared_mem_bytes: 0,
                        })
                },
                "kv_write_fp8",
            );
            return;
        }
        // SAFETY: slots are inside the pool (the block manager's), k/v hold n rows.
        check(
            unsafe {
                self.stream
                    .launch_builder(self.kernels.kv_write.get(cache.entry))
                    .arg(&kc)
                    .arg(&vc)
                    .arg(k)
                    .arg(v)
                    .arg(&slots_d.ptr)
                    .arg(&d)
                    .arg(&n)
                    .launch(grid_for(slots.len() * cache.shape.kv_dim()))
            },
            "kv_write",
        );
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn split_qkv_into_cache(
        &self,
        qkv: &CudaSlice<f32>,
        heads: crate::kernels::QkvHeads,
        qk_norm: Option<(&CudaSlice<f32>, &CudaSlice<f32>, f32)>,
        positions: &[u32],
        cos_sin: &CudaSlice<f32>,
        cache: &mut CudaKvCache,
        layer: usize,
        slots: &[u32],
        q_out: &mut CudaSlice<f32>,
    ) -> bool {
        let hd = heads.head_dim;
        if !hd.is_multiple_of(64) || hd > 256 {
            return false;
        }
        let pos = self.upload_u32(Meta::Positions, positions);
        let slots_d = self.upload_u32(Meta::Slots, slots);
        if self.replaying() {
            return true;
        }
        let (kc, vc) = cache.layer(layer, &self.stream);
        let (ks, vs) = cache.scales(layer, &self.stream);
        let (qn, kn, eps) = match qk_norm {
            Some((q, k, eps)) => (
                q.device_ptr(&self.stream).0,
                k.device_ptr(&self.stream).0,
                eps,
            ),
            None => (0, 0, 0.0),
        };
        let (h, kvh, hdi) = (heads.num_heads as i32, heads.num_kv_heads as i32, hd as i32);
        // 16 warps a block (the kernel's launch bound is 512 threads).
        let head_blocks = (heads.num_heads + 2 * heads.num_kv_heads).div_ceil(16) as u32;
        // SAFETY: qkv holds slots.len() rows of (heads + 2·kv_heads)·head_dim, q_out the q
        // part; the slots are inside the pool; the norms hold head_dim each; cos_sin covers
        // the positions.
        check(
            unsafe {
                let mut launch = self
                    .stream
                    .launch_builder(self.kernels.qkv_rope_cache.get(cache.entry));
                launch.arg(&mut *q_out).arg(&kc).arg(&vc);
                if cache.entry == KvEntry::Fp8 {
                    launch.arg(&ks).arg(&vs);
                }
                launch
                    .arg(qkv)
                    .arg(&qn)
                    .arg(&kn)
                    .arg(&eps)
                    .arg(&pos.ptr)
                    .arg(cos_sin)
                    .arg(&slots_d.ptr)
                    .arg(&h)
                    .arg(&kvh)
                    .arg(&hdi)
                    .launch(LaunchConfig {
                        // A warp a head, all heads at once: a batch-1 step's one block
                        // would otherwise walk its heads in turns of dependent loads.
                        grid_dim: (slots.len().max(1) as u32, head_blocks, 1),
                        block_dim: (512, 1, 1),
                        shared_mem_bytes: 0,
                    })
            },
            "qkv_rope_cache",
        );
        true
    }
}
