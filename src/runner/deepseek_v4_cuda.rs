//! A rank running DeepSeek-V4 on one GPU (`model::deepseek_v4::cuda`): the host rank's
//! protocol — state slots plus paged compressed entries, every logit row to the sampler —
//! with the pass and the cache on the device.

use super::deepseek_v4::{ds_steps, eplb_for, eplb_step, launched};
use super::{DeviceModel, LaunchedStep, RankArgs};
use crate::eplb::Eplb;
use crate::kernels::collective::{GroupError, GroupJoin};
use crate::kernels::cuda::CudaBackend;
use crate::model::deepseek_v4::cuda::DsV4Cuda;
use crate::model::deepseek_v4::cuda::cache::DeviceCache;
use crate::model::llama::SeqStep;
use crate::step::StepRow;

pub(super) struct DsV4OnCuda {
    model: DsV4Cuda,
    cache: DeviceCache,
    eplb: Option<Eplb>,
    expert_tokens: Vec<Vec<u64>>,
    /// Last: the device buffers above are freed before it goes.
    backend: CudaBackend,
}

pub(super) fn load(args: &RankArgs, ordinal: usize) -> Result<Box<dyn DeviceModel>, String> {
    // Graphs would need the routing without a read-back: every step runs eagerly.
    let backend =
        CudaBackend::new(ordinal, args.batch_invariant, false).map_err(|e| e.to_string())?;
    let model = DsV4Cuda::load_dir(&backend, &args.model_path, args.dummy_weights)
        .map_err(|e| e.to_string())?;
    let cache = DeviceCache::new(
        &backend,
        &model.cfg,
        args.num_state_slots,
        args.num_kv_blocks,
        args.block_size,
    );
    let (layers, experts) = (model.cfg.num_layers, model.cfg.num_routed_experts);
    let eplb = eplb_for(args, layers, experts)?;
    Ok(Box::new(DsV4OnCuda {
        backend,
        model,
        cache,
        eplb,
        expert_tokens: vec![vec![0; experts]; layers],
    }))
}

impl DeviceModel for DsV4OnCuda {
    fn step(
        &mut self,
        _block_size: usize,
        steps: &[SeqStep<'_>],
        _picked_rows: &[u32],
        rows: &[StepRow],
    ) -> LaunchedStep {
        let ds = ds_steps(steps);
        self.expert_tokens.iter_mut().for_each(|l| l.fill(0));
        // A refused step is a planning bug: the worker fails and the engine recomputes.
        let logits = self
            .model
            .forward(&self.backend, &mut self.cache, &ds, &mut self.expert_tokens)
            .unwrap_or_else(|e| panic!("DeepSeek-V4 step refused: {e}"));
        let moe_balance = self
            .eplb
            .as_mut()
            .map(|eplb| eplb_step(eplb, &self.expert_tokens, steps));
        launched(
            &logits,
            self.model.vocab_size(),
            steps,
            rows,
            Vec::new(),
            moe_balance,
        )
    }

    fn vocab_size(&self) -> usize {
        self.model.vocab_size()
    }

    fn join_group(&mut self, _join: GroupJoin) -> Result<(), GroupError> {
        Err(GroupError::Unsupported(
            "DeepSeek-V4 on CUDA runs on one GPU",
        ))
    }

    fn device_label(&self) -> String {
        format!(
            "{} (DeepSeek-V4)",
            crate::kernels::Backend::device_name(&self.backend)
        )
    }
}
