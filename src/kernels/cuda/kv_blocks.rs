//! Whole KV blocks between the GPU's cache and the host, for the prefix store. A block's
//! bytes are, layer by layer, K, its scales (fp8), V, its scales — the CPU cache's layout.
//! Blocks go through a staging buffer on the device (64 MiB at most, chunk by chunk):
//! gathered there by strided (2D) device copies, one per layer and half for each run of
//! consecutive block ids, and moved to or from the host in one contiguous copy a chunk —
//! a few dozen transfers for a prompt, not one per block and layer.

use cudarc::driver::sys::{CUDA_MEMCPY2D, CUmemorytype, cuMemcpy2DAsync_v2};
use cudarc::driver::{CudaSlice, DevicePtr};

use super::kv_cache::CudaKvCache;
use super::{CudaBackend, check};

/// The most device memory a copy of blocks stages through at once.
const STAGING_BYTES: usize = 64 << 20;

impl CudaBackend {
    /// `height` rows of `width` bytes from device address `src` (rows `src_pitch` apart)
    /// to `dst` (rows `dst_pitch` apart), on the stream.
    ///
    /// SAFETY: both sides must hold `height` rows at their pitch.
    unsafe fn copy_2d(
        &self,
        src: u64,
        src_pitch: usize,
        dst: u64,
        dst_pitch: usize,
        width: usize,
        height: usize,
    ) {
        if width == 0 || height == 0 {
            return;
        }
        let device = CUmemorytype::CU_MEMORYTYPE_DEVICE;
        let c = CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: device,
            srcHost: std::ptr::null(),
            srcDevice: src,
            srcArray: std::ptr::null_mut(),
            srcPitch: src_pitch,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: device,
            dstHost: std::ptr::null_mut(),
            dstDevice: dst,
            dstArray: std::ptr::null_mut(),
            dstPitch: dst_pitch,
            WidthInBytes: width,
            Height: height,
        };
        // SAFETY: the caller's contract; the stream is this backend's.
        let r = unsafe { cuMemcpy2DAsync_v2(&c, self.stream.cu_stream()) };
        check(r.result(), "KV blocks copy");
    }

    /// Per layer and half (K, V): the device addresses of its codes and of its scales
    /// (0 without scales).
    fn halves(&self, cache: &CudaKvCache) -> Vec<[(u64, u64); 2]> {
        (0..cache.shape.num_layers)
            .map(|layer| {
                let (k, v) = cache.layer(layer, &self.stream);
                let (ks, vs) = cache.scales(layer, &self.stream);
                [(k, ks), (v, vs)]
            })
            .collect()
    }

    /// Between the cache and a staging buffer at `staging` (blocks back to back, block
    /// `i` of `blocks` at `i · per_block`): each run of consecutive ids one strided copy
    /// a layer and half, out of the cache (`out`) or into it.
    fn scatter_gather(&self, cache: &CudaKvCache, blocks: &[u32], staging: u64, out: bool) {
        let (w, s) = cache.block_bytes();
        let per_block = 2 * (w + s) * cache.shape.num_layers;
        for run in runs(blocks) {
            let (first, n) = (blocks[run.start] as usize, run.len());
            for (layer, pair) in self.halves(cache).iter().enumerate() {
                for (half, &(codes, scales)) in pair.iter().enumerate() {
                    let at = (run.start * per_block + layer * 2 * (w + s) + half * (w + s)) as u64;
                    for (cache_at, size, off) in [(codes, w, 0), (scales, s, w as u64)] {
                        if cache_at == 0 || size == 0 {
                            continue;
                        }
                        let in_cache = cache_at + (first * size) as u64;
                        let in_staging = staging + at + off;
                        // SAFETY: `n` blocks of `size` bytes from block `first` on lie in
                        // the layer's codes (scales); the staging buffer holds `n` blocks
                        // of `per_block` bytes from `at`.
                        unsafe {
                            match out {
                                true => {
                                    self.copy_2d(in_cache, size, in_staging, per_block, size, n)
                                }
                                false => {
                                    self.copy_2d(in_staging, per_block, in_cache, size, size, n)
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// A staging buffer for up to `blocks` blocks of `per_block` bytes, at most
    /// `STAGING_BYTES` (one block at least): how many blocks it holds, and it.
    fn staging(&self, blocks: usize, per_block: usize) -> (usize, CudaSlice<u8>) {
        let n = (STAGING_BYTES / per_block).clamp(1, blocks.max(1));
        // SAFETY: every byte read from it is written first (a whole chunk of blocks).
        let buf = unsafe { self.stream.alloc::<u8>(n * per_block) };
        (n, check(buf, "KV staging buffer"))
    }

    /// Blocks `blocks`, back to back (each `len / blocks.len()` bytes): gathered on the
    /// device into a staging buffer, then one copy to the host a chunk. Waits for the
    /// stream's work before it (the blocks' writers).
    pub(super) fn kv_blocks_bytes(&self, cache: &CudaKvCache, blocks: &[u32]) -> Vec<u8> {
        let (w, s) = cache.block_bytes();
        let per_block = 2 * (w + s) * cache.shape.num_layers;
        let mut out = vec![0u8; per_block * blocks.len()];
        let (chunk, staging) = self.staging(blocks.len(), per_block);
        let at = staging.device_ptr(&self.stream).0;
        for (i, part) in blocks.chunks(chunk).enumerate() {
            self.scatter_gather(cache, part, at, true);
            let bytes = part.len() * per_block;
            let dst = &mut out[i * chunk * per_block..][..bytes];
            check(
                self.stream.memcpy_dtoh(&staging.slice(0..bytes), dst),
                "KV blocks to the host",
            );
        }
        out
    }

    /// Fills each `(block, bytes)` from `kv_blocks_bytes`' bytes of one block: copied to
    /// a staging buffer, then scattered on the device. False, having written nothing,
    /// when any is not one block of this cache's layout.
    pub(super) fn set_kv_blocks_bytes(
        &self,
        cache: &mut CudaKvCache,
        blocks: &[(u32, &[u8])],
    ) -> bool {
        let (w, s) = cache.block_bytes();
        let per_block = 2 * (w + s) * cache.shape.num_layers;
        if blocks.iter().any(|(_, bytes)| bytes.len() != per_block) {
            return false;
        }
        let (chunk, mut staging) = self.staging(blocks.len(), per_block);
        for part in blocks.chunks(chunk) {
            for (i, (_, bytes)) in part.iter().enumerate() {
                let mut dst = staging.slice_mut(i * per_block..(i + 1) * per_block);
                check(
                    self.stream.memcpy_htod(*bytes, &mut dst),
                    "KV blocks to the device",
                );
            }
            let ids: Vec<u32> = part.iter().map(|b| b.0).collect();
            let at = staging.device_ptr(&self.stream).0;
            self.scatter_gather(cache, &ids, at, false);
        }
        // The host bytes were copied out by each (pageable) copy as it was queued.
        true
    }
}

/// `blocks` as runs of consecutive ids (index ranges into it): one transfer each.
fn runs(blocks: &[u32]) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    for i in 1..=blocks.len() {
        if i == blocks.len() || blocks[i] != blocks[i - 1].wrapping_add(1) {
            out.push(start..i);
            start = i;
        }
    }
    out
}
