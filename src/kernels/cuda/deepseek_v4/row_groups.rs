//! DeepSeek-V4's grouped output projection (`wo_a`) on CUDA: one stacked bf16 matrix of
//! equal row blocks, each projecting its group's rows, so that one launch covers them all.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

use super::super::weights::Store;
use super::super::{CudaBackend, CudaMatrix};
use crate::kernels::deepseek_v4::{GroupedShape, grouped_projection_by_swaps};

/// DeepSeek-V4's grouped output projection (`wo_a`) as one bf16 matrix of `parts` equal
/// row blocks: one launch covers every block (`dsv4_gemm_row_groups`).
pub struct CudaRowGroups {
    stacked: [CudaMatrix; 1],
    parts: usize,
}

impl AsRef<[CudaMatrix]> for CudaRowGroups {
    fn as_ref(&self) -> &[CudaMatrix] {
        &self.stacked
    }
}

impl CudaRowGroups {
    /// `m`'s rows in `parts` equal blocks, kept as one bf16 matrix.
    pub(super) fn new(b: &CudaBackend, m: CudaMatrix, parts: usize) -> Self {
        let CudaMatrix { rows, cols, store } = m;
        let all = match store {
            Store::Bf16(w) => w,
            store => b.bf16_copy(&CudaMatrix { rows, cols, store }),
        };
        CudaRowGroups {
            stacked: [CudaMatrix {
                rows,
                cols,
                store: Store::Bf16(all),
            }],
            parts,
        }
    }

    /// `DsV4Kernels::dsv4_gemm_row_groups`.
    pub(super) fn gemm(
        &self,
        b: &CudaBackend,
        x: &CudaSlice<f32>,
        rows: usize,
        out: &mut CudaSlice<f32>,
    ) {
        let [m] = &self.stacked;
        let Store::Bf16(all) = &m.store else {
            unreachable!("row groups are kept in bf16 (CudaRowGroups::new)")
        };
        let (parts, n, k) = (self.parts, m.rows / self.parts, m.cols);
        assert!(
            parts * rows * k <= x.len() && parts * rows * n <= out.len(),
            "dsv4_gemm_row_groups outside its buffers"
        );
        let x_ptr = x.device_ptr(&b.stream).0;
        let w_ptr = all.device_ptr(&b.stream).0;
        let out_ptr = out.device_ptr_mut(&b.stream).0;
        // SAFETY: the assert bounds x and out; all holds parts·n·k bf16 values.
        unsafe { b.gemm_row_groups_bf16(x_ptr, rows, parts, n, k, w_ptr, out_ptr) };
    }

    /// `DsV4Kernels::dsv4_grouped_projection`: past the GEMV's batch sizes, one batched
    /// GEMM on the step's interleaved layout; below them (and in the invariant mode, whose
    /// kernels take the groups' blocks), the swaps around `gemm`.
    pub(super) fn grouped_projection(
        &self,
        b: &CudaBackend,
        x: &CudaSlice<f32>,
        shape: GroupedShape,
        out: &mut CudaSlice<f32>,
    ) {
        let [m] = &self.stacked;
        let Store::Bf16(all) = &m.store else {
            unreachable!("row groups are kept in bf16 (CudaRowGroups::new)")
        };
        let GroupedShape {
            rows,
            groups,
            cols,
            n,
        } = shape;
        let direct = !b.batch_invariant && b.kernels.gemv_groups_for(rows).is_none();
        if !direct || groups != self.parts || n * groups != m.rows || cols != m.cols {
            grouped_projection_by_swaps(b, x, self, shape, out);
            return;
        }
        assert!(
            rows * groups * cols <= x.len() && rows * groups * n <= out.len(),
            "dsv4_grouped_projection outside its buffers"
        );
        let x_ptr = x.device_ptr(&b.stream).0;
        let w_ptr = all.device_ptr(&b.stream).0;
        let out_ptr = out.device_ptr_mut(&b.stream).0;
        // SAFETY: the assert bounds x and out; all holds groups·n·cols bf16 values.
        unsafe { b.gemm_bf16_groups(x_ptr, (rows, n, cols), (groups, true), w_ptr, out_ptr) };
    }
}
