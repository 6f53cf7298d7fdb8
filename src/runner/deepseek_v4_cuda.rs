//! A rank running DeepSeek-V4 on one GPU: the host rank's protocol — state slots plus
//! paged compressed entries — with the model's one pass and its cache on the CUDA backend,
//! and the Llama ranks' picks: plain rows picked beside the logits, their tokens read there
//! by the next step's embedding (ZOS with no host round trip).

use super::deepseek_v4::{ds_steps, eplb_for, eplb_step, load_states, save_states};
use super::inputs::StepInputs;
use super::launch::StepOutcome;
use super::mtp::MtpDrafter;
use super::{DeviceModel, LaunchedStep, RankArgs};
use crate::eplb::Eplb;
use crate::kernels::Backend;
use crate::kernels::collective::{GroupError, GroupJoin};
use crate::kernels::cuda::CudaBackend;
use crate::model::deepseek_v4::cache::{DsV4Cache, SlotSpan};
use crate::model::deepseek_v4::expert_streaming::StreamExperts;
use crate::model::deepseek_v4::mtp::MtpLayer;
use crate::model::deepseek_v4::saved_state::SavedStates;
use crate::model::deepseek_v4::{DsSeqStep, DsV4Model};
use crate::model::llama::SeqStep;
use crate::sched::{StateLoad, StateSave};
use crate::step::StepRow;

pub(super) struct DsV4OnCuda {
    cache: DsV4Cache<CudaBackend>,
    saved: SavedStates<CudaBackend>,
    eplb: Option<Eplb>,
    expert_tokens: Vec<Vec<u64>>,
    /// `--spec mtp`: the MTP layer on the same GPU, filling the verify rows' drafts.
    mtp: Option<MtpDrafter<CudaBackend>>,
    /// Routed experts moved between the GPU and host memory as EPLB's loads moved.
    num_moved_experts: u64,
    rebalances_followed: u64,
    /// Where the rank reads the experts it moves.
    model_path: std::path::PathBuf,
    dummy_weights: bool,
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
    {
        model.backend.synchronize();
        let free = crate::kernels::cuda::gpu_free_bytes(ordinal)?;
        let room = free.saturating_sub(super::expert_placement::DEVICE_MARGIN_BYTES);
        let placement = super::expert_placement::placement(args, &cfg, Some(room))?;
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
    }
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
    let eplb = eplb_for(args, layers, experts)?;
    Ok(Box::new(DsV4OnCuda {
        model,
        cache,
        saved,
        eplb,
        expert_tokens: vec![vec![0; experts]; layers],
        mtp,
        num_moved_experts: 0,
        rebalances_followed: 0,
        model_path: args.settings.model_path.clone(),
        dummy_weights: args.settings.dummy_weights,
    }))
}

impl DeviceModel for DsV4OnCuda {
    fn step(
        &mut self,
        _block_size: usize,
        steps: &[SeqStep<'_>],
        inputs: &StepInputs,
        rows: &[StepRow],
    ) -> LaunchedStep {
        let start = self.model.backend.timeline_mark();
        // Its rows never move back (a model with state slots has its verify rows' sequences
        // sit out rather than continued).
        debug_assert!(
            steps
                .iter()
                .zip(rows)
                .all(|(s, r)| s.num_cached_tokens == r.plan.num_cached_tokens)
        );
        let mut ds = ds_steps(steps);
        let num_drafts = super::num_placeholders(rows);
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
            .forward_on_device(&mut self.cache, &ds, inputs.picked_rows(), counted, None)
            .unwrap_or_else(|e| panic!("DeepSeek-V4 step refused: {e}"));
        if let Some(mtp) = &mut self.mtp {
            mtp.absorb(&self.model, &ds, &num_drafts, &streams);
        }
        let moe_balance = self.eplb.as_mut().map(|eplb| {
            let mut balance = eplb_step(eplb, &self.expert_tokens, steps);
            self.num_moved_experts += super::expert_placement::follow_loads(
                &mut self.model,
                eplb,
                &mut self.rebalances_followed,
                &self.model_path,
                self.dummy_weights,
            ) as u64;
            balance.num_moved_experts = self.num_moved_experts;
            balance
        });
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
            inputs,
        }
        .launch(steps, rows)
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

    fn weight_footprint(&self) -> Option<crate::model::weights::WeightFootprint> {
        Some(self.model.footprint())
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

    fn load_states(&mut self, loads: &[StateLoad]) -> bool {
        let b = &self.model.backend;
        load_states(b, &self.saved, &mut self.cache, self.mtp.as_mut(), loads)
    }

    fn save_states(&mut self, saves: &[StateSave]) -> bool {
        save_states(&self.model.backend, &mut self.saved, &self.cache, saves)
    }

    fn read_picks(&mut self, first: u32, count: usize) -> Vec<u32> {
        crate::kernels::Backend::read_picks(&self.model.backend, first as usize, count)
    }
}
