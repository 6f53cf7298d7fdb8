//! Which routed experts a rank holds. A rank of an expert-parallel group loads only its
//! share of the checkpoint; when EPLB's placement changes, each rank reads the experts it
//! gains from the checkpoint (memory-mapped: the host copy) and drops those it lost,
//! between two steps; a group that shrinks starts its ranks over on their new shares.
//! On one device, the experts it cannot hold live in host memory (`host_experts.rs`) and
//! move between the two the same way.

use std::path::Path;

use super::DsV4Model;
use super::config::DsV4Config;
use super::expert_placement::ExpertPlacement;
use super::expert_streaming::StreamExperts;
use super::host_experts::HostExperts;
use super::weights::{DsV4Weights, EitherNaming, Holds, LinearStore, NoTensors, Reader};
use crate::error::Result;
use crate::kernels::deepseek_v4::DsV4Kernels;
use crate::model::loader::{SafetensorsSource, TensorSource};

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
                moe.table = super::expert_table::expert_table(store.backend(), &moe.experts)
                    .map_err(|e| {
                        crate::error::TroupeError::InvalidInput(format!("layer {l} experts: {e}"))
                    })?;
            }
        }
        Ok(num_read)
    }
}

impl<B: DsV4Kernels> DsV4Model<B> {
    /// Keeps the routed experts `placement` puts in host memory there, read from `dir`'s
    /// checkpoint (`dummy`: made), computed by the CPU beside this backend from now on. The
    /// backend must hold none of them (loaded with `holds` excluding them).
    pub fn keep_experts_on_host(
        &mut self,
        dir: &Path,
        dummy: bool,
        placement: ExpertPlacement,
        (batch_invariant, stream): (bool, StreamExperts),
    ) -> Result<()> {
        if !placement.any_on_host() {
            self.host = None;
            return Ok(());
        }
        let src = (!dummy)
            .then(|| SafetensorsSource::open_dir(dir))
            .transpose()?;
        let src = src.as_ref().map(|s| s as &dyn TensorSource);
        let host = HostExperts::load(
            &self.cfg,
            src,
            placement,
            &self.backend,
            (batch_invariant, stream),
        )?;
        self.host = Some(host);
        Ok(())
    }

    /// Moves routed experts between the device and host memory to `placement` (the same
    /// number on each side a layer: `ExpertPlacement::following`), between two steps: each
    /// side reads the experts it gains from `dir`'s checkpoint (`dummy`: made) and drops
    /// those it lost. Returns how many moved.
    pub fn move_experts(
        &mut self,
        dir: &Path,
        dummy: bool,
        placement: ExpertPlacement,
    ) -> Result<usize> {
        let Some(old) = self.expert_placement() else {
            return Ok(0);
        };
        let moved = old.num_moved(&placement);
        if moved == 0 {
            return Ok(0);
        }
        // Recorded steps point at the expert and owner tables rebuilt below.
        if let Some(recorder) = self.backend.recorder() {
            recorder.forget_recorded();
        }
        self.reside(dir, dummy, &|l, e| !placement.on_host(l, e))?;
        let src = (!dummy)
            .then(|| SafetensorsSource::open_dir(dir))
            .transpose()?;
        let src = src.as_ref().map(|s| s as &dyn TensorSource);
        let host = self
            .host
            .as_mut()
            .expect("a placement comes from host experts");
        host.reside(&self.cfg, src, placement, &self.backend)?;
        Ok(moved)
    }

    /// Where the routed experts are, when some are in host memory.
    pub fn expert_placement(&self) -> Option<&ExpertPlacement> {
        self.host.as_ref().map(|h| &h.placement)
    }
}
