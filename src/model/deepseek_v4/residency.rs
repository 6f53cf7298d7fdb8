//! Which routed experts a rank holds. A rank of an expert-parallel group loads only its
//! share of the checkpoint; when EPLB's placement changes, each rank reads the experts it
//! gains from the checkpoint (memory-mapped: the host copy) and drops those it lost,
//! between two steps; a group that shrinks starts its ranks over on their new shares.

use super::config::DsV4Config;
use super::weights::{DsV4Weights, EitherNaming, Expert, Holds, LinearStore, NoTensors, Reader};
use crate::error::Result;
use crate::kernels::deepseek_v4::DsV4Kernels;
use crate::model::loader::TensorSource;

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

/// A reader of `named` (`None`: `dummy_into`'s values) holding `holds`' experts.
fn reader<'a, S: LinearStore>(
    cfg: &DsV4Config,
    named: Option<&'a EitherNaming<'a>>,
    store: &'a S,
    holds: &'a Holds<'a>,
) -> Reader<'a, S> {
    Reader {
        src: named.map_or(&NoTensors as &dyn TensorSource, |s| s),
        dummy_experts: named.is_none().then_some(cfg.num_routed_experts),
        store,
        holds,
    }
}

impl<B: DsV4Kernels> DsV4Weights<B> {
    /// `load_into` (`src`; `None`: `dummy_into`'s values) with only the routed experts
    /// `holds` names: an expert-parallel rank's share.
    pub fn load_holding<S: LinearStore<Backend = B>>(
        cfg: &DsV4Config,
        src: Option<&dyn TensorSource>,
        store: &S,
        holds: &Holds<'_>,
    ) -> Result<Self> {
        let named = src.map(EitherNaming);
        let r = reader(cfg, named.as_ref(), store, holds);
        Self::read(cfg, r)
    }

    /// Makes this rank hold exactly the routed experts `holds` names: those it lacks
    /// read from `src` (`None`: `dummy_into`'s values), those it no longer computes
    /// dropped. Returns how many it read.
    pub fn reside<S: LinearStore<Backend = B>>(
        &mut self,
        cfg: &DsV4Config,
        src: Option<&dyn TensorSource>,
        store: &S,
        holds: &Holds<'_>,
    ) -> Result<usize> {
        let named = src.map(EitherNaming);
        let r = reader(cfg, named.as_ref(), store, holds);
        let mut num_read = 0;
        for (l, layer) in self.layers.iter_mut().enumerate() {
            let moe = &mut layer.moe;
            let mut changed = false;
            for (e, slot) in moe.experts.iter_mut().enumerate() {
                match (holds(l, e), slot.is_some()) {
                    (true, false) => {
                        *slot = Some(r.expert(&format!("model.layers.{l}.ffn.experts.{e}"), cfg)?);
                        num_read += 1;
                    }
                    (false, true) => *slot = None,
                    _ => continue,
                }
                changed = true;
            }
            if changed {
                moe.table = expert_table(store.backend(), &moe.experts).map_err(|e| {
                    crate::error::TroupeError::InvalidInput(format!("layer {l} experts: {e}"))
                })?;
            }
        }
        Ok(num_read)
    }
}
