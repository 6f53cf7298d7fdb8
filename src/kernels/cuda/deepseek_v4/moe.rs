//! MoE's launchers for DeepSeek-V4: routing (torch's top-k), the clipped SwiGLU, and the
//! combine of each token's experts.

use cudarc::driver::{CudaSlice, PushKernelArg};

use super::super::{CudaBackend, check, grid_for, per_row};
use crate::kernels::deepseek_v4::Scoring;

impl CudaBackend {
    /// Router scores → each token's `k` experts and weights.
    pub(super) fn launch_moe_route(
        &self,
        chosen: &mut CudaSlice<u32>,
        weights: &mut CudaSlice<f32>,
        logits: &CudaSlice<f32>,
        token_ids: &CudaSlice<u32>,
        tid2eid: Option<&CudaSlice<u32>>,
        bias: Option<&CudaSlice<f32>>,
        scoring: Scoring,
        tokens: usize,
        num_experts: usize,
        k: usize,
        scaling: f32,
    ) {
        let (ei, ki) = (num_experts as i32, k as i32);
        // deepseek_v4.cu's codes.
        let scoring: i32 = match scoring {
            Scoring::SqrtSoftplus => 0,
            Scoring::Sigmoid => 1,
            Scoring::Softmax => 2,
        };
        let null = 0u64;
        let mut launch = self.stream.launch_builder(&self.ds().moe_route);
        launch.arg(chosen).arg(weights).arg(logits).arg(token_ids);
        match tid2eid {
            Some(t) => launch.arg(t),
            None => launch.arg(&null),
        };
        match bias {
            Some(b) => launch.arg(b),
            None => launch.arg(&null),
        };
        launch.arg(&scoring).arg(&ei).arg(&ki).arg(&scaling);
        // SAFETY: logits [tokens, num_experts ≤ 1024], chosen and weights [tokens, k ≤ 32],
        // token ids inside the table (checked by the model).
        check(unsafe { launch.launch(per_row(tokens)) }, "dsv4_moe_route");
    }

    pub(super) fn launch_swiglu(
        &self,
        h: &mut CudaSlice<f32>,
        gate: &CudaSlice<f32>,
        up: &CudaSlice<f32>,
        n: usize,
        limit: f32,
    ) {
        let n64 = n as i64;
        // SAFETY: all three hold n values.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.ds().swiglu)
                    .arg(h)
                    .arg(gate)
                    .arg(up)
                    .arg(&n64)
                    .arg(&limit)
                    .launch(grid_for(n))
            },
            "dsv4_swiglu",
        );
    }

    pub(super) fn launch_moe_combine(
        &self,
        out: &mut CudaSlice<f32>,
        ys: &CudaSlice<f32>,
        order: &CudaSlice<u32>,
        weights: &CudaSlice<f32>,
        tokens: usize,
        k: usize,
        hidden: usize,
    ) {
        let (ki, hi) = (k as i32, hidden as i32);
        // SAFETY: out [tokens, hidden]; order [tokens, k, 2] indexes rows of ys and slots
        // of weights [tokens, k].
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.ds().moe_combine)
                    .arg(out)
                    .arg(ys)
                    .arg(order)
                    .arg(weights)
                    .arg(&ki)
                    .arg(&hi)
                    .launch(per_row(tokens))
            },
            "dsv4_moe_combine",
        );
    }
}
