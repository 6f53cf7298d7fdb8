//! DeepSeek-V4's attention launches: the f32 kernel (`dsv4_attention.cu`: the batch-invariant
//! mode, and head widths the tensor cores do not take) and the tensor-core one
//! (`dsv4_attention_mma.cu`: the default mode), each splitting a few rows' keys across blocks
//! for the merge kernel.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{Meta, blocks};
use crate::kernels::cuda::{CudaBackend, CudaError, check};
use crate::kernels::deepseek_v4::AttentionKeys;
use crate::kernels::entry_format::EntryFormat;

/// The attention kernel's heads per block at most, keys per tile, and output channels per
/// thread at most (`deepseek_v4.cu`'s ATT_HG, ATT_KT, ATT_CPT; 256 threads a block).
const ATT_HG: usize = 16;
const ATT_KT: usize = 16;
pub const ATT_MAX_HEAD_DIM: usize = 4 * 256;

/// `ATT_SMEM_FLOATS(hd)` in bytes: the block's query heads and key tile, padded rows.
fn attention_smem_bytes(head_dim: usize) -> usize {
    4 * ((ATT_HG + ATT_KT) * (head_dim + 1) + ATT_HG * ATT_KT + 2 * ATT_HG)
}

/// Enough for a 1024-wide head.
pub(super) const ATTENTION_SMEM_BYTES: usize = 140 << 10;

/// Blocks that keep every SM busy with two.
const ATT_BUSY_BLOCKS: usize = 264;
/// The most ways a row's keys are split (the merge kernel takes up to `ATT_MAX_MERGE`, 64).
const ATT_MAX_SPLITS: usize = 32;
/// The batch-invariant mode's splits at most, keys a split (4 tiles: a decode row's 256
/// keys in 4 splits), and the (row, head group)s it keeps at least before taking fewer
/// heads a block.
const ATT_INV_SPLITS: usize = 16;
const ATT_INV_SPLIT_KEYS: usize = 4 * ATT_KT;
const ATT_INV_GROUPS: usize = 32;

/// Heads a block of the attention kernel takes, the splits of each row's keys, and the
/// keys a split in the batch-invariant mode (0: the keys are shared among the splits):
/// every head of a group in one block while there are enough blocks (each block reads its
/// keys once for all its heads); short of that, fewer heads a block; and for a few rows
/// (under half the blocks at full groups) the keys split across blocks instead
/// (flash-decoding, the partial sums merged in split order). The batch-invariant mode
/// always splits, `ATT_INV_SPLITS` ways at most and by a row's own key count
/// (`ATT_INV_SPLIT_KEYS` a split), so that a row's sums do not depend on the batch; the
/// heads a block do not change them either (each head's sums are its own), so they follow
/// the batch.
fn attention_grid(rows: usize, heads: usize, invariant: bool) -> (usize, usize, usize) {
    let mut hg = ATT_HG.min(heads).max(1);
    let groups = rows * heads.div_ceil(hg);
    if invariant {
        while hg > 1 && rows * heads.div_ceil(hg) < ATT_INV_GROUPS {
            hg /= 2;
        }
        return (hg, ATT_INV_SPLITS, ATT_INV_SPLIT_KEYS);
    }
    if 2 * groups < ATT_BUSY_BLOCKS {
        return (hg, ATT_BUSY_BLOCKS.div_ceil(groups).min(ATT_MAX_SPLITS), 0);
    }
    while hg > 1 && rows * heads.div_ceil(hg) < ATT_BUSY_BLOCKS {
        hg /= 2;
    }
    (hg, 1, 0)
}

/// The tensor-core kernel's heads a block, keys a tile and widest head
/// (`dsv4_attention_mma.cu`'s AM_HEADS, AM_KT, AM_MAX_HD; 512 threads a block).
const AM_HEADS: usize = 64;
const AM_KT: usize = 64;
const AM_MAX_HD: usize = 512;
const AM_THREADS: u32 = 512;

/// `AM_SMEM_BYTES(hd)`: bf16 queries and key tile (rows padded by 8), f32 scores, bf16
/// probabilities, and three floats a head.
const fn mma_smem_bytes(head_dim: usize) -> usize {
    2 * (AM_HEADS + AM_KT) * (head_dim + 8)
        + 4 * AM_HEADS * (AM_KT + 8)
        + 2 * AM_HEADS * (AM_KT + 8)
        + 12 * AM_HEADS
}

/// What `dsv4_attention_mma_kernel` opts in to: its widest head.
pub(super) const MMA_SMEM_BYTES: usize = mma_smem_bytes(AM_MAX_HD);

/// Whether the tensor-core kernel takes this head width (whole 16-channel mma steps).
fn mma_fits(head_dim: usize) -> bool {
    head_dim.is_multiple_of(16) && head_dim <= AM_MAX_HD
}

/// Splits of a row's keys for the tensor-core kernel: none once `blocks` (rows × head
/// groups) fill the SMs (one block an SM); else enough to fill them, up to ATT_MAX_SPLITS
/// (splits past a row's keys are empty blocks, cheap).
fn mma_splits(blocks: usize, num_sms: usize) -> usize {
    if blocks >= num_sms {
        1
    } else {
        num_sms.div_ceil(blocks.max(1)).min(ATT_MAX_SPLITS)
    }
}

