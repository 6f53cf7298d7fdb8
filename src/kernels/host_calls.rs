//! Host work ordered inside a device step, so a step that needs the CPU mid-layer (the
//! routed experts kept in host memory) can still be recorded and replayed as one graph.
//!
//! A call is two points on the device's stream: at `begin_host_call` the inputs are
//! copied to page-locked staging and the host is told to start; at `end_host_call` the
//! stream waits for the host's answer and copies it in. Work queued between the two (the
//! device's own experts, the shared expert) runs while the host computes. The host side
//! is the thread that launched the step: it answers the calls in `serve_host_calls`, so
//! what it computes with need not be shared with the driver's threads.
//!
//! CUDA runs the two points as one-thread kernels over page-locked flags that the serving
//! thread polls (host functions on the stream measured slower than eager steps: each
//! wakes a thread); a backend without calls has no `host_calls`, and its steps run the
//! host's part inline.

/// The host's answer to one call: `(tag, floats, ids, out)`, the staging as wide as
/// reserved (the caller knows the step's sizes), `out` to be written whole.
pub type HostWork<'a> = dyn FnMut(u32, &[f32], &[u32], &mut [f32]) + 'a;

#[derive(Debug, thiserror::Error)]
pub enum HostCallError {
    #[error("host call: the device did not reach a queued call within {secs} s")]
    NotReached { secs: u64 },
    #[error(
        "host call: the device stopped waiting for the host's answer after {secs} s \
         (expected {expected}, read {seen})"
    )]
    DeviceGaveUp { secs: u64, expected: u32, seen: u32 },
    #[error("host call: the calls' staging holds {held} values, a call needs {asked} ({what})")]
    Unreserved {
        what: &'static str,
        held: usize,
        asked: usize,
    },
}

/// Over a backend's float buffers `Buf` and index buffers `Ids`.
pub trait HostCalls<Buf, Ids> {
    /// Whether a call queued now is recorded into a step (a capture is open): the step's
    /// host part must go through calls then, it cannot run inline.
    fn recording(&self) -> bool;
    /// Sizes the staging for calls of up to `floats`, `ids` and `out` values. Outside a
    /// recording: moving the staging forgets the steps recorded over it.
    fn reserve_host_calls(&self, floats: usize, ids: usize, out: usize);
    /// Queues the copies of `floats[..floats_len]` and `ids[..ids_len]` to the host and
    /// the host's start on call `tag`.
    fn begin_host_call(
        &self,
        tag: u32,
        floats: &Buf,
        floats_len: usize,
        ids: &Ids,
        ids_len: usize,
    ) -> Result<(), HostCallError>;
    /// Queues the wait for the host's answer to the last begun call and its copy into
    /// `out[..out_len]`.
    fn end_host_call(&self, out: &mut Buf, out_len: usize) -> Result<(), HostCallError>;
    /// Answers every call launched so far (by a step run or replayed) with `work`, in the
    /// device's order; returns how many.
    fn serve_host_calls(&self, work: &mut HostWork<'_>) -> Result<usize, HostCallError>;
}
