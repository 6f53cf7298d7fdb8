//! The collective for CUDA ranks: NCCL's all-reduce on the backend's stream (so it orders
//! with the kernels around it and can sit inside a recorded decode graph). Keeps NVLink
//! SHARP off (`NCCL_NVLS_ENABLE=0`): it would create multicast objects the device
//! machines must not have.
//!
//! cudarc's safe `Comm` aborts itself on drop but offers no way to abort it from another
//! thread; here the raw communicator is shared with the group's `GroupAbort`, so the
//! supervisor can cancel a survivor's all-reduce whose peer died, exactly once.

use crate::sync::Mutex;
use crate::sync::Shared as Arc;
use std::mem::MaybeUninit;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtrMut};
use cudarc::nccl::{result, sys};

use super::CudaBackend;
use crate::kernels::collective::{Collective, GroupAbort, GroupError};

/// What one rank needs to join an NCCL group.
pub struct NcclJoin {
    id: sys::ncclUniqueId,
    rank: usize,
    size: usize,
    abort: GroupAbort,
}

// SAFETY: the unique id is 128 plain bytes.
unsafe impl Send for NcclJoin {}

impl NcclJoin {
    /// The joins of a new group of `size` ranks, rank order; their communicators register
    /// with `abort`.
    pub fn group(size: usize, abort: &GroupAbort) -> Result<Vec<NcclJoin>, GroupError> {
        // SAFETY: only tries to dlopen the library.
        if !unsafe { sys::is_culib_present() } {
            return Err(GroupError::Unsupported(
                "libnccl.so.2 was not found: a group of several GPUs needs NCCL on the library path (pip install nvidia-nccl-cu13)",
            ));
        }
        // SAFETY: setting a variable NCCL reads at initialisation, before any group exists
        // in this process.
        unsafe { std::env::set_var("NCCL_NVLS_ENABLE", "0") };
        let id = result::get_uniqueid().map_err(|e| GroupError::Nccl {
            what: "ncclGetUniqueId".into(),
            reason: format!("{e:?}"),
        })?;
        Ok((0..size)
            .map(|rank| NcclJoin {
                id,
                rank,
                size,
                abort: abort.clone(),
            })
            .collect())
    }
}

struct RawComm(sys::ncclComm_t);

// SAFETY: NCCL communicators may be used and aborted from any thread; access is
// serialised by the mutex around it.
unsafe impl Send for RawComm {}

type SharedComm = Arc<Mutex<Option<RawComm>>>;

/// Abort threads still running: a process must not exit under one (NCCL's teardown and
/// the CUDA runtime's would race it).
static ABORTS: Mutex<Vec<std::thread::JoinHandle<()>>> = Mutex::new(Vec::new());

/// Waits up to `limit` for every communicator abort begun so far (they finish once their
/// ranks' graphs are destroyed); whether all finished.
pub fn wait_for_aborts(limit: std::time::Duration) -> bool {
    let deadline = std::time::Instant::now() + limit;
    loop {
        let mut aborts = ABORTS.lock().unwrap_or_else(|e| e.into_inner());
        let (done, running): (Vec<_>, Vec<_>) = aborts.drain(..).partition(|h| h.is_finished());
        *aborts = running;
        drop(aborts);
        for h in done {
            let _ = h.join();
        }
        if ABORTS.lock().unwrap_or_else(|e| e.into_inner()).is_empty() {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// Aborts the communicator on a thread of its own. ncclCommAbort first raises the flag
/// that ends a collective stuck on a dead peer, then waits until every CUDA graph that
/// recorded one of the communicator's collectives is destroyed (NCCL ≥ 2.26) — which the
/// caller, a rank that still holds its decode graphs or the supervisor, cannot wait for.
fn abort(comm: &SharedComm) {
    if let Some(c) = comm.lock().unwrap_or_else(|e| e.into_inner()).take() {
        let spawned = std::thread::Builder::new()
            .name("nccl-abort".into())
            .spawn(move || {
                let c = c;
                // SAFETY: taken out of the option, so aborted exactly once.
                let error = unsafe { result::comm_abort(c.0) }.err();
                tracing::debug!(?error, "NCCL communicator aborted");
            });
        match spawned {
            Ok(h) => ABORTS.lock().unwrap_or_else(|e| e.into_inner()).push(h),
            Err(e) => tracing::warn!("NCCL communicator left unaborted: no thread for it ({e})"),
        }
    }
}

pub struct NcclCollective {
    comm: SharedComm,
    stream: Arc<CudaStream>,
}

impl Drop for NcclCollective {
    fn drop(&mut self) {
        abort(&self.comm);
    }
}

impl Collective<CudaBackend> for NcclCollective {
    fn abort_probe(&self) -> Option<crate::kernels::collective::AbortProbe> {
        let comm = self.comm.clone();
        Some(Arc::new(move || {
            comm.lock().unwrap_or_else(|e| e.into_inner()).is_none()
        }))
    }

    fn all_reduce_sum(&mut self, backend: &CudaBackend, buf: &mut CudaSlice<f32>, len: usize) {
        // A replayed decode step's all-reduces are in its graph, like its kernels. Issued
        // here as well, a replaying rank would run twice as many as a rank that runs the
        // same step eagerly (its graph dropped after a reallocation, say), and the
        // group's collectives would pair up wrongly and wait for each other forever.
        if backend.replaying() {
            return;
        }
        let guard = self.comm.lock().unwrap_or_else(|e| e.into_inner());
        let Some(comm) = guard.as_ref() else {
            panic!("all-reduce: the group was aborted (a rank died)");
        };
        let mut view = buf.slice_mut(..len);
        let (ptr, _record) = view.device_ptr_mut(&self.stream);
        // SAFETY: `len` f32 on this rank's device, in place; ordered on the backend's stream.
        let status = unsafe {
            result::all_reduce(
                ptr as *const _,
                ptr as *mut _,
                len,
                sys::ncclDataType_t::ncclFloat32,
                sys::ncclRedOp_t::ncclSum,
                comm.0,
                self.stream.cu_stream() as _,
            )
        };
        if let Err(e) = status {
            panic!("all-reduce: NCCL failed: {e:?}");
        }
    }
}

impl CudaBackend {
    /// Joins the NCCL group (blocks until every rank has joined).
    pub(super) fn join_nccl(&self, join: NcclJoin) -> Result<NcclCollective, GroupError> {
        self.ctx.bind_to_thread().map_err(|e| GroupError::Nccl {
            what: "binding the CUDA context".into(),
            reason: e.to_string(),
        })?;
        let mut comm = MaybeUninit::uninit();
        // SAFETY: `comm` is written by a successful init and read only then.
        let comm = unsafe {
            result::comm_init_rank(
                comm.as_mut_ptr(),
                join.size as i32,
                join.id,
                join.rank as i32,
            )
            .map_err(|e| GroupError::Nccl {
                what: format!("ncclCommInitRank (rank {} of {})", join.rank, join.size),
                reason: format!("{e:?}"),
            })?;
            comm.assume_init()
        };
        let shared: SharedComm = Arc::new(Mutex::new(Some(RawComm(comm))));
        let hook = shared.clone();
        join.abort.register(Box::new(move || abort(&hook)));
        Ok(NcclCollective {
            comm: shared,
            stream: self.stream.clone(),
        })
    }
}
