//! Paged attention on the GPU. The query rows of prefill chunks (outside the
//! batch-invariant mode, in an eager step) go to `flash_prefill_kernel`, 64 rows of a
//! sequence per block sharing each key and value they load. The other rows (every row of a
//! graph step: decode and verify rows) go, over a bf16 cache with up to 8 query heads per
//! KV head and a power-of-two block size, to `attention_decode_mma` (one block per row, KV
//! head and split, computing every query head of the group on tensor cores from one read of
//! the keys), else to `attention_split_kernel` (one block per row, head and split). A split
//! is a contiguous run of fixed 64-key chunks, merged by a combine kernel when there are
//! several. How many splits (counting blocks per row as above):
//! - batch-invariant mode: `INVARIANT_SPLITS`, always, so a row's result depends on nothing
//!   but its keys (its chunks shared out by that fixed count, merged in split order);
//! - otherwise enough blocks to fill the GPU: in a graph step a count fixed by its token
//!   count (a graph bakes in its grid), eagerly also at most one per chunk.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::graph::{Meta, Phase};
use super::kv_cache::KvEntry;
use super::module::decode_mma_smem_bytes;
use super::{CudaBackend, CudaKvCache, check};
use crate::kernels::{Backend, SeqAttention};

/// Keys per chunk (the kernel's `ATT_CHUNK`).
const CHUNK: usize = 64;
/// Splits aim at this many blocks (enough to fill the GPU), with at most `MAX_SPLITS` and,
/// eagerly, at most one per chunk. More splits measured slower (8192: 0.68 of the copy
/// bandwidth instead of 0.72 for Qwen3-0.6B's decode attention): every split adds a
/// block's fixed cost and partials to combine.
const TARGET_BLOCKS: usize = 2048;
/// At most the combine kernel's block size (128).
const MAX_SPLITS: usize = 64;
/// The invariant mode's fixed split count. With one split, a batch-1 step had 32 blocks
/// (one a head) each walking ~600 keys: 281 µs a layer on the H200, twice the layer's GEMMs
/// (Llama-3.1-8B shape, `gpu-profile.sh` with `--batch-invariant`). Sixteen fill the GPU at
/// batch 1 and keep the mostly-empty splits of a wide batch's short rows cheap to skip.
const INVARIANT_SPLITS: usize = 16;
/// Query rows per flash block (the kernel's `FA_ROWS`), and the row flag it owns.
const FLASH_ROWS: usize = 64;
const FLASH_ROW: u32 = 1 << 31;

impl CudaBackend {
    fn num_splits(&self, num_rows: usize, num_heads: usize, max_visible: usize) -> usize {
        if self.batch_invariant {
            return INVARIANT_SPLITS;
        }
        let pairs = num_rows * num_heads;
        let splits = TARGET_BLOCKS.div_ceil(pairs.max(1)).clamp(1, MAX_SPLITS);
        if self.phase() != Phase::Eager {
            // A graph bakes in its grid: the split count cannot follow the context.
            return splits;
        }
        splits.min(max_visible.div_ceil(CHUNK).max(1))
    }

