//! Picks made where the logits lie (greedy, or drawn by `sample_kernel` with the CPU
//! sampler's semantics): kept in a fixed device buffer for the next step's embedding (ZOS
//! without a host round trip) and copied to page-locked memory without waiting, for the
//! readback thread.

use cudarc::driver::{
    CudaEvent, CudaSlice, DevicePtr, LaunchConfig, PinnedHostSlice, PushKernelArg,
};

use super::graph::Meta;
use super::{CudaBackend, check};
use crate::kernels::PickRow;

/// u32 words per row of `sample_kernel`'s metadata (the kernel's `SAMPLE_META`).
const SAMPLE_META: usize = 14;

/// Picks one step may make (rows): the device buffer the next step's embedding
/// reads them from has this fixed size, so graphs never see it move.
pub(super) const MAX_PICKS: usize = 1 << 16;

/// Page-locked landing place of one step's picks, back in the pool once read.
pub(super) struct PickSlot {
    ids: PinnedHostSlice<u32>,
    logprobs: PinnedHostSlice<f32>,
    /// Recorded after the copies into this slot.
    landed: CudaEvent,
}

pub(super) type PickPool = crate::sync::SlotPool<PickSlot>;

/// Page-locked copy of the last picks' ids, with the event after the copy.
pub(super) struct EarlyPicks {
    ids: PinnedHostSlice<u32>,
    landed: CudaEvent,
    /// Picks the last launch made.
    len: usize,
}

impl EarlyPicks {
    pub(super) fn new(
        ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
    ) -> Result<Self, cudarc::driver::DriverError> {
        Ok(EarlyPicks {
            // SAFETY: only entries a copy wrote are read, after its event completed.
            ids: unsafe { ctx.alloc_pinned_with_flags(MAX_PICKS, 0)? },
            landed: ctx.new_event(None)?,
            len: 0,
        })
    }
}

/// `sample_kernel`'s metadata for `rows`: `SAMPLE_META` words a row, the rows' grammar
/// masks back to back (a vocabulary of bits each), and how many rows draw (need scratch).
struct SampleMeta {
    meta: Vec<u32>,
    masks: Vec<u32>,
    num_sampled: u32,
}

