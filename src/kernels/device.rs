//! Which device a rank runs on.

/// Where the rank worker runs the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    /// A GPU by ordinal (needs the `cuda` cargo feature).
    Cuda(usize),
}

#[cfg(not(feature = "cuda"))]
pub(crate) const NO_CUDA: &str = "this troupe was built without the `cuda` feature: rebuild with `cargo build --release --features cuda`";
