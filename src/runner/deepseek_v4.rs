//! A rank running DeepSeek-V4 on the host (the f32 reference pass): its cache is state
//! slots plus paged compressed entries, and every logit row goes to the sampler. In a
//! group of several ranks it is one rank of an expert-parallel group
//! (`model::deepseek_v4::expert_parallel`).

use super::expert_placement::Balancer;
use super::mtp::MtpDrafter;
use super::rank_step::RankStep;
use super::{DeviceModel, KvCopies, LaunchedStep, RankArgs, SlotStates};
use crate::eplb::{Eplb, MoeBalance};
use crate::kernels::Backend;
use crate::kernels::collective::{GroupError, GroupJoin};
use crate::kernels::cpu::CpuBackend;
use crate::kernels::deepseek_v4::DsV4Kernels;
use crate::model::deepseek_v4::cache::{CacheFormats, DsV4Cache, SlotSpan};
use crate::model::deepseek_v4::config::DsV4Config;
use crate::model::deepseek_v4::expert_parallel::{ExpertGroup, ExpertShard};
use crate::model::deepseek_v4::expert_streaming::StreamExperts;
use crate::model::deepseek_v4::mtp::MtpLayer;
use crate::model::deepseek_v4::saved_state::{SavedStates, load_bytes};
use crate::model::deepseek_v4::{DsSeqStep, DsV4Model};
use crate::model::llama::SeqStep;
use crate::model::tensor_parallel::TpShard;
use crate::sched::{StateImport, StateLoad, StateSave};
use crate::step::StepLogits;

pub(super) struct DsV4OnHost {
    model: DsV4Model,
    cache: DsV4Cache,
    saved: SavedStates,
    eplb: Option<Balancer>,
    /// Tokens per (layer, routed expert) of the current step.
    expert_tokens: Vec<Vec<u64>>,
    shard: TpShard,
    /// Set by `join_group` when the group has more than one rank.
    group: Option<ExpertGroup>,
    /// `--spec mtp`: fills the verify rows' placeholder drafts before each step.
    mtp: Option<MtpDrafter>,
    /// The group's ranks' busy seconds since the placement last changed.
    busy: RankBusy,
}

/// Every rank's busy seconds (its step less its waits in the group's sums), summed since
/// the placement last changed: the measured side of `moe_lb`.
#[derive(Default)]
struct RankBusy(Vec<f64>);

impl RankBusy {
    /// Adds this step's `busy_secs` of this rank and every other's (one sum over the
    /// group); returns the slowest rank's total over the mean.
    fn add(&mut self, b: &CpuBackend, group: &mut ExpertGroup, busy_secs: f64) -> f64 {
        let (rank, size) = (group.shard.shard.rank, group.shard.shard.size);
        let mut step = vec![0.0f32; size];
        step[rank] = busy_secs as f32;
        group.collective.all_reduce_sum(b, &mut step, size);
        self.0.resize(size, 0.0);
        for (total, s) in self.0.iter_mut().zip(step) {
            *total += f64::from(s);
        }
        crate::eplb::moe_lb(&self.0)
    }
}

pub(super) fn load(args: &RankArgs) -> Result<Box<dyn DeviceModel>, String> {
    let backend = CpuBackend {
        batch_invariant: args.settings.batch_invariant,
        exact_activations: args.settings.exact_activations,
        // Refused at spawn: DeepSeek-V4 checkpoints carry their own FP8 / FP4.
        quantization: None,
        records_steps: false,
    };
    // The rank loads only the routed experts it computes (all of them alone).
    let cfg = DsV4Config::from_dir(&args.settings.model_path).map_err(|e| e.to_string())?;
    let (layers, experts) = (cfg.num_layers, cfg.num_routed_experts);
    let eplb = Balancer::for_model(args, layers, experts)?;
    let residency = expert_shard(args.shard, eplb.as_ref().map(|b| &b.eplb));
    // `--cpu-moe` / `--n-cpu-moe` on the CPU: those experts packed as shipped, the rest
    // as the reference pass keeps them.
    let placement = super::expert_placement::placement(args, &cfg, None)?;
    let holds = |l: usize, e: usize| residency.holds(l, experts, e) && !placement.on_host(l, e);
    let mut model = DsV4Model::load_dir_holding(
        backend,
        &args.settings.model_path,
        args.settings.dummy_weights,
        &holds,
    )
    .map_err(|e| e.to_string())?;
    model
        .keep_experts_on_host(
            &args.settings.model_path,
            args.settings.dummy_weights,
            placement,
            (
                args.settings.batch_invariant,
                stream_on_cpu(args.settings.stream_experts),
            ),
        )
        .map_err(|e| e.to_string())?;
    let formats = CacheFormats::for_dtype(args.settings.kv_dtype);
    if let Some(problem) = formats.problem(&model.cfg) {
        return Err(format!(
            "--kv-cache-dtype {}: {problem}",
            args.settings.kv_dtype.name()
        ));
    }
    let cache = DsV4Cache::on_in(
        &model.backend,
        &model.cfg,
        formats,
        args.settings.num_state_slots,
        args.settings.num_kv_blocks,
        args.settings.block_size,
    );
    let saved = SavedStates::on(&model.backend, &cache, args.settings.num_saved_states);
    let mtp = mtp_drafter(args, &model)?;
    Ok(Box::new(DsV4OnHost {
        model,
        cache,
        saved,
        eplb,
        expert_tokens: vec![vec![0; experts]; layers],
        shard: args.shard,
        group: None,
        mtp,
        busy: RankBusy::default(),
    }))
}

