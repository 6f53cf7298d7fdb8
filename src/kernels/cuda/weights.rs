//! Weight matrices on the GPU: bf16, uploaded as the checkpoint stores them (or converted
//! once on the host), or made on the device for `--dummy-weights`.

use cudarc::driver::{CudaSlice, PushKernelArg};
use half::bf16;

use super::{CudaBackend, check, grid_for};
use crate::kernels::{HostData, HostMatrix};

pub struct CudaMatrix {
    pub rows: usize,
    pub cols: usize,
    pub w: CudaSlice<bf16>,
}

impl CudaBackend {
    pub(super) fn upload_weights(&self, m: HostMatrix) -> CudaMatrix {
        let (rows, cols) = (m.rows, m.cols);
        if let HostData::Random {
            seed,
            mean,
            half_width,
        } = m.data
        {
            let n = rows * cols;
            let mut w = check(self.stream.alloc_zeros::<bf16>(n.max(1)), "weights");
            let n64 = n as i64;
            // SAFETY: w holds n elements.
            check(
                unsafe {
                    self.stream
                        .launch_builder(&self.kernels.random_bf16)
                        .arg(&mut w)
                        .arg(&n64)
                        .arg(&seed)
                        .arg(&mean)
                        .arg(&half_width)
                        .launch(grid_for(n))
                },
                "random weights",
            );
            return CudaMatrix { rows, cols, w };
        }
        let host: Vec<bf16> = match m.data {
            HostData::Bf16(v) => v,
            other => other
                .into_f32(rows * cols)
                .into_iter()
                .map(bf16::from_f32)
                .collect(),
        };
        CudaMatrix {
            rows,
            cols,
            w: check(self.stream.clone_htod(&host), "weight upload"),
        }
    }
}
