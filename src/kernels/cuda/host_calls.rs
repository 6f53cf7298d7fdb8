//! `HostCalls` on CUDA: each call's two points are one-thread kernels on the backend's
//! stream (`kernels-cuda/host_flags.cu`, recorded like any kernel) that raise and wait on
//! flags in page-locked host memory, with page-locked staging for the copies around them
//! at fixed addresses. The launching thread polls the flags: the device and the host meet
//! through memory, with no host function or thread wake-up between them (each costs tens
//! of microseconds in a virtual machine, a layer's host part about a millisecond).

use std::time::{Duration, Instant};

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, PinnedHostSlice, PushKernelArg};

use super::graph_launcher::InFlight;
use super::{CudaBackend, check};
use crate::kernels::host_calls::{HostCallError, HostCalls, HostWork};
use crate::sync::HostFlags;
use crate::sync::atomic::{AtomicU32, Ordering};

/// How long the host waits for a queued call to start: a step's host part takes
/// milliseconds, so this only ends a serve stuck by a fault.
const REACH_SECS: u64 = 120;

/// The flags' words: the device raises `STARTED` to a call's tag + 1 when its inputs
/// have landed; the host raises `ANSWERED` to the same when its rows are written.
const STARTED: usize = 0;
const ANSWERED: usize = 1;
/// Where a wait that gave up writes what it expected and what it read.
const REPORT: usize = 2;
const REPORT_SEEN: usize = 3;
/// How long the device waits for an answer before it gives up on the step (and says so):
/// far beyond any layer's host part, short of a stuck CI job.
const GIVE_UP_SECS: u64 = 30;

/// Page-locked staging of the calls, one set for all: a call's copies out are queued
/// after the previous call's copy in, on the one stream.
struct Staging {
    floats: Pinned<f32>,
    ids: Pinned<u32>,
    out: Pinned<f32>,
}

/// A page-locked region and its address, read once at allocation: cudarc's accessors
/// synchronize an event, which a capture forbids.
struct Pinned<T> {
    _region: PinnedHostSlice<T>,
    ptr: *mut T,
    len: usize,
}

// SAFETY: the region is plain host memory the backend owns; who writes it when is the
// calls' order (the stream's copies, then the serving thread, then the stream's).
unsafe impl<T> Send for Pinned<T> {}

impl<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits> Pinned<T> {
    fn new(b: &CudaBackend, len: usize) -> Self {
        // SAFETY: entries are read only after a copy or the host wrote them.
        let mut region = check(
            unsafe {
                b.ctx.alloc_pinned_with_flags::<T>(
                    len.max(1),
                    cudarc::driver::sys::CU_MEMHOSTALLOC_DEVICEMAP,
                )
            },
            "host call staging",
        );
        let ptr = check(region.as_mut_ptr(), "host call staging");
        Pinned {
            _region: region,
            ptr,
            len,
        }
    }

    /// The region's address in the device's address space.
    fn on_device(&self) -> u64 {
        let mut dptr = 0;
        // SAFETY: `ptr` is a mapped page-locked allocation of this context.
        let r = unsafe {
            cudarc::driver::sys::cuMemHostGetDevicePointer_v2(&mut dptr, self.ptr.cast(), 0)
        };
        check(r.result(), "host call flags");
        dptr
    }
}

#[derive(Default)]
pub(super) struct HostCallState {
    staging: Option<Staging>,
    /// `[STARTED, ANSWERED, REPORT, REPORT_SEEN]` on the host, and their address on
    /// the device.
    flags: Option<(Pinned<u32>, u64)>,
    /// Calls launched eagerly or by replays and not yet served.
    pending: usize,
    /// The call `end_host_call` ends.
    open: Option<u32>,
    /// The launch of the step whose calls are pending.
    launch: Option<InFlight>,
}

impl HostCallState {
    /// Calls a replay launched from the launch thread.
    pub(super) fn launched(&mut self, calls: usize, launch: InFlight) {
        self.pending += calls;
        self.launch = Some(launch);
    }
}

/// The flag word `at` as the host reads and writes it.
fn flag(flags: *mut u32, at: usize) -> &'static AtomicU32 {
    // SAFETY: `flags` holds the four words, aligned, for the backend's life; the device
    // writes them only through the flag kernels, which order with the host's writes by
    // the protocol (each side writes a word only after seeing the other's).
    unsafe { AtomicU32::from_ptr(flags.add(at)) }
}