fn sample_meta(rows: &[PickRow<'_>], vocab: usize) -> SampleMeta {
    let mut meta = Vec::with_capacity(rows.len() * SAMPLE_META);
    let (mut masks, mut num_sampled) = (Vec::new(), 0u32);
    for (i, r) in rows.iter().enumerate() {
        let p = r.params;
        let (temperature, scratch_row) = if p.is_greedy() {
            (0.0f32, 0)
        } else {
            num_sampled += 1;
            (p.temperature, num_sampled - 1)
        };
        meta.extend_from_slice(&[
            r.row as u32,
            i as u32,
            p.top_k as u32,
            temperature.to_bits(),
            p.top_p.to_bits(),
            p.min_p.to_bits(),
            p.seed as u32,
            (p.seed >> 32) as u32,
            r.position as u32,
            (r.position >> 32) as u32,
            scratch_row,
            r.verified_row.unwrap_or(u32::MAX),
            r.draft.unwrap_or(u32::MAX),
            r.mask.map_or(u32::MAX, |m| {
                assert_eq!(m.len(), vocab.div_ceil(32), "a mask holds a bit per id");
                masks.extend_from_slice(m);
                (masks.len() - m.len()) as u32
            }),
        ]);
    }
    SampleMeta {
        meta,
        masks,
        num_sampled,
    }
}

impl CudaBackend {
    /// `sample_kernel` over `n` rows of `logits`, a block each: picks and logprobs into
    /// `out`, the rest as the kernel reads them (device addresses; 0 where unused).
    ///
    /// # Safety
    /// Every row `meta` lists lies inside `logits`; `out` holds `n` entries at the picks'
    /// indices; `scratch` a vocabulary of keys and weights per sampled row; `verified` and
    /// `masks` cover what the rows index.
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch_sample(
        &self,
        out: (u64, u64),
        logits: &CudaSlice<f32>,
        meta: u64,
        scratch: (u64, u64),
        verified: u64,
        masks: u64,
        vocab: usize,
        n: usize,
    ) {
        let v = vocab as i32;
        let cfg = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: as the caller promised.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.kernels.sample)
                    .arg(&out.0)
                    .arg(&out.1)
                    .arg(logits)
                    .arg(&meta)
                    .arg(&scratch.0)
                    .arg(&scratch.1)
                    .arg(&verified)
                    .arg(&masks)
                    .arg(&v)
                    .launch(cfg)
            },
            "sample",
        );
    }

    pub(super) fn device_picks(
        &self,
        logits: &CudaSlice<f32>,
        vocab: usize,
        rows: &[PickRow<'_>],
    ) -> crate::kernels::Pending<Vec<(u32, f32)>> {
        let n = rows.len();
        if n == 0 {
            return Box::new(Vec::new);
        }
        assert!(
            n <= MAX_PICKS,
            "{n} picked rows in one step exceed {MAX_PICKS}"
        );
        let SampleMeta {
            meta,
            masks,
            num_sampled,
        } = sample_meta(rows, vocab);
        let meta_d = self.upload_u32(Meta::Rows, &meta);
        // Freed in stream order after the launch that reads it.
        let masks_d = (!masks.is_empty()).then(|| check(self.stream.clone_htod(&masks), "masks"));
        let masks_ptr = masks_d
            .as_ref()
            .map_or(0u64, |m| m.device_ptr(&self.stream).0);
        // The rows `apply_verified` moved back, with their counts: this step's, since the
        // next step's metadata reaches the arena after this launch on the same stream.
        let verified = if rows.iter().any(|r| r.verified_row.is_some()) {
            self.graphs().region(&self.stream, Meta::Verified)
        } else {
            0
        };
        let mut scratch = self
            .sample_scratch
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let needed = (num_sampled as usize).max(1) * vocab;
        if scratch.as_ref().is_none_or(|(k, _)| k.len() < needed) {
            // Not a graph buffer: picks run after the recorded forward pass.
            let len = needed.next_power_of_two();
            *scratch = Some((
                check(self.stream.alloc_zeros::<u32>(len), "alloc"),
                check(self.stream.alloc_zeros::<f32>(len), "alloc"),
            ));
        }
        let (keys, weights) = scratch.as_mut().expect("allocated above");
        let mut picks = self.picks.lock().unwrap_or_else(|e| e.into_inner());
        let (ids, logprobs) = &mut *picks;
        let ptr = |d: &CudaSlice<u32>| d.device_ptr(&self.stream).0;
        // SAFETY: the outputs hold MAX_PICKS ≥ n; the scratch holds a vocabulary per sampled
        // row; `verified` and the masks are what the rows index.
        unsafe {
            self.launch_sample(
                (ptr(ids), logprobs.device_ptr(&self.stream).0),
                logits,
                meta_d.ptr,
                (ptr(keys), weights.device_ptr(&self.stream).0),
                verified,
                masks_ptr,
                vocab,
                n,
            )
        };
        let mut slot = self.pick_slots.take_or(|| {
            // Plain page-locked memory (not write-combined): the host reads it.
            // SAFETY: only the first n entries are read, after the copy into them landed.
            unsafe {
                PickSlot {
                    ids: check(
                        self.ctx.alloc_pinned_with_flags(MAX_PICKS, 0),
                        "pinned picks",
                    ),
                    logprobs: check(
                        self.ctx.alloc_pinned_with_flags(MAX_PICKS, 0),
                        "pinned picks",
                    ),
                    landed: check(self.ctx.new_event(None), "event"),
                }
            }
        });
        let host_ids = check(slot.ids.as_mut_ptr(), "pinned picks");
        let host_lps = check(slot.logprobs.as_mut_ptr(), "pinned picks");
        // SAFETY: the slot's n entries are written by the copies and read only after
        // `landed` (recorded after them) completes; the slot is not reused before that.
        unsafe {
            let (ids_ptr, _g1) = ids.device_ptr(&self.stream);
            let (lps_ptr, _g2) = logprobs.device_ptr(&self.stream);
            check(
                cudarc::driver::result::memcpy_dtoh_async(
                    std::slice::from_raw_parts_mut(host_ids, n),
                    ids_ptr,
                    self.stream.cu_stream(),
                ),
                "picks download",
            );
            check(
                cudarc::driver::result::memcpy_dtoh_async(
                    std::slice::from_raw_parts_mut(host_lps, n),
                    lps_ptr,
                    self.stream.cu_stream(),
                ),
                "picks download",
            );
        }
        check(slot.landed.record(&self.stream), "event");
        {
            let mut early = self.early_picks.lock().unwrap_or_else(|e| e.into_inner());
            let host = check(early.ids.as_mut_ptr(), "pinned picks");
            // SAFETY: `read_picks` reads these entries only after `landed`, recorded after
            // the copy; the rank thread that reads them also launches the next copy.
            unsafe {
                let (ids_ptr, _g) = ids.device_ptr(&self.stream);
                check(
                    cudarc::driver::result::memcpy_dtoh_async(
                        std::slice::from_raw_parts_mut(host, n),
                        ids_ptr,
                        self.stream.cu_stream(),
                    ),
                    "picks download",
                );
            }
            check(early.landed.record(&self.stream), "event");
            early.len = n;
        }
        let pool = self.pick_slots.clone();
        Box::new(move || {
            check(slot.landed.synchronize(), "picks download");
            let out = {
                let ids = check(slot.ids.as_slice(), "pinned picks");
                let lps = check(slot.logprobs.as_slice(), "pinned picks");
                ids[..n]
                    .iter()
                    .copied()
                    .zip(lps[..n].iter().copied())
                    .collect()
            };
            pool.put(slot);
            out
        })
    }
}