impl CudaBackend {
    /// Each sequence's last `ring_len` K=V rows into its slot's ring (f32 only).
    pub(super) fn launch_ring_write(
        &self,
        ring: &mut CudaSlice<f32>,
        kv: &CudaSlice<f32>,
        meta: &Meta,
        format: EntryFormat,
        ring_len: usize,
        head_dim: usize,
    ) {
        // The engine refuses packed caches on CUDA.
        assert_eq!(
            format,
            EntryFormat::F32,
            "a packed ring runs on the CPU only"
        );
        if ring_len == 0 {
            return;
        }
        let keep = meta.max_len.min(ring_len);
        let (rl, hd) = (ring_len as i32, head_dim as i32);
        // SAFETY: ring covers every slot, kv the step's rows.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.ds().ring_write)
                    .arg(ring)
                    .arg(kv)
                    .arg(&meta.seqs)
                    .arg(&rl)
                    .arg(&hd)
                    .launch(blocks((keep * head_dim).div_ceil(256), meta.num_seqs, 256))
            },
            "dsv4_ring_write",
        );
    }

    /// Attention with sinks for every (row, head), one block a row and a group of heads.
    pub(super) fn launch_attention(
        &self,
        out: &mut CudaSlice<f32>,
        q: &CudaSlice<f32>,
        keys: &AttentionKeys<'_, CudaBackend>,
        sinks: &CudaSlice<f32>,
        meta: &Meta,
        heads: usize,
        head_dim: usize,
    ) -> Result<(), CudaError> {
        // The engine refuses packed caches on CUDA.
        let packed = keys.ring_format != EntryFormat::F32
            || keys
                .compressed
                .is_some_and(|(c, _)| c.format != EntryFormat::F32);
        assert!(!packed, "packed cache entries run on the CPU only");
        if head_dim > ATT_MAX_HEAD_DIM {
            return Err(CudaError::Runtime(format!(
                "DeepSeek-V4 attention: head_dim {head_dim} over the kernel's {ATT_MAX_HEAD_DIM}"
            )));
        }
        let (rate, epb, entries) = match keys.compressed {
            Some((c, _)) => (c.rate, c.entries_per_block, Some(&c.entries)),
            None => (0, 1, None),
        };
        let sel = keys.compressed.and_then(|(_, s)| s);
        let null = 0u64;
        let (sel_k, bs) = (sel.map_or(0, |(_, k)| k) as i32, keys.block_size as i32);
        let (hi, hd, window, ring_len) = (
            heads as i32,
            head_dim as i32,
            keys.window as i32,
            keys.ring_len.max(1) as i32,
        );
        let (ri, epbi) = (rate as i32, epb as i32);
        let scale = (head_dim as f32).powf(-0.5);
        let mma = !self.batch_invariant && mma_fits(head_dim);
        let (hg, splits, split_keys) = if mma {
            // Splits past the most keys a row can have would be empty: the window alone, or
            // with the indexer's picks (not bounded otherwise: HCA's entries grow with the
            // position, and a captured step's grid must not change with it).
            let max_keys = match (rate, sel) {
                (0, _) => Some(keys.window),
                (_, Some((_, k))) => Some(keys.window + k),
                (_, None) => None,
            };
            let blocks = meta.num_rows * heads.div_ceil(AM_HEADS);
            let splits = mma_splits(blocks, self.kernels.num_sms);
            let most = max_keys.map_or(splits, |k| k.div_ceil(AM_KT).max(1));
            (AM_HEADS, splits.min(most), 0)
        } else {
            attention_grid(meta.num_rows, heads, self.batch_invariant)
        };
        let (hgi, si, ski) = (hg as i32, splits as i32, split_keys as i32);
        let parts = meta.num_rows * heads * splits;
        let mut part = self.alloc_written(if splits > 1 {
            parts * (head_dim + 2)
        } else {
            1
        });
        let (kernel, threads, smem) = if mma {
            (
                &self.ds().attention_mma,
                AM_THREADS,
                mma_smem_bytes(head_dim),
            )
        } else {
            (&self.ds().attention, 256, attention_smem_bytes(head_dim))
        };
        let cfg = LaunchConfig {
            grid_dim: (
                meta.num_rows.max(1) as u32,
                heads.div_ceil(hg) as u32,
                splits as u32,
            ),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let mut launch = self.stream.launch_builder(kernel);
        launch.arg(&mut *out).arg(q).arg(keys.kv).arg(keys.ring);
        match entries {
            Some(e) => launch.arg(e),
            None => launch.arg(&null),
        };
        match sel {
            Some((s, _)) => launch.arg(s),
            None => launch.arg(&null),
        };
        launch
            .arg(&sel_k)
            .arg(&meta.rows)
            .arg(&meta.seqs)
            .arg(&meta.tables)
            .arg(sinks)
            .arg(&hi)
            .arg(&hd)
            .arg(&window)
            .arg(&ring_len)
            .arg(&ri)
            .arg(&bs)
            .arg(&epbi)
            .arg(&scale);
        if !mma {
            launch.arg(&hgi);
        }
        launch.arg(&si);
        if !mma {
            launch.arg(&ski);
        }
        launch.arg(&mut part);
        // SAFETY: q and out hold num_rows·heads·head_dim values; every key address the
        // kernel forms is inside the ring, the chunk's kv or the layer's entries (the
        // model checks the tables); head_dim ≤ ATT_MAX_HEAD_DIM bounds the shared memory.
        check(unsafe { launch.launch(cfg) }, "dsv4_attention");
        if splits > 1 {
            let hd = head_dim as i32;
            // SAFETY: part holds the splits' sums (parts · head_dim), then their (max, total)
            // pairs; out num_rows · heads rows of head_dim.
            check(
                unsafe {
                    self.stream
                        .launch_builder(&self.ds().attention_merge)
                        .arg(&mut *out)
                        .arg(&part)
                        .arg(&si)
                        .arg(&hd)
                        .launch(blocks(meta.num_rows * heads, 1, 256))
                },
                "dsv4_attention_merge",
            );
        }
        Ok(())
    }
}