/// `--spec mtp`: the MTP layer beside the model (seeded with `--dummy-weights`).
fn mtp_drafter(args: &RankArgs, model: &DsV4Model) -> Result<Option<MtpDrafter>, String> {
    if !args.settings.mtp {
        return Ok(None);
    }
    let layer = if args.settings.dummy_weights {
        MtpLayer::dummy(&model.cfg)
    } else {
        MtpLayer::load_dir(&model.cfg, &args.settings.model_path)
    }
    .map_err(|e| format!("--spec mtp: {e}"))?;
    Ok(Some(MtpDrafter::new(
        layer,
        model,
        args.settings.num_state_slots,
    )))
}

/// What rank `shard` computes: EPLB's placement when it places experts for this group
/// (`--eplb-ranks` equal to the group size), else contiguous equal shares.
/// On the CPU the "device" is the host: a copy buys nothing unless asked for (the
/// streamed path's tests).
fn stream_on_cpu(flag: StreamExperts) -> StreamExperts {
    match flag {
        StreamExperts::Always => StreamExperts::Always,
        StreamExperts::Auto | StreamExperts::Never => StreamExperts::Never,
    }
}

fn expert_shard(shard: TpShard, eplb: Option<&Eplb>) -> ExpertShard {
    let placements = eplb
        .filter(|e| e.num_ranks() == shard.size)
        .map(|e| e.placements().to_vec());
    ExpertShard { shard, placements }
}

impl DsV4OnHost {
    /// A step's routed loads into EPLB (`None` without it): experts moved where it
    /// rebalanced (`expert_placement::follow_loads`), and between the group's ranks where
    /// the placement changed; the balance after the step.
    fn follow_eplb(&mut self, steps: &[SeqStep<'_>], busy_secs: f64) -> Option<MoeBalance> {
        let balancer = self.eplb.as_mut()?;
        let mut balance = balancer.step(&mut self.model, &self.expert_tokens, steps);
        if let Some(group) = &mut self.group {
            balance.measured_moe_lb = self.busy.add(&self.model.backend, group, busy_secs);
            if group.shard.placements.is_some()
                && group.shard.placements.as_deref() != Some(balancer.eplb.placements())
            {
                // Every rank saw the same loads: the same new placement, the same
                // step. The experts move before the next step computes with it.
                let new = balancer.eplb.placements();
                let old = group.shard.placements.replace(new.to_vec());
                let old = old.expect("checked");
                let moved = new.iter().zip(&old).map(|(n, o)| n.num_moved_from(o));
                balancer.num_moved += moved.sum::<usize>() as u64;
                let (shard, experts) = (&group.shard, self.model.cfg.num_routed_experts);
                let holds = |l: usize, e: usize| shard.holds(l, experts, e);
                let read = self
                    .model
                    .reside(&balancer.weights.0, balancer.weights.1, &holds)
                    .unwrap_or_else(|e| panic!("EPLB: reading experts moved here: {e}"));
                super::trim_heap();
                self.busy = RankBusy::default();
                tracing::debug!(rank = shard.shard.rank, read, "EPLB moved experts");
            }
        }
        balance.num_moved_experts = balancer.num_moved;
        Some(balance)
    }
}

impl DeviceModel for DsV4OnHost {
    fn step(&mut self, step: &RankStep<'_>) -> LaunchedStep {
        // Its rows never move back (a model with state slots has its verify rows' sequences
        // sit out rather than continued).
        debug_assert!(
            step.rows
                .iter()
                .all(|r| r.seq.num_cached_tokens == r.row.plan.num_cached_tokens)
        );
        let steps = &step.seqs();
        let mut ds_steps = ds_steps(steps);
        let num_drafts = step.num_placeholders();
        let model_drafts = match &mut self.mtp {
            Some(mtp) => mtp.propose(&self.model, &ds_steps, &num_drafts),
            None => Vec::new(),
        };
        let filled = super::fill_placeholders(
            ds_steps.iter().map(|s| s.token_ids),
            &num_drafts,
            &model_drafts,
        );
        for (s, tokens) in ds_steps.iter_mut().zip(&filled) {
            s.token_ids = tokens;
        }
        // A refused step is a planning bug: the worker fails and the engine recomputes.
        self.expert_tokens.iter_mut().for_each(|l| l.fill(0));
        let started = std::time::Instant::now();
        let combined_before = self.group.as_ref().map_or(0.0, |g| g.combine_secs);
        let (logits, streams) = self
            .model
            .forward_streams(
                &mut self.cache,
                &ds_steps,
                &mut self.expert_tokens,
                self.group.as_mut(),
            )
            .unwrap_or_else(|e| panic!("DeepSeek-V4 step refused: {e}"));
        // This rank's step less its waits for the others: what its share cost.
        let waited = self
            .group
            .as_ref()
            .map_or(0.0, |g| g.combine_secs - combined_before);
        let busy_secs = started.elapsed().as_secs_f64() - waited;
        if let Some(mtp) = &mut self.mtp {
            mtp.absorb(&self.model, &ds_steps, &num_drafts, &streams);
        }
        let moe_balance = self.follow_eplb(steps, busy_secs);
        launched(
            &logits,
            self.model.vocab_size(),
            step,
            model_drafts,
            moe_balance,
        )
    }

