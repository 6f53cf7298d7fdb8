//! Whole steps recorded as CUDA graphs (`StepRecorder`): the caller keeps every input at
//! fixed addresses and keys a step by what shapes its launches, and a replay is one graph
//! launch with no host code of the step run at all. Buffers the step allocates and frees
//! become the graph's own memory nodes (cudarc allocates stream-ordered), at addresses the
//! graph keeps from launch to launch.
//!
//! A key's first step runs eagerly: kernels are built, cuBLAS picks its algorithms and
//! the backend's grow-on-demand buffers reach their size then, none of which may happen
//! inside a capture. The second is captured, later ones replay.

use std::collections::{HashMap, HashSet};

use cudarc::driver::CudaStream;
use cudarc::driver::sys::{CUgraphExec, CUstreamCaptureMode};

use super::recorded::Recorded;
use super::{CudaBackend, check};

#[derive(Default)]
pub struct CapturedSteps {
    /// Each key's graph and the host calls (`host_calls.rs`) it holds.
    recorded: HashMap<u64, (Recorded, usize)>,
    warmed: HashSet<u64>,
    /// The key being captured, while a capture is open.
    capturing: Option<u64>,
    /// Steps run by a replay (the step recorded included).
    pub replays: u64,
    /// Host calls queued into the capture open.
    pub host_calls: usize,
}

/// What to do with a step of some key.
pub enum Next {
    Eager,
    Capture,
    Replay,
}

impl CapturedSteps {
    pub fn next(&mut self, key: u64) -> Next {
        if self.recorded.contains_key(&key) {
            Next::Replay
        } else if self.warmed.insert(key) {
            Next::Eager
        } else {
            Next::Capture
        }
    }

    pub fn begin_capture(&mut self, stream: &CudaStream, key: u64) {
        check(
            stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
            "begin capture",
        );
        self.capturing = Some(key);
        self.host_calls = 0;
    }

    pub fn capturing(&self) -> bool {
        self.capturing.is_some()
    }

    /// Ends the capture and keeps the graph, with full dependencies: the driver refuses
    /// programmatic edges (CUDA_ERROR_NOT_SUPPORTED, seen on the H200) in a graph that
    /// holds the step's allocations as memory nodes.
    pub fn end_capture(&mut self, stream: &CudaStream) {
        let key = self.capturing.take().expect("a capture is open");
        let graph = check(Recorded::end_capture(stream, None), "end capture");
        tracing::debug!(key, "recorded a whole step as a CUDA graph");
        self.recorded
            .insert(key, (graph, std::mem::take(&mut self.host_calls)));
    }

    /// Launches `key`'s graph here when it holds no host calls; else returns its
    /// instance and how many calls it makes, for a launch from another thread.
    pub fn replay(&mut self, stream: &CudaStream, key: u64) -> Option<(CUgraphExec, usize)> {
        self.replays += 1;
        let (graph, host_calls) = &self.recorded[&key];
        if *host_calls == 0 {
            check(graph.launch(stream), "graph launch");
            return None;
        }
        Some((graph.exec(), *host_calls))
    }

    /// A buffer the recorded steps use moved: every key starts over.
    pub fn forget(&mut self) {
        assert!(
            self.capturing.is_none(),
            "a buffer was reallocated while a step was being captured"
        );
        self.recorded.clear();
        self.warmed.clear();
    }

    /// Ends a capture a panic left open (see `Graphs::abandon_capture`).
    pub fn abandon_capture(&mut self, stream: &CudaStream) {
        if self.capturing.take().is_some() {
            Recorded::abandon_capture(stream);
        }
    }
}

impl crate::kernels::StepRecorder for CudaBackend {
    fn run_recorded(&self, key: u64, body: &mut dyn FnMut()) {
        // A launch a serve left behind (a panic between) is done before anything else.
        self.join_graph_launch();
        // The lock is not held while `body` runs: its ops may grow buffers (`moved`).
        let next = self.captured().next(key);
        let replay = |captured: &mut CapturedSteps| {
            let Some((exec, calls)) = captured.replay(&self.stream, key) else {
                return;
            };
            // The rank thread serves the calls while the launch queues the step: a
            // launch can wait on the device, which waits on the calls.
            let launcher = self.graph_launcher.get_or_init(|| {
                check(
                    super::graph_launcher::GraphLauncher::spawn(self.ctx.clone())
                        .map_err(|e| e.to_string()),
                    "graph launch thread",
                )
            });
            // SAFETY: the instance is the captured map's and the stream the backend's;
            // `join_graph_launch` runs before either can go (`forget`, a drop) and
            // before anything else is queued (the serve, the next step).
            let launch = unsafe { launcher.launch(exec, &self.stream) };
            let mut state = self.host_calls.lock().unwrap_or_else(|e| e.into_inner());
            state.launched(calls, launch);
        };
        match next {
            Next::Replay => replay(&mut self.captured()),
            Next::Eager => body(),
            Next::Capture => {
                super::mem_pool::release_kept_memory(&self.stream);
                self.captured().begin_capture(&self.stream, key);
                body();
                let mut captured = self.captured();
                captured.end_capture(&self.stream);
                replay(&mut captured);
            }
        }
        // The bf16 copy the host last recorded is not what a recorded step left there.
        *self.twin.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    fn forget_recorded(&self) {
        self.join_graph_launch();
        self.captured().forget();
    }
}
