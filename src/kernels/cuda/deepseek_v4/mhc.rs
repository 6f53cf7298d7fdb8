//! mHC's launchers for DeepSeek-V4: the mix (pre, post, Sinkhorn-projected comb), the
//! merge back into the streams, the hyper-head, and the streams' expand and swap.

use cudarc::driver::{CudaSlice, PushKernelArg};

use super::super::{CudaBackend, check, grid_for, per_row};

impl CudaBackend {
    pub(super) fn launch_mhc_mix(
        &self,
        mixes: &CudaSlice<f32>,
        streams: &CudaSlice<f32>,
        base: &CudaSlice<f32>,
        scale: &CudaSlice<f32>,
        post: &mut CudaSlice<f32>,
        comb: &mut CudaSlice<f32>,
        collapsed: &mut CudaSlice<f32>,
        tokens: usize,
        n: usize,
        hidden: usize,
        iters: usize,
        hc_eps: f32,
    ) {
        let (ni, hi, it) = (n as i32, hidden as i32, iters as i32);
        // SAFETY: mixes [tokens, (2+n)·n], streams [tokens, n, hidden], post [tokens, n],
        // comb [tokens, n, n], collapsed [tokens, hidden]; n ≤ 16 (checked at load).
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.ds().mhc_mix)
                    .arg(mixes)
                    .arg(streams)
                    .arg(base)
                    .arg(scale)
                    .arg(post)
                    .arg(comb)
                    .arg(collapsed)
                    .arg(&ni)
                    .arg(&hi)
                    .arg(&it)
                    .arg(&hc_eps)
                    .launch(per_row(tokens))
            },
            "dsv4_mhc_mix",
        );
    }

    pub(super) fn launch_mhc_merge(
        &self,
        streams: &mut CudaSlice<f32>,
        post: &CudaSlice<f32>,
        comb: &CudaSlice<f32>,
        out: &CudaSlice<f32>,
        tokens: usize,
        n: usize,
        hidden: usize,
    ) {
        let (ni, hi) = (n as i32, hidden as i32);
        // SAFETY: shapes as in dsv4_mhc_mix; out [tokens, hidden].
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.ds().mhc_merge)
                    .arg(streams)
                    .arg(post)
                    .arg(comb)
                    .arg(out)
                    .arg(&ni)
                    .arg(&hi)
                    .launch(per_row(tokens))
            },
            "dsv4_mhc_merge",
        );
    }

    pub(super) fn launch_mhc_head(
        &self,
        mixes: &CudaSlice<f32>,
        streams: &CudaSlice<f32>,
        base: &CudaSlice<f32>,
        scale: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        tokens: usize,
        n: usize,
        hidden: usize,
        hc_eps: f32,
    ) {
        let (ni, hi) = (n as i32, hidden as i32);
        // SAFETY: mixes [tokens, n], streams [tokens, n, hidden], out [tokens, hidden].
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.ds().mhc_head)
                    .arg(mixes)
                    .arg(streams)
                    .arg(base)
                    .arg(scale)
                    .arg(out)
                    .arg(&ni)
                    .arg(&hi)
                    .arg(&hc_eps)
                    .launch(per_row(tokens))
            },
            "dsv4_mhc_head",
        );
    }

    pub(super) fn launch_expand(
        &self,
        streams: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        tokens: usize,
        n: usize,
        hidden: usize,
    ) {
        let (ti, ni, hi) = (tokens as i32, n as i32, hidden as i32);
        // SAFETY: streams [tokens, n, hidden], x [tokens, hidden].
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.ds().expand)
                    .arg(streams)
                    .arg(x)
                    .arg(&ti)
                    .arg(&ni)
                    .arg(&hi)
                    .launch(grid_for(tokens * n * hidden))
            },
            "dsv4_expand",
        );
    }

    /// `x [a, b, width]` → `y [b, a, width]`.
    pub(super) fn launch_swap(
        &self,
        y: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        a: usize,
        b: usize,
        width: usize,
    ) {
        let (ai, bi, wi) = (a as i32, b as i32, width as i32);
        // SAFETY: both hold a·b·width values.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.ds().swap)
                    .arg(y)
                    .arg(x)
                    .arg(&ai)
                    .arg(&bi)
                    .arg(&wi)
                    .launch(grid_for(a * b * width))
            },
            "dsv4_swap",
        );
    }
}