    fn weight_footprint(&self) -> crate::model::weights::WeightFootprint {
        self.model.footprint()
    }

    fn warm_up(&mut self, _block_size: usize, _tokens: usize) -> Result<(), String> {
        // On the host nothing is loaded on first use and no pool grows.
        Ok(())
    }

    fn graph_sizes(&self) -> Option<(&'static [usize], usize)> {
        None
    }

    fn verifies_on_device(&self) -> bool {
        false
    }

    fn kv_copies(&mut self) -> Option<&mut dyn KvCopies> {
        Some(self)
    }

    fn slot_states(&mut self) -> Option<&mut dyn SlotStates> {
        Some(self)
    }

    fn device_picks(&self) -> Option<&dyn crate::kernels::DevicePicks> {
        crate::kernels::Backend::device_picks(&self.model.backend)
    }
    fn vocab_size(&self) -> usize {
        self.model.vocab_size()
    }

    fn join_group(&mut self, join: GroupJoin) -> Result<(), GroupError> {
        let collective = self.model.backend.join_group(join)?;
        // What the rank loaded its experts for.
        let shard = expert_shard(self.shard, self.eplb.as_ref().map(|b| &b.eplb));
        self.group = Some(ExpertGroup::new(shard, collective));
        Ok(())
    }

    fn device_label(&self) -> String {
        "cpu (DeepSeek-V4 reference)".into()
    }
}

impl KvCopies for DsV4OnHost {
    fn kv_blocks(&mut self, blocks: &[u32]) -> Option<Vec<u8>> {
        Some(self.cache.read_blocks_on(&self.model.backend, blocks))
    }

    fn set_kv_blocks(&mut self, blocks: &[(u32, &[u8])]) -> bool {
        self.cache.write_blocks_on(&self.model.backend, blocks)
    }
}

impl SlotStates for DsV4OnHost {
    fn load_states(&mut self, loads: &[StateLoad]) -> bool {
        let b = &self.model.backend;
        load_states(b, &self.saved, &mut self.cache, self.mtp.as_mut(), loads)
    }

    fn save_states(&mut self, saves: &[StateSave]) -> bool {
        save_states(&self.model.backend, &mut self.saved, &self.cache, saves)
    }

    fn saved_state(&mut self, saved: u32) -> Option<Vec<u8>> {
        let saved = saved as usize;
        (saved < self.saved.num_saved()).then(|| {
            self.saved
                .read_bytes(&self.model.backend, &self.cache, saved)
        })
    }

