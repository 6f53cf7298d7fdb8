//! The CUDA backend's stand-in when troupe is built without the `cuda` feature (candle's
//! dummy-backend pattern): the names the engine and the actors use, each refusing by
//! name, so that callers need no `cfg` of their own. Nothing here can be constructed.

use super::NO_CUDA;
use super::collective::{GroupAbort, GroupError};

/// An NCCL group member: none exists without CUDA.
pub enum NcclJoin {}

impl NcclJoin {
    pub fn group(_size: usize, _abort: &GroupAbort) -> Result<Vec<NcclJoin>, GroupError> {
        Err(GroupError::Unsupported(NO_CUDA))
    }
}

/// GPU `ordinal`'s free memory in bytes.
pub fn gpu_free_bytes(_ordinal: usize) -> Result<usize, String> {
    Err(NO_CUDA.into())
}

/// GPU `ordinal`'s PCI address: none without CUDA.
pub fn pci_address(_ordinal: usize) -> Option<String> {
    None
}

pub mod nccl {
    /// No communicator was ever aborted: nothing to wait for.
    pub fn wait_for_aborts(_limit: std::time::Duration) -> bool {
        true
    }
}
