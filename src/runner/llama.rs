//! A rank running a Llama-family model on a `Backend` (the CPU, or a GPU through CUDA):
//! its shard of the weights, its KV cache and, with `--spec draft`, the draft model beside
//! it; greedy and plain sampled rows are picked where the logits lie.

use ractor::ActorProcessingErr;

use super::draft;
use super::{DeviceModel, LaunchedStep, PrevToken, RankArgs};
use crate::kernels::collective::{GroupError, GroupJoin};
use crate::kernels::{Backend, PickRow};
use crate::model::llama::{LlamaModel, SeqStep};
use crate::step::{StepLogits, StepRow};

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
}

impl<B: Backend> Drop for OnBackend<B> {
    fn drop(&mut self) {
        // Leave the group before the backend waits for its stream: a collective whose
        // peer died never finishes, and leaving it aborts it.
        self.model.leave_group();
    }
}

impl<B: Backend> DeviceModel for OnBackend<B> {
    fn step(
        &mut self,
        block_size: usize,
        steps: &[SeqStep<'_>],
        picked_rows: &[u32],
        rows: &[StepRow],
    ) -> LaunchedStep {
        let start = self.backend.timeline_mark();
        // The draft model runs every step (its cache follows the model's), and its drafts
        // replace the verify rows' placeholders.
        let mut model_drafts = Vec::new();
        let filled: Vec<Vec<u32>>;
        let mut with_drafts: Vec<SeqStep<'_>>;
        let steps = match &mut self.draft {
            Some(draft) => {
                let num_drafts = super::num_placeholders(rows);
                model_drafts =
                    draft.propose(&self.backend, block_size, steps, picked_rows, &num_drafts);
                filled = super::fill_placeholders(
                    steps.iter().map(|s| s.token_ids),
                    &num_drafts,
                    &model_drafts,
                );
                with_drafts = steps.to_vec();
                for (s, tokens) in with_drafts.iter_mut().zip(&filled) {
                    s.token_ids = tokens;
                }
                &with_drafts[..]
            }
            None => steps,
        };
        self.model.forward_on_device(
            &self.backend,
            &mut self.cache,
            block_size,
            steps,
            picked_rows,
        );
        let vocab = self.model.cfg.vocab_size;
        let logits = self.model.device_logits();
        // Rows without processors are picked where the logits lie: greedy ones always,
        // sampled ones where the backend samples (its copy of their logits saved). A row
        // verifying drafts has a logit row per draft and one more, all sent to the host.
        let sample_here = self.backend.capabilities().samples_on_device;
        let (mut picked, mut host) = (Vec::new(), Vec::new());
        let mut host_first = vec![None; rows.len()];
        let mut pick_rows = Vec::new();
        // Rows verifying greedily on the device: (plan row, its first logit row, count).
        let mut verifying = Vec::new();
        let mut logit_row = 0;
        for (row, (s, step)) in rows
            .iter()
            .map(|r| r.sampling.as_ref())
            .zip(steps)
            .enumerate()
        {
            match s {
                Some(s) if s.is_plain() && (sample_here || s.params.is_greedy()) => {
                    picked.push(row);
                    pick_rows.push(PickRow {
                        row: logit_row,
                        params: &s.params,
                        position: s.position,
                    });
                }
                Some(s) if s.verifies_on_device() => {
                    verifying.push((row, logit_row, step.num_logit_rows));
                }
                Some(_) => {
                    host_first[row] = Some(host.len());
                    host.extend(logit_row..logit_row + step.num_logit_rows);
                }
                None => {}
            }
            logit_row += step.num_logit_rows;
        }
        // The plain rows' picks first: their indices are what the next step's embedding
        // reads on the device.
        for &(row, first, count) in &verifying {
            let s = rows[row]
                .sampling
                .as_ref()
                .expect("a verifying row samples");
            pick_rows.extend((0..count).map(|i| PickRow {
                row: first + i,
                params: &s.params,
                position: s.position + i as u64,
            }));
        }
        let num_rows = rows.len();
        let mut out = StepLogits {
            moe_balance: None,
            picked: vec![None; num_rows],
            verify_picks: vec![None; num_rows],
            host_row: host_first,
            host: Vec::new(),
            model_drafts: model_drafts
                .into_iter()
                .map(|d| (!d.is_empty()).then_some(d))
                .collect(),
        };
        // The host rows' copy waits for the step; the picks' copy is left in flight.
        let picks = self.backend.pick_rows(logits, vocab, &pick_rows);
        if !host.is_empty() && self.leader {
            out.host = self.backend.download_rows(logits, vocab, &host);
        }
        let plain_rows = picked.clone();
        let aborted = self.model.abort_probe();
        let deliver = move |mut out: StepLogits, all: Vec<(u32, f32)>| {
            // The step is done on the device: if the group was aborted meanwhile, its
            // all-reduces ended without reducing (the readback thread reports the panic).
            if aborted.as_ref().is_some_and(|a| a()) {
                panic!(
                    "the step finished after its group's collectives were aborted: its results are void"
                );
            }
            let (plain, mut rest) = all.split_at(picked.len());
            for (&row, &pick) in picked.iter().zip(plain) {
                out.picked[row] = Some(pick);
            }
            for &(row, _, count) in &verifying {
                out.verify_picks[row] = Some(rest[..count].to_vec());
                rest = &rest[count..];
            }
            out
        };
        let span = start.zip(self.backend.timeline_mark());
        let mut prev = vec![None; num_rows];
        if self.backend.capabilities().picks_stay_on_device {
            for (i, &row) in plain_rows.iter().enumerate() {
                prev[row] = Some(PrevToken::Device(i as u32));
            }
            return LaunchedStep {
                logits: Box::new(move || deliver(out, picks())),
                span,
                prev,
            };
        }
        let all = picks();
        for (&row, pick) in plain_rows.iter().zip(&all) {
            prev[row] = Some(PrevToken::Host(pick.0));
        }
        let out = deliver(out, all);
        LaunchedStep {
            logits: Box::new(move || out),
            span,
            prev,
        }
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
    fn weight_footprint(&self) -> Option<crate::model::weights::WeightFootprint> {
        Some(self.model.weights.footprint(&self.backend))
    }
}

/// The model at `path` (this rank's shard; seeded weights with `--dummy-weights`) and a KV
/// cache of the rank's blocks laid out for it.
fn load_with_cache<B: Backend>(
    path: &std::path::Path,
    backend: &B,
    args: &RankArgs,
) -> Result<(LlamaModel<B>, B::KvCache), ActorProcessingErr> {
    let loaded = if args.dummy_weights {
        crate::model::load_dummy_shard(path, backend, args.shard)?
    } else {
        crate::model::load_shard(path, backend, args.shard)?
    };
    let shape = loaded
        .model
        .kv_cache_shape(args.num_kv_blocks, args.block_size);
    let cache = backend.alloc_kv_cache(shape);
    Ok((loaded.model, cache))
}

pub(super) fn load_on<B: Backend + 'static>(
    backend: B,
    args: &RankArgs,
) -> Result<Box<dyn DeviceModel>, ActorProcessingErr> {
    let (model, cache) = load_with_cache(&args.model_path, &backend, args)?;
    if args.shard.is_leader() {
        let footprint = model.weights.footprint(&backend);
        tracing::info!(
            "model card: {} MB of weights resident per rank ({} MB in the checkpoint): {}",
            footprint.resident_bytes >> 20,
            crate::model::checkpoint_bytes(&args.model_path) >> 20,
            footprint.card()
        );
    }
    let draft = match &args.draft_model_path {
        Some(path) => {
            let (draft_model, draft_cache) = load_with_cache(path, &backend, args)?;
            Some(draft::DraftModel::new(draft_model, draft_cache))
        }
        None => None,
    };
    Ok(Box::new(OnBackend {
        backend,
        model,
        cache,
        leader: args.shard.is_leader(),
        draft,
    }))
}