    fn import_states(&mut self, imports: &[StateImport]) -> bool {
        imports.iter().all(|i| {
            let (slot, position) = (i.slot as usize, i.position);
            let span = SlotSpan {
                state_start: 0,
                replay_until: position,
            };
            let b = &self.model.backend;
            let fits = load_bytes(b, &mut self.cache, &i.payload, slot, span, position);
            // As for a saved state: the MTP layer's own state starts over at the hit.
            if let (true, Some(mtp)) = (fits, self.mtp.as_mut()) {
                mtp.restart(slot, position);
            }
            fits
        })
    }
}

/// The scheduler's rows as DeepSeek-V4 steps (every sequence has a state slot).
pub(super) fn ds_steps<'a>(steps: &[SeqStep<'a>]) -> Vec<DsSeqStep<'a>> {
    steps
        .iter()
        .map(|s| {
            let state = s
                .state
                .expect("the scheduler gives DeepSeek-V4 sequences a state slot");
            DsSeqStep {
                token_ids: s.token_ids,
                num_cached_tokens: s.num_cached_tokens,
                block_table: s.block_table,
                state_slot: state.slot,
                span: SlotSpan {
                    state_start: state.state_start,
                    replay_until: state.replay_until,
                },
                num_logit_rows: s.num_logit_rows,
            }
        })
        .collect()
}

/// `StepPlan::state_loads` into `cache`'s slots; false (nothing loaded past the first
/// bad one) where one names a state or slot that does not exist.
pub(super) fn load_states<B: DsV4Kernels>(
    b: &B,
    saved: &SavedStates<B>,
    cache: &mut DsV4Cache<B>,
    mut mtp: Option<&mut MtpDrafter<B>>,
    loads: &[StateLoad],
) -> bool {
    loads.iter().all(|l| {
        let (from, slot) = (l.saved as usize, l.slot as usize);
        let fits = from < saved.num_saved() && slot < cache.num_slots();
        if fits {
            let span = SlotSpan {
                state_start: 0,
                replay_until: l.replay_until,
            };
            saved.load(b, cache, from, slot, span, l.position);
            // The MTP layer's own state is not saved: it starts over at the hit, and
            // must not continue the slot's previous sequence.
            if let Some(mtp) = mtp.as_deref_mut() {
                mtp.restart(slot, l.position);
            }
        }
        fits
    })
}

/// `StepPlan::state_saves` out of `cache`'s slots, each at a block boundary.
pub(super) fn save_states<B: DsV4Kernels>(
    b: &B,
    saved: &mut SavedStates<B>,
    cache: &DsV4Cache<B>,
    saves: &[StateSave],
) -> bool {
    saves.iter().all(|s| {
        let (slot, to) = (s.slot as usize, s.saved as usize);
        let fits = to < saved.num_saved() && slot < cache.num_slots();
        if fits {
            debug_assert_eq!(cache.slot_tokens(slot) % cache.block_size, 0);
            saved.save(b, cache, slot, to);
        }
        fits
    })
}

/// A step whose logits are on the host already: every sampled row's go to the sampler.
pub(super) fn launched(
    logits: &[f32],
    vocab: usize,
    step: &RankStep<'_>,
    model_drafts: Vec<Vec<(u32, f32)>>,
    moe_balance: Option<MoeBalance>,
) -> LaunchedStep {
    let num_rows = step.len();
    let mut host_row = vec![None; num_rows];
    let mut score_row = vec![None; num_rows];
    let mut host = Vec::new();
    let mut logit_row = 0;
    for (row, (r, seq)) in step.rows.iter().map(|r| (r.row, &r.seq)).enumerate() {
        let mut copy = |first: usize, count: usize| {
            let at = host.len() / vocab;
            host.extend_from_slice(&logits[first * vocab..(first + count) * vocab]);
            at
        };
        if let Some(score) = &r.score {
            score_row[row] = Some(copy(logit_row, score.targets.len()));
        }
        // A scored row's sampling rows are its last ones.
        let num_sampling_rows = match &r.score {
            Some(_) => 1 + r.plan.num_draft_tokens,
            None => seq.num_logit_rows,
        };
        if r.sampling.is_some() {
            let first = logit_row + seq.num_logit_rows - num_sampling_rows;
            host_row[row] = Some(copy(first, num_sampling_rows));
        }
        logit_row += seq.num_logit_rows;
    }
    let out = StepLogits {
        moe_balance,
        picked: vec![None; num_rows],
        verify_picks: vec![None; num_rows],
        host_row,
        score_row,
        host,
        model_drafts: model_drafts
            .into_iter()
            .map(|d| (!d.is_empty()).then_some(d))
            .collect(),
    };
    LaunchedStep {
        logits: Box::new(move || out),
        span: None,
        prev: vec![None; num_rows],
    }
}