impl CudaBackend {
    /// Waits for the launch of a step with host calls to return (see
    /// `graph_launcher.rs`): after its calls are served, or given up on, it returns as soon
    /// as the device has queued the step's rest.
    pub(super) fn join_graph_launch(&self) {
        let launch = self.host_calls_state().launch.take();
        if let Some(launch) = launch {
            check(launch.join(Duration::from_secs(REACH_SECS)), "step launch");
        }
    }

    fn host_calls_state(&self) -> crate::sync::MutexGuard<'_, HostCallState> {
        self.host_calls.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `kernel` on word `at` of the flags at `flags` (on the device) with `value`; a wait
    /// also gets the report words and its time limit.
    fn launch_flag(
        &self,
        kernel: &cudarc::driver::CudaFunction,
        (flags, at): (u64, usize),
        value: u32,
        wait: bool,
    ) {
        let one = cudarc::driver::LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        let word = flags + (at * 4) as u64;
        let report = flags + (REPORT * 4) as u64;
        let limit_ns = GIVE_UP_SECS * 1_000_000_000;
        let mut launch = self.stream.launch_builder(kernel);
        launch.arg(&word).arg(&value);
        if wait {
            launch.arg(&report).arg(&limit_ns);
        }
        // SAFETY: `word` and `report` are mapped flag words the backend keeps for its life.
        check(unsafe { launch.launch(one) }, "host call flag");
    }

    /// Queues `src[..len]` to page-locked `dst`.
    ///
    /// # Safety
    /// `dst` holds `len` values and nothing reads them before the copy ran.
    unsafe fn copy_out<T>(&self, src: &CudaSlice<T>, dst: *mut T, len: usize) {
        let (src, _g) = src.device_ptr(&self.stream);
        // SAFETY: the caller's.
        let dst = unsafe { std::slice::from_raw_parts_mut(dst, len) };
        check(
            // SAFETY: `src` holds at least `len` values (the caller's slice is as long).
            unsafe { cudarc::driver::result::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) },
            "host call copy out",
        );
    }
}

fn unreserved(what: &'static str, held: usize, asked: usize) -> Result<(), HostCallError> {
    if asked > held {
        return Err(HostCallError::Unreserved { what, held, asked });
    }
    Ok(())
}

impl HostCalls<CudaSlice<f32>, CudaSlice<u32>> for CudaBackend {
    fn recording(&self) -> bool {
        self.captured().capturing()
    }

    fn reserve_host_calls(&self, floats: usize, ids: usize, out: usize) {
        let fits = self
            .host_calls_state()
            .staging
            .as_ref()
            .is_some_and(|s| s.floats.len >= floats && s.ids.len >= ids && s.out.len >= out);
        if fits {
            return;
        }
        assert!(
            !self.recording(),
            "host call staging grown inside a capture"
        );
        // Queued copies may still read the old staging.
        self.synchronize();
        let staging = Staging {
            floats: Pinned::new(self, floats),
            ids: Pinned::new(self, ids),
            out: Pinned::new(self, out),
        };
        let mut state = self.host_calls_state();
        state.staging = Some(staging);
        if state.flags.is_none() {
            // Four words: the two flags and a giving-up wait's report.
            let flags = Pinned::<u32>::new(self, 4);
            for at in [STARTED, ANSWERED, REPORT, REPORT_SEEN] {
                flag(flags.ptr, at).store(0, Ordering::Release);
            }
            let on_device = flags.on_device();
            state.flags = Some((flags, on_device));
        }
        drop(state);
        self.captured().forget();
    }

    fn begin_host_call(
        &self,
        tag: u32,
        floats: &CudaSlice<f32>,
        floats_len: usize,
        ids: &CudaSlice<u32>,
        ids_len: usize,
    ) -> Result<(), HostCallError> {
        let mut state = self.host_calls_state();
        let (held_floats, held_ids) = state
            .staging
            .as_ref()
            .map_or((0, 0), |s| (s.floats.len, s.ids.len));
        unreserved("floats", held_floats, floats_len)?;
        unreserved("ids", held_ids, ids_len)?;
        let staging = state.staging.as_ref().expect("checked above");
        let (host_floats, host_ids) = (staging.floats.ptr, staging.ids.ptr);
        let flags = state.flags.as_ref().expect("reserved with the staging").1;
        // SAFETY: the staging holds the lengths (checked); the host reads it only after
        // the started flag, which the stream raises after these copies.
        unsafe {
            self.copy_out(floats, host_floats, floats_len);
            self.copy_out(ids, host_ids, ids_len);
        }
        state.open = Some(tag);
        drop(state);
        let raise = &self.kernels.host_flag_raise;
        self.launch_flag(raise, (flags, STARTED), tag + 1, false);
        let mut captured = self.captured();
        if captured.capturing() {
            captured.host_calls += 1;
        } else {
            self.host_calls_state().pending += 1;
        }
        Ok(())
    }

