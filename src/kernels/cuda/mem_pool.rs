//! The device's default memory pool, kept as a cache of freed memory between steps (as
//! PyTorch's allocator keeps it) and emptied before a step is captured into a graph.

use crate::sync::Shared as Arc;
use cudarc::driver::CudaContext;

use super::CudaError;

/// What the default pool keeps but nothing uses, back to the driver, once the stream's
/// frees have landed: a step about to be captured takes its buffers from the graphs' own
/// pool, which cannot reuse memory the default pool holds (a prefill's peak, kept by
/// `keep_freed_memory`). Best effort: a failure only leaves the memory kept.
pub fn release_kept_memory(stream: &cudarc::driver::CudaStream) {
    use cudarc::driver::sys;
    let ctx = stream.context();
    if !ctx.has_async_alloc() || stream.synchronize().is_err() {
        return;
    }
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: the pool handle is written by the driver for the context's device.
    let trimmed = unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
            .result()
            .and_then(|()| sys::cuMemPoolTrimTo(pool, 0).result())
    };
    if let Err(e) = trimmed {
        tracing::warn!("the device's memory pool kept its free memory: {e}");
    }
}

/// Stream-ordered allocations come from the device's default pool, whose release threshold
/// is 0: every synchronize hands freed memory back to the driver, so each step (a prefill's
/// activations most of all) maps its scratch afresh. Keeping it makes the pool a cache, as
/// PyTorch's allocator is.
pub fn keep_freed_memory(ctx: &Arc<CudaContext>) -> Result<(), CudaError> {
    use cudarc::driver::sys;
    if !ctx.has_async_alloc() {
        return Ok(());
    }
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut threshold = u64::MAX;
    // SAFETY: the pool handle is written by the driver for a device the context holds; the
    // attribute takes a u64 by pointer.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
            .result()
            .and_then(|()| {
                sys::cuMemPoolSetAttribute(
                    pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    (&mut threshold as *mut u64).cast(),
                )
                .result()
            })
    }
    .map_err(|e| CudaError::Unavailable(format!("the device's memory pool: {e}")))
}
