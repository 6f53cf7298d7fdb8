//! Launches of recorded steps that hold host calls (`host_calls.rs`), from a thread of
//! their own. A graph's launch returns once the driver has queued its nodes, and a long
//! graph fills the stream's queue: the launch then waits for the device to take nodes off
//! it. A step's device waits on the host's answer to a call, which the launching thread
//! would give only after its launch returned: the whole V4-Flash shape at batch 32
//! (25 host layers) stalled so on an H100 until the device's waits gave up, where six
//! layers, or one row, fit the queue. Launched from here, the rank thread serves the calls
//! while the launch is still queueing the step's later layers.

use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, bounded, unbounded};
use cudarc::driver::sys::{CUgraphExec, CUstream};
use cudarc::driver::{CudaContext, CudaStream, DriverError};

use crate::sync::Shared as Arc;

struct Job {
    exec: usize,
    stream: usize,
    done: Sender<Result<(), DriverError>>,
}

pub(super) struct GraphLauncher {
    jobs: Sender<Job>,
}

/// A launch under way: `join` it before anything else is queued on the stream.
pub(super) struct InFlight(Receiver<Result<(), DriverError>>);

impl GraphLauncher {
    pub fn spawn(ctx: Arc<CudaContext>) -> std::io::Result<Self> {
        let (jobs, queued) = unbounded::<Job>();
        std::thread::Builder::new()
            .name("troupe-graph-launch".into())
            .spawn(move || {
                let bound = ctx.bind_to_thread();
                for job in queued {
                    let r = bound.and_then(|()| {
                        // SAFETY: the caller keeps the instance and the stream alive until
                        // it joined the launch (`InFlight::join`).
                        unsafe {
                            cudarc::driver::sys::cuGraphLaunch(
                                job.exec as CUgraphExec,
                                job.stream as CUstream,
                            )
                        }
                        .result()
                    });
                    // A caller that left no longer waits: nothing to tell.
                    let _ = job.done.send(r);
                }
            })?;
        Ok(GraphLauncher { jobs })
    }

    /// Queues the launch of `exec` on `stream`.
    ///
    /// # Safety
    /// `exec` is a live graph instance of `stream`'s context; both outlive the returned
    /// launch's `join`, and nothing is queued on `stream` before it.
    pub unsafe fn launch(&self, exec: CUgraphExec, stream: &CudaStream) -> InFlight {
        let (done, result) = bounded(1);
        let job = Job {
            exec: exec as usize,
            stream: stream.cu_stream() as usize,
            done,
        };
        if let Err(e) = self.jobs.send(job) {
            // The thread is gone: launch here, as before.
            let job = e.into_inner();
            // SAFETY: the caller's.
            let r =
                unsafe { cudarc::driver::sys::cuGraphLaunch(exec, stream.cu_stream()) }.result();
            let _ = job.done.send(r);
        }
        InFlight(result)
    }
}

impl InFlight {
    /// Waits for the launch to return, at most `limit`: the device has then queued the
    /// whole step.
    pub fn join(self, limit: Duration) -> Result<(), String> {
        match self.0.recv_timeout(limit) {
            Ok(r) => r.map_err(|e| format!("graph launch: {e}")),
            Err(RecvTimeoutError::Timeout) => Err(format!(
                "graph launch did not return within {} s",
                limit.as_secs()
            )),
            Err(RecvTimeoutError::Disconnected) => Err("graph launch thread died".into()),
        }
    }
}
