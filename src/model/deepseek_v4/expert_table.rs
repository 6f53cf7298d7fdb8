//! A layer's routed experts as the backend's grouped kernels take them: one entry per
//! expert id, and the kernels' table of their weights' addresses.

use crate::kernels::cpu::CpuBackend;
use crate::kernels::deepseek_v4::DsV4Kernels;

/// An expert's three matrices (a routed one, or the shared one).
pub struct Expert<B: DsV4Kernels = CpuBackend> {
    pub gate: B::Matrix,
    pub up: B::Matrix,
    pub down: B::Matrix,
}

/// `experts` as the grouped kernels take them, one per expert id: an expert held
/// elsewhere stands in as the first one held here, which the kernels never read for it
/// (the owner table gives its products to another rank).
pub fn matrices<B: DsV4Kernels>(experts: &[Option<Expert<B>>]) -> Vec<[&B::Matrix; 3]> {
    // Every rank of a group holds an expert of every layer (the group size divides the
    // experts); a device may hold none of a layer whose experts all live in host memory
    // (`host_experts.rs` counts that layer's loads itself).
    let Some(stand_in) = experts.iter().flatten().next() else {
        return Vec::new();
    };
    experts
        .iter()
        .map(|e| {
            let e = e.as_ref().unwrap_or(stand_in);
            [&e.gate, &e.up, &e.down]
        })
        .collect()
}

/// The kernels' table of `experts`, or `None` where none is held here.
pub fn expert_table<B: DsV4Kernels>(
    b: &B,
    experts: &[Option<Expert<B>>],
) -> std::result::Result<Option<B::ExpertTable>, crate::kernels::deepseek_v4::DsV4KernelError> {
    let held = matrices(experts);
    if held.is_empty() {
        return Ok(None);
    }
    b.dsv4_expert_table(&held).map(Some)
}