impl CudaBackend {
    /// `Backend::greedy_rows`: `sample_kernel`'s greedy rows into buffers of their own (the
    /// last picks, which the next step's embedding may read, are left alone).
    pub(super) fn greedy_picks(
        &self,
        logits: &CudaSlice<f32>,
        vocab: usize,
        rows: &[usize],
    ) -> Vec<(u32, f32)> {
        let n = rows.len();
        if n == 0 {
            return Vec::new();
        }
        let greedy = crate::sampling::SamplingParams::default();
        debug_assert!(greedy.is_greedy());
        let rows: Vec<PickRow<'_>> = rows
            .iter()
            .map(|&row| PickRow {
                row,
                params: &greedy,
                position: 0,
                verified_row: None,
                draft: None,
                mask: None,
            })
            .collect();
        // Fresh buffers, freed in stream order: not the step's metadata arena, which holds
        // the pass that follows, nor the last picks.
        let meta_d = check(
            self.stream.clone_htod(&sample_meta(&rows, vocab).meta),
            "upload",
        );
        let ids = check(self.stream.alloc_zeros::<u32>(n), "alloc");
        let lps = check(self.stream.alloc_zeros::<f32>(n), "alloc");
        // SAFETY: greedy rows touch no scratch, no verified rows and no masks (null); the
        // outputs hold n entries.
        unsafe {
            self.launch_sample(
                (
                    ids.device_ptr(&self.stream).0,
                    lps.device_ptr(&self.stream).0,
                ),
                logits,
                meta_d.device_ptr(&self.stream).0,
                (0, 0),
                0,
                0,
                vocab,
                n,
            )
        };
        let ids = check(self.stream.clone_dtoh(&ids), "greedy rows");
        let lps = check(self.stream.clone_dtoh(&lps), "greedy rows");
        ids.into_iter().zip(lps).collect()
    }

    /// Ids `first..first + count` of the last picks, waiting for them alone.
    pub(super) fn read_early_picks(&self, first: usize, count: usize) -> Vec<u32> {
        let early = self.early_picks.lock().unwrap_or_else(|e| e.into_inner());
        assert!(
            first + count <= early.len,
            "picks {first}..{} of {} read",
            first + count,
            early.len
        );
        check(early.landed.synchronize(), "read picks");
        check(early.ids.as_slice(), "pinned picks")[first..first + count].to_vec()
    }

    /// `StepGraphs::stage_verified`: the rows' metadata into the arena's `Meta::Verified`
    /// region, for `apply_verified` once the step's metadata is on the device.
    pub(super) fn stage_verified_rows(
        &self,
        rows: &[crate::kernels::StagedVerified<'_>],
        block_size: usize,
    ) -> bool {
        let mut graphs = self.graphs();
        if !graphs.amendable() {
            return false;
        }
        let mut meta = Vec::with_capacity(rows.len() * (super::graph::VERIFIED_META + 8));
        let mut drafts_at = rows.len() * super::graph::VERIFIED_META;
        for r in rows {
            meta.extend_from_slice(&[
                r.token_start as u32,
                r.num_tokens as u32,
                r.verified.first_pick,
                r.verified.drafts.len() as u32,
                r.table_offset as u32,
                drafts_at as u32,
                0,
            ]);
            drafts_at += r.verified.drafts.len();
        }
        for r in rows {
            meta.extend_from_slice(r.verified.drafts);
        }
        graphs.upload(&self.stream, Meta::Verified, &meta);
        graphs.verified = Some((rows.len(), block_size));
        true
    }

    /// `apply_verified_kernel` over the `num_rows` rows staged in the arena's
    /// `Meta::Verified` region, reading the last step's picks.
    pub(super) fn apply_verified(
        &self,
        graphs: &super::graph::Graphs,
        num_rows: usize,
        block_size: usize,
    ) {
        let region = |kind| graphs.region(&self.stream, kind);
        let picks = self.picks.lock().unwrap_or_else(|e| e.into_inner());
        let (n, bs) = (num_rows as i32, block_size as i32);
        // SAFETY: the regions lie in the arena and hold this step's metadata, copied just
        // before on the same stream; the staged rows index only their own tokens, tables
        // and drafts, and picks the step before wrote.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.kernels.apply_verified)
                    .arg(&region(Meta::Positions))
                    .arg(&region(Meta::Slots))
                    .arg(&region(Meta::RowVisible))
                    .arg(&region(Meta::Picked))
                    .arg(&region(Meta::Tables))
                    .arg(&region(Meta::Verified))
                    .arg(&picks.0)
                    .arg(&n)
                    .arg(&bs)
                    .launch(LaunchConfig {
                        grid_dim: (num_rows as u32, 1, 1),
                        block_dim: (32, 1, 1),
                        shared_mem_bytes: 0,
                    })
            },
            "apply_verified",
        );
    }
}