    pub(super) fn attention(
        &self,
        q: &CudaSlice<f32>,
        cache: &CudaKvCache,
        layer: usize,
        seqs: &[SeqAttention<'_>],
        num_heads: usize,
        out: &mut CudaSlice<f32>,
    ) {
        let shape = &cache.shape;
        let mut tables = Vec::new();
        let num_rows: usize = seqs.iter().map(|s| s.num_query_tokens).sum();
        let (mut row_table, mut row_visible) = (vec![0u32; num_rows], vec![0u32; num_rows]);
        let mut max_visible = 0usize;
        // The invariant mode keeps every row on the split kernel: a position's result must
        // not depend on whether its chunk had one token or many.
        // A graph step's rows (decode and verify rows alike) go to the split kernels token
        // by token: the flash kernel's tile list follows the rows, which a graph cannot.
        let flash = cache.entry != KvEntry::F32
            && !self.batch_invariant
            && self.phase() == Phase::Eager
            && matches!(shape.head_dim, 64 | 128);
        let mut tiles: Vec<u32> = Vec::new();
        let mut split_rows: Vec<u32> = Vec::new();
        for s in seqs {
            let offset = tables.len() as u32;
            tables.extend_from_slice(s.block_table);
            let first_pos = (s.num_context_tokens + 1).saturating_sub(s.num_query_tokens);
            let in_flash = flash && s.num_query_tokens > 1;
            for t in 0..s.num_query_tokens {
                // A padding row has no context and sees nothing.
                let visible = (s.num_context_tokens + t + 1).saturating_sub(s.num_query_tokens);
                row_table[s.query_start + t] = offset;
                row_visible[s.query_start + t] =
                    visible as u32 | if in_flash { FLASH_ROW } else { 0 };
                if !in_flash {
                    max_visible = max_visible.max(visible);
                    split_rows.push((s.query_start + t) as u32);
                }
            }
            if in_flash {
                for t0 in (0..s.num_query_tokens).step_by(FLASH_ROWS) {
                    tiles.extend_from_slice(&[
                        (s.query_start + t0) as u32,
                        FLASH_ROWS.min(s.num_query_tokens - t0) as u32,
                        offset,
                        (first_pos - 1 + t0) as u32,
                    ]);
                }
            }
        }
        let tables_d = self.upload_u32(Meta::Tables, &tables);
        let rt_d = self.upload_u32(Meta::RowTable, &row_table);
        let rv_d = self.upload_u32(Meta::RowVisible, &row_visible);
        if self.replaying() {
            return;
        }
        let (nh, nkv, hd, bs) = (
            num_heads as i32,
            shape.num_kv_heads as i32,
            shape.head_dim as i32,
            shape.block_size as i32,
        );
        assert!(shape.head_dim <= 256, "attention supports head_dim ≤ 256");
        let scale = 1.0 / (shape.head_dim as f32).sqrt();
        let num_split_rows = split_rows.len();
        // A step with prefill tiles gives blocks to its decode rows only (they are listed);
        // otherwise (every graph step) each row is one, and no list is passed.
        let split_rows_d = if tiles.is_empty() {
            None
        } else {
            self.flash_prefill(q, cache, layer, tables_d.ptr, &tiles, num_heads, out);
            if num_split_rows == 0 {
                return;
            }
            Some(self.upload_u32(Meta::Rows, &split_rows))
        };
        let split_rows_ptr: u64 = split_rows_d.as_ref().map_or(0, |d| d.ptr);
        let grid_rows = if tiles.is_empty() {
            num_rows
        } else {
            num_split_rows
        };
        // Decode rows over a bf16 or fp8 cache: one block per KV head computes its query heads
        // on tensor cores.
        let group = num_heads / shape.num_kv_heads;
        let fp8 = cache.entry == KvEntry::Fp8;
        let mma = ((cache.bf16() || fp8)
            && !self.batch_invariant
            && num_heads.is_multiple_of(shape.num_kv_heads)
            && shape.block_size.is_power_of_two())
        .then(|| self.kernels.decode_mma(shape.head_dim, group, fp8))
        .flatten();
        let heads_per_block = if mma.is_some() { group } else { 1 };
        let num_splits = self.num_splits(num_split_rows, num_heads / heads_per_block, max_visible);
        let mut parts = self
            .attention_parts
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let num_parts = num_rows * num_heads * num_splits;
        if num_splits > 1
            && parts
                .as_ref()
                .is_none_or(|(o, _)| o.len() < num_parts * shape.head_dim)
        {
            self.moved();
            let n = num_parts.next_power_of_two();
            *parts = Some((self.alloc(n * shape.head_dim), self.alloc(n * 2)));
        }
        if parts.is_none() {
            *parts = Some((self.alloc(1), self.alloc(1)));
        }
        let (part_o, part_ml) = parts.as_mut().expect("allocated above");
        let splits = num_splits as i32;
        let (kc, vc) = cache.layer(layer, &self.stream);
        let (ks, vs) = cache.scales(layer, &self.stream);
        let cfg = LaunchConfig {
            grid_dim: (
                grid_rows.max(1) as u32,
                (num_heads / heads_per_block) as u32,
                num_splits as u32,
            ),
            block_dim: (128, 1, 1),
            shared_mem_bytes: if mma.is_some() {
                decode_mma_smem_bytes(shape.head_dim, fp8) as u32
            } else {
                0
            },
        };
        // SAFETY: the metadata describes rows inside q/out and slots inside the cache (an
        // fp8 one's scales: a float per slot and KV head, passed last); the partials hold
        // rows·heads·splits entries when there are several splits.
        let launched = match mma {
            Some(kernel) => unsafe {
                let (grp, shift) = (group as i32, shape.block_size.trailing_zeros() as i32);
                let mut launch = self.stream.launch_builder(kernel);
                launch
                    .arg(&mut *out)
                    .arg(&mut *part_o)
                    .arg(&mut *part_ml)
                    .arg(q)
                    .arg(&kc)
                    .arg(&vc)
                    .arg(&tables_d.ptr)
                    .arg(&rt_d.ptr)
                    .arg(&rv_d.ptr)
                    .arg(&split_rows_ptr)
                    .arg(&nkv)
                    .arg(&grp)
                    .arg(&shift)
                    .arg(&scale)
                    .arg(&splits);
                if fp8 {
                    launch.arg(&ks).arg(&vs);
                }
                launch.launch(cfg)
            },
            None => unsafe {
                let mut launch = self
                    .stream
                    .launch_builder(self.kernels.attention_split.get(cache.entry));
                launch
                    .arg(&mut *out)
                    .arg(&mut *part_o)
                    .arg(&mut *part_ml)
                    .arg(q)
                    .arg(&kc)
                    .arg(&vc)
                    .arg(&tables_d.ptr)
                    .arg(&rt_d.ptr)
                    .arg(&rv_d.ptr)
                    .arg(&split_rows_ptr)
                    .arg(&nh)
                    .arg(&nkv)
                    .arg(&hd)
                    .arg(&bs)
                    .arg(&scale)
                    .arg(&splits);
                if fp8 {
                    launch.arg(&ks).arg(&vs);
                }
                launch.launch(cfg)
            },
        };
        check(launched, "attention decode");
        if num_splits == 1 {
            return;
        }
        let cfg = LaunchConfig {
            grid_dim: (grid_rows as u32, num_heads as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: reads the partials written above, writes rows·heads·head_dim.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.kernels.attention_combine)
                    .arg(out)
                    .arg(&*part_o)
                    .arg(&*part_ml)
                    .arg(&rv_d.ptr)
                    .arg(&split_rows_ptr)
                    .arg(&nh)
                    .arg(&hd)
                    .arg(&splits)
                    .launch(cfg)
            },
            "attention_combine",
        );
    }

