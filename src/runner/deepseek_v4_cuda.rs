//! A rank running DeepSeek-V4 on one GPU: the host rank's protocol — state slots plus
//! paged compressed entries — with the model's one pass and its cache on the CUDA backend,
//! and the Llama ranks' picks: plain rows picked beside the logits, their tokens read there
//! by the next step's embedding (ZOS with no host round trip).

use super::deepseek_v4::{ds_steps, load_states, save_states};
use super::expert_placement::Balancer;
use super::launch::StepOutcome;
use super::mtp::MtpDrafter;
use super::rank_step::RankStep;
use super::{DeviceModel, KvCopies, LaunchedStep, RankArgs, SlotStates};
use crate::kernels::Backend;
use crate::kernels::collective::{GroupError, GroupJoin};
use crate::kernels::cuda::CudaBackend;
use crate::model::deepseek_v4::cache::{DsV4Cache, SlotSpan};
use crate::model::deepseek_v4::expert_streaming::StreamExperts;
use crate::model::deepseek_v4::mtp::MtpLayer;
use crate::model::deepseek_v4::saved_state::SavedStates;
use crate::model::deepseek_v4::{DsSeqStep, DsV4Model};
use crate::sched::{StateImport, StateLoad, StateSave};

pub(super) struct DsV4OnCuda {
    cache: DsV4Cache<CudaBackend>,
    saved: SavedStates<CudaBackend>,
    eplb: Option<Balancer>,
    expert_tokens: Vec<Vec<u64>>,
    /// `--spec mtp`: the MTP layer on the same GPU, filling the verify rows' drafts.
    mtp: Option<MtpDrafter<CudaBackend>>,
    /// Last: it holds the backend, which the cache's buffers go before.
    model: DsV4Model<CudaBackend>,
}

/// The warm-up prefill's length with routed experts in host memory.
const HOST_EXPERTS_WARMUP_TOKENS: usize = 256;

pub(super) fn load(args: &RankArgs, ordinal: usize) -> Result<Box<dyn DeviceModel>, String> {
    // Decode steps run as recorded graphs (`model::deepseek_v4::recorded`) unless
    // `--enforce-eager`.
    let mut backend = CudaBackend::new(
        ordinal,
        args.settings.batch_invariant,
        !args.settings.enforce_eager,
    )
    .map_err(|e| e.to_string())?;
    // Decode steps with host experts recorded, their host part as calls on the stream;
    // `TROUPE_HOST_CALLS=0` runs them eagerly, to measure what the recording buys.
    backend.host_calls_in_steps = std::env::var("TROUPE_HOST_CALLS").as_deref() != Ok("0");
    // Everything but the routed experts first, then the cache: the experts take the room
    // left, those that do not fit (or that the flags send) stay in host memory.
    let cfg = crate::model::deepseek_v4::config::DsV4Config::from_dir(&args.settings.model_path)
        .map_err(|e| e.to_string())?;
    let mut model = DsV4Model::load_dir_holding(
        backend,
        &args.settings.model_path,
        args.settings.dummy_weights,
        &|_, _| false,
    )
    .map_err(|e| e.to_string())?;
    let cache = model.new_cache(
        args.settings.num_state_slots,
        args.settings.num_kv_blocks,
        args.settings.block_size,
    );
    let saved = SavedStates::on(&model.backend, &cache, args.settings.num_saved_states);
    place_experts(&mut model, args, &cfg, ordinal)?;
    let mtp = if args.settings.mtp {
        let dir = (!args.settings.dummy_weights).then_some(args.settings.model_path.as_path());
        let layer = MtpLayer::load_into(&model.cfg, dir, &model.backend)
            .map_err(|e| format!("--spec mtp: {e}"))?;
        Some(MtpDrafter::new(
            layer,
            &model,
            args.settings.num_state_slots,
        ))
    } else {
        None
    };
    let (layers, experts) = (model.cfg.num_layers, model.cfg.num_routed_experts);
    let eplb = Balancer::for_model(args, layers, experts)?;
    Ok(Box::new(DsV4OnCuda {
        model,
        cache,
        saved,
        eplb,
        expert_tokens: vec![vec![0; experts]; layers],
        mtp,
    }))
}

/// The routed experts into the room the rest of the model and the cache left on the GPU
/// (the placement: the flags', or the automatic split); the others kept in host memory.
fn place_experts(
    model: &mut DsV4Model<CudaBackend>,
    args: &RankArgs,
    cfg: &crate::model::deepseek_v4::config::DsV4Config,
    ordinal: usize,
) -> Result<(), String> {
    model.backend.synchronize();
    let free = crate::kernels::cuda::gpu_free_bytes(ordinal)?;
    let room = free.saturating_sub(super::expert_placement::DEVICE_MARGIN_BYTES);
    let placement = super::expert_placement::placement(args, cfg, Some(room))?;
    model
        .reside(
            &args.settings.model_path,
            args.settings.dummy_weights,
            &|l, e| !placement.on_host(l, e),
        )
        .map_err(|e| e.to_string())?;
    crate::runner::trim_heap();
    if args.settings.stream_experts != StreamExperts::Never {
        super::expert_placement::pin_friendly_heap();
    }
    model
        .keep_experts_on_host(
            &args.settings.model_path,
            args.settings.dummy_weights,
            placement,
            (args.settings.batch_invariant, args.settings.stream_experts),
        )
        .map_err(|e| e.to_string())?;
    Ok(())
}

