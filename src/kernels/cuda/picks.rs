//! Greedy picks made where the logits lie: kept in a fixed device buffer for the next
//! step's embedding (ZOS without a host round trip) and copied to page-locked memory
//! without waiting, for the readback thread.

use std::sync::{Arc, Mutex};

use cudarc::driver::{
    CudaEvent, CudaSlice, DevicePtr, LaunchConfig, PinnedHostSlice, PushKernelArg,
};

use super::graph::Meta;
use super::{CudaBackend, check};

/// Greedy picks one step may make (rows): the device buffer the next step's embedding
/// reads them from has this fixed size, so graphs never see it move.
pub(super) const MAX_PICKS: usize = 1 << 16;

/// Page-locked landing place of one step's picks, back in the pool once read.
pub(super) struct PickSlot {
    ids: PinnedHostSlice<u32>,
    logprobs: PinnedHostSlice<f32>,
    /// Recorded after the copies into this slot.
    landed: CudaEvent,
}

pub(super) type PickPool = Arc<Mutex<Vec<PickSlot>>>;

impl CudaBackend {
    pub(super) fn greedy_picks(
        &self,
        logits: &CudaSlice<f32>,
        vocab: usize,
        rows: &[usize],
    ) -> crate::kernels::Pending<Vec<(u32, f32)>> {
        let n = rows.len();
        if n == 0 {
            return Box::new(Vec::new);
        }
        assert!(
            n <= MAX_PICKS,
            "{n} greedy rows in one step exceed {MAX_PICKS}"
        );
        let rows_u32: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let rows_d = self.upload_u32(Meta::Rows, &rows_u32);
        let mut picks = self.picks.lock().unwrap_or_else(|e| e.into_inner());
        let (ids, logprobs) = &mut *picks;
        let v = vocab as i32;
        let cfg = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: every listed row lies inside `logits`; the outputs hold MAX_PICKS ≥ n.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.kernels.greedy)
                    .arg(&mut *ids)
                    .arg(&mut *logprobs)
                    .arg(logits)
                    .arg(&rows_d.ptr)
                    .arg(&v)
                    .launch(cfg)
            },
            "greedy",
        );
        let slot = self
            .pick_slots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop();
        let mut slot = slot.unwrap_or_else(|| {
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
            pool.lock().unwrap_or_else(|e| e.into_inner()).push(slot);
            out
        })
    }
}