    #[allow(clippy::too_many_arguments)]
    fn flash_prefill(
        &self,
        q: &CudaSlice<f32>,
        cache: &CudaKvCache,
        layer: usize,
        tables: u64,
        tiles: &[u32],
        num_heads: usize,
        out: &mut CudaSlice<f32>,
    ) {
        let shape = &cache.shape;
        let tiles_d = self.upload_u32(Meta::Tiles, tiles);
        let (nh, nkv, bs) = (
            num_heads as i32,
            shape.num_kv_heads as i32,
            shape.block_size as i32,
        );
        let scale = 1.0 / (shape.head_dim as f32).sqrt();
        let fp8 = cache.entry == KvEntry::Fp8;
        let (_, bf16, fp8_kernel) = self
            .kernels
            .flash_prefill
            .iter()
            .find(|k| k.0 == shape.head_dim)
            .expect("flash prefill runs for head_dim 64 and 128");
        let kernel = if fp8 { fp8_kernel } else { bf16 };
        let (kc, vc) = cache.layer(layer, &self.stream);
        let (ks, vs) = cache.scales(layer, &self.stream);
        let cfg = LaunchConfig {
            grid_dim: ((tiles.len() / 4) as u32, num_heads as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: each tile names rows inside q/out and a block table covering its keys (an
        // fp8 cache's scales passed last).
        check(
            unsafe {
                let mut launch = self.stream.launch_builder(kernel);
                launch
                    .arg(&mut *out)
                    .arg(q)
                    .arg(&kc)
                    .arg(&vc)
                    .arg(&tables)
                    .arg(&tiles_d.ptr)
                    .arg(&nh)
                    .arg(&nkv)
                    .arg(&bs)
                    .arg(&scale);
                if fp8 {
                    launch.arg(&ks).arg(&vs);
                }
                launch.launch(cfg)
            },
            "flash_prefill",
        );
    }
}