    fn end_host_call(&self, out: &mut CudaSlice<f32>, out_len: usize) -> Result<(), HostCallError> {
        let mut state = self.host_calls_state();
        let held = state.staging.as_ref().map_or(0, |s| s.out.len);
        unreserved("out", held, out_len)?;
        let tag = state
            .open
            .take()
            .expect("end_host_call follows begin_host_call");
        let host_out = state.staging.as_ref().expect("checked above").out.ptr;
        let flags = state.flags.as_ref().expect("reserved with the staging").1;
        drop(state);
        let wait = &self.kernels.host_flag_wait;
        self.launch_flag(wait, (flags, ANSWERED), tag + 1, true);
        // SAFETY: the host wrote `out_len` entries before answering, which the wait
        // kernel waits for; the next call's host work starts after this copy, on the one
        // stream.
        unsafe {
            let (dst, _g) = out.device_ptr_mut(&self.stream);
            check(
                cudarc::driver::result::memcpy_htod_async(
                    dst,
                    std::slice::from_raw_parts(host_out, out_len),
                    self.stream.cu_stream(),
                ),
                "host call copy in",
            );
        }
        Ok(())
    }

    fn serve_host_calls(&self, work: &mut HostWork<'_>) -> Result<usize, HostCallError> {
        let served = self.serve_pending(work);
        // Served or given up on: the launch returns once the device queued the rest.
        self.join_graph_launch();
        served
    }
}

impl CudaBackend {
    fn serve_pending(&self, work: &mut HostWork<'_>) -> Result<usize, HostCallError> {
        let (pending, staging, flags) = {
            let mut state = self.host_calls_state();
            let pending = std::mem::take(&mut state.pending);
            let staging = state.staging.as_ref().map(|s| {
                (
                    (s.floats.ptr, s.floats.len),
                    (s.ids.ptr, s.ids.len),
                    (s.out.ptr, s.out.len),
                )
            });
            (pending, staging, state.flags.as_ref().map(|f| f.0.ptr))
        };
        let (Some(((floats, nf), (ids, ni), (out, no))), Some(flags)) = (staging, flags) else {
            return Ok(0);
        };
        let words = HostFlags {
            started: flag(flags, STARTED),
            answered: flag(flags, ANSWERED),
        };
        // Whatever happens below, the device's waits go on: a stream never waits on a
        // host thread that left.
        let mut guard = Unanswered {
            words: &words,
            left: pending,
        };
        let expected = flag(flags, REPORT).load(Ordering::Acquire);
        if expected != 0 {
            return Err(HostCallError::DeviceGaveUp {
                secs: GIVE_UP_SECS,
                expected,
                seen: flag(flags, REPORT_SEEN).load(Ordering::Acquire),
            });
        }
        for served in 0..pending {
            let since = Instant::now();
            let mut warned = false;
            let tag = loop {
                if let Some(tag) = words.take_started() {
                    break tag;
                }
                let waited = since.elapsed();
                if waited > Duration::from_secs(REACH_SECS) {
                    return Err(HostCallError::NotReached { secs: REACH_SECS });
                }
                if !warned && waited > Duration::from_secs(5) {
                    tracing::warn!(
                        "host calls: call {served} of {pending} not started after 5 s (answered word {})",
                        words.answered.load(Ordering::Acquire)
                    );
                    warned = true;
                }
                std::hint::spin_loop();
            };
            tracing::trace!(tag, served, pending, "host call started");
            // SAFETY: the started flag is raised after this call's copies out landed;
            // the copy in waits for the answer below; the staging outlives both (it moves
            // only after a synchronize, outside a step).
            unsafe {
                work(
                    tag,
                    std::slice::from_raw_parts(floats, nf),
                    std::slice::from_raw_parts(ids, ni),
                    std::slice::from_raw_parts_mut(out, no),
                );
            }
            guard.left -= 1;
            words.answer(tag);
        }
        Ok(pending)
    }
}

/// Gives up on the calls a serve left, so the device's waits pass.
struct Unanswered<'a> {
    words: &'a HostFlags<'static>,
    left: usize,
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if self.left > 0 {
            self.words.abandon();
        }
    }
}
