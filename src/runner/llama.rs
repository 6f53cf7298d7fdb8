//! A rank running a Llama-family model on a `Backend` (the CPU, or a GPU through CUDA):
//! its shard of the weights, its KV cache and, with `--spec draft`, the draft model beside
//! it; greedy and plain sampled rows are picked where the logits lie.

use ractor::ActorProcessingErr;

use super::draft;
use super::images::RankImages;
use super::launch::StepOutcome;
use super::rank_step::RankStep;
use super::{DeviceModel, KvCopies, LaunchedStep, RankArgs, SlotStates};
use crate::kernels::Backend;
use crate::kernels::collective::{GroupError, GroupJoin};
use crate::model::llama::{LlamaModel, SeqStep};

pub(super) struct OnBackend<B: Backend> {
    /// First: fields drop in order, and the backend must close its device state (an open
    /// graph capture) before the model's and the cache's buffers are freed.
    backend: B,
    model: LlamaModel<B>,
    cache: B::KvCache,
    /// Only the group's leader copies logits to the host for the sampler.
    leader: bool,
    /// `--spec draft`: fills the verify rows' placeholder drafts before each step.
    draft: Option<draft::DraftModel<B>>,
    /// A vision-language model's encoder and its rows by image.
    images: Option<RankImages>,
    num_kv_blocks: usize,
}

impl<B: Backend> Drop for OnBackend<B> {
    fn drop(&mut self) {
        // Leave the group before the backend waits for its stream: a collective whose
        // peer died never finishes, and leaving it aborts it.
        self.model.leave_group();
    }
}

impl<B: Backend> DeviceModel for OnBackend<B> {
    fn step(&mut self, step: &RankStep<'_>) -> LaunchedStep {
        let start = self.backend.timeline_mark();
        let block_size = step.block_size;
        let picked_rows = step.picked_rows();
        let verified = step.verified_rows();
        // The draft model runs every step (its cache follows the model's), and its drafts
        // replace the verify rows' placeholders.
        let mut model_drafts = Vec::new();
        let filled: Vec<Vec<u32>>;
        let prepared = self.images.as_mut().and_then(|im| im.prepare(step));
        let mut steps = step.seqs();
        let media = match &prepared {
            Some(p) => p.apply(&mut steps),
            None => Vec::new(),
        };
        if let Some(draft) = &mut self.draft {
            let num_drafts = step.num_placeholders();
            model_drafts =
                draft.propose(&self.backend, block_size, &steps, &picked_rows, &num_drafts);
            filled = super::fill_placeholders(
                steps.iter().map(|s| s.token_ids),
                &num_drafts,
                &model_drafts,
            );
            for (s, tokens) in steps.iter_mut().zip(&filled) {
                s.token_ids = tokens;
            }
        }
        let moved_back = self.model.forward_on_device(
            &self.backend,
            &mut self.cache,
            block_size,
            &steps,
            &picked_rows,
            &verified,
            &media,
        );
        StepOutcome {
            moved_back,
            backend: &self.backend,
            logits: self.model.device_logits(),
            vocab: self.model.cfg.vocab_size,
            model_drafts,
            moe_balance: None,
            leader: self.leader,
            picks_stay: true,
            aborted: self.model.abort_probe(),
            start,
        }
        .launch(step)
    }
    fn vocab_size(&self) -> usize {
        self.model.cfg.vocab_size
    }
    fn join_group(&mut self, join: GroupJoin) -> Result<(), GroupError> {
        let collective = self.backend.join_group(join)?;
        self.model.set_collective(collective);
        Ok(())
    }
    fn device_label(&self) -> String {
        self.backend.device_name()
    }
    fn weight_footprint(&self) -> crate::model::weights::WeightFootprint {
        self.model.weights.footprint(&self.backend)
    }
    fn kv_copies(&mut self) -> Option<&mut dyn KvCopies> {
        Some(self)
    }
    fn slot_states(&mut self) -> Option<&mut dyn SlotStates> {
        None
    }
    fn device_picks(&self) -> Option<&dyn crate::kernels::DevicePicks> {
        self.backend.device_picks()
    }
    fn warm_up(&mut self, block_size: usize, tokens: usize) -> Result<(), String> {
        // Where steps are recorded as graphs (`decode_curve::record_graphs`, next), a
        // prefill of a step's most tokens sizes the buffers they use first: a later step
        // that grew one would drop them all. Elsewhere nothing is worth a warm-up.
        let tokens = tokens
            .min(self.num_kv_blocks * block_size)
            .min(self.model.cfg.max_context_tokens);
        if self.backend.graphs().is_none() || tokens == 0 {
            return Ok(());
        }
        let (ids, table) = super::warmup_prompt(tokens, self.model.cfg.vocab_size, block_size);
        let step = SeqStep {
            token_ids: &ids,
            num_cached_tokens: 0,
            block_table: &table,
            num_logit_rows: 1,
            state: None,
        };
        // Its logits come back to the host: the step is done when this returns.
        self.model
            .forward(&self.backend, &mut self.cache, block_size, &[step]);
        Ok(())
    }
    fn graph_sizes(&self) -> Option<(&'static [usize], usize)> {
        self.backend
            .graphs()
            .map(|g| (g.token_counts(), g.max_row_tokens()))
    }
    fn verifies_on_device(&self) -> bool {
        // The draft model runs first, at the positions the host knows.
        self.draft.is_none()
    }
}