impl DeviceModel for DsV4OnCuda {
    fn step(&mut self, step: &RankStep<'_>) -> LaunchedStep {
        let start = self.model.backend.timeline_mark();
        // Its rows never move back (a model with state slots has its verify rows' sequences
        // sit out rather than continued).
        debug_assert!(
            step.rows
                .iter()
                .all(|r| r.seq.num_cached_tokens == r.row.plan.num_cached_tokens)
        );
        let steps = &step.seqs();
        let mut ds = ds_steps(steps);
        let num_drafts = step.num_placeholders();
        let model_drafts = match &mut self.mtp {
            Some(mtp) => mtp.propose(&self.model, &ds, &num_drafts),
            None => Vec::new(),
        };
        let filled =
            super::fill_placeholders(ds.iter().map(|s| s.token_ids), &num_drafts, &model_drafts);
        for (s, tokens) in ds.iter_mut().zip(&filled) {
            s.token_ids = tokens;
        }
        // Counted only for EPLB: reading the counts waits for the step.
        let counted = self.eplb.is_some().then(|| {
            self.expert_tokens.iter_mut().for_each(|l| l.fill(0));
            &mut self.expert_tokens[..]
        });
        // A refused step is a planning bug: the worker fails and the engine recomputes.
        let (logits, streams) = self
            .model
            .forward_on_device(&mut self.cache, &ds, &step.picked_rows(), counted, None)
            .unwrap_or_else(|e| panic!("DeepSeek-V4 step refused: {e}"));
        if let Some(mtp) = &mut self.mtp {
            mtp.absorb(&self.model, &ds, &num_drafts, &streams);
        }
        let moe_balance = self
            .eplb
            .as_mut()
            .map(|balancer| balancer.step(&mut self.model, &self.expert_tokens, steps));
        StepOutcome {
            moved_back: Vec::new(),
            backend: &self.model.backend,
            logits: &logits,
            vocab: self.model.vocab_size(),
            model_drafts,
            moe_balance,
            leader: true,
            // The MTP layer drafts from the host's copy of each row's token.
            picks_stay: self.mtp.is_none(),
            aborted: None,
            start,
        }
        .launch(step)
    }

    fn warm_up(&mut self, block_size: usize, tokens: usize) -> Result<(), String> {
        let mut tokens = tokens.min(self.cache.num_blocks * block_size);
        if self.model.expert_placement().is_some() {
            // Host experts prefill on the CPU: a short warm-up loads the kernels all the same
            // and shows the CPU's rate (`expert_streaming`) at the cost of one layer's products.
            tokens = tokens.min(HOST_EXPERTS_WARMUP_TOKENS);
        }
        if tokens == 0 || self.cache.num_slots() == 0 {
            return Ok(());
        }
        let (ids, table) = super::warmup_prompt(tokens, self.model.vocab_size(), block_size);
        // Slot 0 restarts when its first sequence arrives (its cached count is its start).
        let step = DsSeqStep {
            token_ids: &ids,
            num_cached_tokens: 0,
            block_table: &table,
            state_slot: 0,
            span: SlotSpan::default(),
            num_logit_rows: 1,
        };
        self.model
            .forward_on_device(&mut self.cache, &[step], &[], None, None)
            .map_err(|e| format!("the warm-up prefill of {tokens} tokens: {e}"))?;
        self.model.backend.synchronize();
        Ok(())
    }

    fn weight_footprint(&self) -> crate::model::weights::WeightFootprint {
        self.model.footprint()
    }

    fn graph_sizes(&self) -> Option<(&'static [usize], usize)> {
        // Its decode steps are recorded as they first come (`model::deepseek_v4::recorded`),
        // not ahead of the first request.
        None
    }

    fn verifies_on_device(&self) -> bool {
        false
    }

    fn kv_copies(&mut self) -> Option<&mut dyn KvCopies> {
        // Its cache's layouts are not yet copied to a prefix store on the GPU (issue 65).
        None
    }

    fn slot_states(&mut self) -> Option<&mut dyn SlotStates> {
        Some(self)
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
            crate::kernels::Backend::device_name(&self.model.backend)
        )
    }

    fn device_picks(&self) -> Option<&dyn crate::kernels::DevicePicks> {
        crate::kernels::Backend::device_picks(&self.model.backend)
    }
}

/// Saved states move between slots on the GPU; they do not go to a prefix store yet
/// (issue 65), so a store keeps none of them and imports none.
impl SlotStates for DsV4OnCuda {
    fn load_states(&mut self, loads: &[StateLoad]) -> bool {
        let b = &self.model.backend;
        load_states(b, &self.saved, &mut self.cache, self.mtp.as_mut(), loads)
    }

    fn save_states(&mut self, saves: &[StateSave]) -> bool {
        save_states(&self.model.backend, &mut self.saved, &self.cache, saves)
    }

    fn saved_state(&mut self, _saved: u32) -> Option<Vec<u8>> {
        None
    }

    fn import_states(&mut self, imports: &[StateImport]) -> bool {
        imports.is_empty()
    }
}
