//! The collective that sums the ranks' partial outputs: in-process channels for CPU
//! ranks (`channels`), NCCL for CUDA ranks (`kernels::cuda::nccl`); and the group's abort,
//! which cancels them when a rank dies.

pub mod channels;

use crate::sync::{Arc, Mutex};

use crate::kernels::Backend;

pub use channels::ChannelCollective;

/// Why a rank could not join (or a group could not be formed).
#[derive(Debug, thiserror::Error)]
pub enum GroupError {
    /// A rank offered the other kind of group (CPU ranks use channels, CUDA ranks NCCL).
    #[error("a {rank} rank joins its group through {expected}, not {offered}")]
    WrongKind {
        rank: &'static str,
        expected: &'static str,
        offered: &'static str,
    },
    /// NCCL (or the CUDA driver beneath it) refused, with what was being done.
    #[error("{what}: {reason}")]
    Nccl { what: String, reason: String },
    /// This build or model cannot run in a group.
    #[error("{0}")]
    Unsupported(&'static str),
}

/// How a rank joins its group: the backend turns it into its `Collective`.
pub enum GroupJoin {
    /// CPU ranks: in-process channels.
    Channels(ChannelCollective),
    /// CUDA ranks: an NCCL communicator from the id the supervisor made for the group.
    Nccl(crate::kernels::cuda::NcclJoin),
}

/// Cancels a group's collectives from outside (the supervisor, when a rank died), so the
/// survivors' pending collectives fail instead of waiting for the dead rank forever.
#[derive(Clone, Default)]
pub struct GroupAbort {
    hooks: Arc<Mutex<Vec<AbortHook>>>,
}

/// One rank's way to cancel its collectives.
pub type AbortHook = Box<dyn FnMut() + Send>;

impl GroupAbort {
    /// `hook` runs at `abort` (it must tolerate running after its rank left the group).
    pub fn register(&self, hook: AbortHook) {
        self.hooks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(hook);
    }

    pub fn abort(&self) {
        for hook in self
            .hooks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter_mut()
        {
            hook();
        }
    }
}

/// Sums the ranks' partial results so that every rank holds the same total. Called by
/// every rank of the group in the same order; blocking until the group has joined (or
/// enqueued on the device stream, for a device collective).
pub trait Collective<B: Backend>: Send {
    /// The first `len` elements of `buf` become their sum over the group, bitwise the
    /// same on every rank. Panics when a peer is gone: the rank then fails and its
    /// supervisor rebuilds the group.
    fn all_reduce_sum(&mut self, backend: &B, buf: &mut B::Buf, len: usize);

    /// Whether the group's collectives were aborted, for a thread that waits on a step
    /// after it was launched. `None`: an abort cannot go unnoticed (a collective that
    /// fails by itself, as the in-process channels do).
    fn abort_probe(&self) -> Option<AbortProbe>;
}

/// Says whether a group's collectives were aborted. A recorded decode step holds its
/// collectives inside one graph launch: aborted, they end without reducing and the step
/// finishes with wrong numbers that nothing else reports.
pub type AbortProbe = crate::sync::Shared<dyn Fn() -> bool + Send + Sync>;