impl<B: Backend> KvCopies for OnBackend<B> {
    fn kv_blocks(&mut self, blocks: &[u32]) -> Option<Vec<u8>> {
        self.backend.read_kv_blocks(&self.cache, blocks)
    }
    fn set_kv_blocks(&mut self, blocks: &[(u32, &[u8])]) -> bool {
        self.backend.write_kv_blocks(&mut self.cache, blocks)
    }
}

/// The model at `path` (this rank's shard; seeded weights with `--dummy-weights`) and a KV
/// cache of the rank's blocks laid out for it.
fn load_with_cache<B: Backend>(
    path: &std::path::Path,
    backend: &B,
    args: &RankArgs,
) -> Result<(LlamaModel<B>, B::KvCache), ActorProcessingErr> {
    // The engine holds the model's text; the rank loads the weights alone.
    let model =
        crate::model::load_shard_model(path, backend, args.shard, args.settings.dummy_weights)?;
    let shape = model
        .kv_cache_shape(args.settings.num_kv_blocks, args.settings.block_size)
        .with_dtype(args.settings.kv_dtype);
    let cache = backend.alloc_kv_cache(shape);
    Ok((model, cache))
}

pub(super) fn load_on<B: Backend + 'static>(
    backend: B,
    args: &RankArgs,
) -> Result<Box<dyn DeviceModel>, ActorProcessingErr> {
    let (model, cache) = load_with_cache(&args.settings.model_path, &backend, args)?;
    if args.shard.is_leader() {
        let footprint = model.weights.footprint(&backend);
        tracing::info!(
            "model card: {} MB of weights resident per rank ({} MB in the checkpoint): {}",
            footprint.resident_bytes >> 20,
            crate::model::checkpoint_bytes(&args.settings.model_path) >> 20,
            footprint.card()
        );
    }
    let draft = match &args.settings.draft_model_path {
        Some(path) => {
            let (draft_model, draft_cache) = load_with_cache(path, &backend, args)?;
            Some(draft::DraftModel::new(draft_model, draft_cache))
        }
        None => None,
    };
    let images = match &args.settings.images {
        Some(_) if draft.is_some() => {
            return Err(
                "a draft model (`--spec draft`) beside a vision-language model is not built".into(),
            );
        }
        Some(encoder) => Some(RankImages::new(encoder.clone())),
        None => None,
    };
    Ok(Box::new(OnBackend {
        backend,
        model,
        cache,
        leader: args.shard.is_leader(),
        draft,
        images,
        num_kv_blocks: args.settings.num_kv_blocks,
    }))
}
