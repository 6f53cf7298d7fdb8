//! The rank worker actor: owns one rank's model (a `runner::DeviceModel`: backend,
//! weights and KV cache) on its own OS thread (a `ThreadLocalActorSpawner` each: device
//! contexts are bound to one thread). It resolves each step's inputs, launches the step
//! and hands it to the readback thread, which delivers the leader's picks and logits to
//! the sampler in order while the worker launches the next step.

use crate::sync::Shared;
use std::time::Instant;

use ractor::thread_local::ThreadLocalActor;
use ractor::{ActorProcessingErr, ActorRef, RpcReplyPort};

use super::sampler::SamplerMsg;
use crate::kernels::collective::GroupJoin;
use crate::model::tensor_parallel::TpShard;
use crate::runner::affinity;
use crate::runner::decode_curve;
use crate::runner::fault::FaultPlan;
use crate::runner::inputs::StepInputs;
use crate::runner::readback::{ReadStep, Readback, spawn_readback};
use crate::runner::sampled_tokens::SampledTokens;
use crate::runner::step_state::{load_step_state, save_kv, save_step_states};
use crate::runner::{DeviceModel, RankArgs, RankReport, load_model};
use crate::sched::KvSave;
use crate::step::Step;
use crate::store::KvStore;

pub enum RankMsg {
    /// The readback thread could not deliver a step (a device error while waiting for
    /// it): the worker fails, so its supervisor restarts it and the engine recomputes.
    ReadbackFailed(String),
    /// Join the tensor-parallel group (sent to every rank once all have started, so no
    /// rank waits in a rendezvous for a peer that failed to start).
    JoinGroup(GroupJoin),
    /// What this rank measured and how it was placed as it started.
    Report(RpcReplyPort<RankReport>),
    /// Copy these registered blocks to the prefix store (sent before any step that could
    /// reuse them).
    SaveKv(Vec<KvSave>),
    /// Answered once the `SaveKv`s sent before it are in the store.
    KvSaved(RpcReplyPort<()>),
    /// Run one step (shared by every rank and, from the leader, the sampler).
    Step {
        step: Shared<Step>,
        sampler: ActorRef<SamplerMsg>,
    },
}

pub struct RankState {
    /// `None` once `post_stop` released it.
    model: Option<Box<dyn DeviceModel>>,
    block_size: usize,
    sampled: SampledTokens,
    faults: FaultPlan,
    shard: TpShard,
    device_slot: usize,
    inputs: StepInputs,
    readback: crate::sync::channel::Sender<Readback>,
    /// What it measured and how it was placed at start, for the supervisor to hand to
    /// the scheduler.
    report: RankReport,
    kv_store: Option<Shared<KvStore>>,
    /// A CPU rank's own threads, pinned to its cores (`--cpu-affinity auto`).
    pool: Option<rayon::ThreadPool>,
}

#[derive(Default)]
pub struct RankWorker;

impl ractor::Message for RankMsg {}

impl ThreadLocalActor for RankWorker {
    type Msg = RankMsg;
    type State = RankState;
    type Arguments = RankArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<RankMsg>,
        args: RankArgs,
    ) -> Result<RankState, ActorProcessingErr> {
        if args.settings.faults.take_start_failure(args.device_slot) {
            return Err(format!(
                "rank {} (device slot {}) failed to start (injected fault)",
                args.shard.rank, args.device_slot
            )
            .into());
        }
        let (cpu_cores, pool) = affinity::place_rank(
            args.settings.cpu_affinity,
            args.settings.cpu_threads,
            args.device(),
            args.shard,
        );
        let mut model = load_model(&args)?;
        // Loading frees as much as it keeps (file copies, stacked parts): hand it back to
        // the OS so resident memory is the weights, not the weights and their scaffolding.
        crate::runner::trim_heap();
        model.warm_up(args.settings.block_size, args.settings.warmup_tokens)?;
        in_pool(pool.as_ref(), || {
            decode_curve::record_graphs(
                model.as_mut(),
                args.settings.block_size,
                args.settings.num_kv_blocks,
                args.graph_tokens(),
            )
        });
        let decode_curve = args.decode_curve().and_then(|job| {
            in_pool(pool.as_ref(), || {
                decode_curve::measure(
                    job,
                    model.as_mut(),
                    args.settings.block_size,
                    args.settings.num_kv_blocks,
                )
            })
        });
        // A worker already gone is being restarted anyway.
        let failed = move |reason: String| {
            let _ = myself.cast(RankMsg::ReadbackFailed(reason));
        };
        let readback = spawn_readback(args.shard.rank, failed, args.settings.faults.clone())?;
        let weights = Some(model.weight_footprint());
        Ok(RankState {
            model: Some(model),
            block_size: args.settings.block_size,
            sampled: args.sampled,
            faults: args.settings.faults,
            shard: args.shard,
            device_slot: args.device_slot,
            inputs: StepInputs::default(),
            readback,
            report: RankReport {
                weights,
                decode_curve,
                cpu_cores,
            },
            kv_store: args.settings.kv_store,
            pool,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<RankMsg>,
        msg: RankMsg,
        st: &mut RankState,
    ) -> Result<(), ActorProcessingErr> {
        let Some(model) = st.model.as_mut() else {
            return Err("the rank released its model".into());
        };
        match msg {
            RankMsg::ReadbackFailed(reason) => Err(reason.into()),
            RankMsg::Report(reply) => {
                let _ = reply.send(st.report.clone());
                Ok(())
            }
            RankMsg::JoinGroup(join) => model.join_group(join).map_err(|e| {
                format!("rank {} could not join its group: {e}", st.shard.rank).into()
            }),
            RankMsg::SaveKv(saves) => {
                if let Some(store) = &st.kv_store {
                    save_kv(model.as_mut(), store, &saves)?;
                }
                Ok(())
            }
            RankMsg::KvSaved(reply) => {
                let _ = reply.send(());
                Ok(())
            }
            RankMsg::Step { step, sampler } => run_step(st, step, sampler),
        }
    }

    /// The model (weights, cache, device handles) goes here, before the actor reports
    /// itself stopped: ractor drops a thread-local actor's state only after waiters are
    /// woken, and a process exiting while a rank's thread still frees its device state
    /// crashes inside the CUDA libraries.
    async fn post_stop(
        &self,
        _myself: ActorRef<RankMsg>,
        st: &mut RankState,
    ) -> Result<(), ActorProcessingErr> {
        if st.model.take().is_some() {
            st.faults.note_model_released();
        }
        Ok(())
    }
}

/// `f` on `pool`'s threads when the rank has its own, else here.
fn in_pool<R: Send>(pool: Option<&rayon::ThreadPool>, f: impl FnOnce() -> R + Send) -> R {
    match pool {
        Some(pool) => pool.install(f),
        None => f(),
    }
}

/// Hands a step's logits, once read back, to the sampler.
fn to_sampler(
    sampler: ActorRef<SamplerMsg>,
    step: Shared<Step>,
    vocab_size: usize,
) -> Box<dyn FnOnce(ReadStep) + Send> {
    Box::new(move |read: ReadStep| {
        // A sampler that died with this step in flight is being replaced; the restart
        // resets the scheduler, which no longer waits for these logits.
        let _ = sampler.cast(SamplerMsg::Sample {
            step,
            logits: Shared::new(read.logits),
            vocab_size,
            started: read.started,
            idle_secs: read.idle_secs,
            device_idle_secs: read.device_idle_secs,
        });
    })
}

/// Applies `step` on the rank: its inputs resolved, the states and blocks it brings
/// loaded, its pass launched, and its logits handed to the readback thread (which hands
/// the leader's on to `sampler`).
fn run_step(
    st: &mut RankState,
    step: Shared<Step>,
    sampler: ActorRef<SamplerMsg>,
) -> Result<(), ActorProcessingErr> {
    let Some(model) = st.model.as_mut() else {
        return Err("the rank released its model".into());
    };

    let epoch = step.epoch;
    // Planned before a reset: every sequence in it is being recomputed. A lone rank
    // skips it; a group's ranks all run it (nothing reaches the sampler), because a
    // rank that skipped would leave its peers waiting in a collective.
    let void = epoch != st.sampled.epoch();
    let in_group = st.shard.size > 1;
    if void && !in_group {
        return Ok(());
    }
    let on_device = model.verifies_on_device();
    let device_picks = model.device_picks();
    let mut read_picks = |first: u32, count: usize| {
        device_picks
            .expect("a step leaves picks on the device only where the model keeps them")
            .read_picks(first as usize, count)
    };
    if !st.inputs.resolve(
        &step,
        &st.sampled,
        in_group,
        st.shard.rank,
        on_device,
        &mut read_picks,
    ) {
        return Ok(());
    }
    load_step_state(model.as_mut(), st.kv_store.as_ref(), st.shard.rank, &step)?;
    // Timed from here: waiting on the previous step's tokens is not this step's cost.
    let launched = Instant::now();
    if st.faults.take_step_panic(st.device_slot) {
        panic!(
            "rank {} worker panicked mid-step (injected fault)",
            st.shard.rank
        );
    }
    let rank_step = st.inputs.rank_step(&step, st.block_size);
    tracing::debug!(
        rank = st.shard.rank,
        step = step.step_id,
        rows = rank_step.len(),
        device_picks = rank_step.picked_rows().len(),
        "step launching"
    );
    let launched_step = in_pool(st.pool.as_ref(), || model.step(&rank_step));
    drop(rank_step);
    save_step_states(model.as_mut(), st.kv_store.as_ref(), st.shard.rank, &step)?;
    let step_id = step.step_id;
    st.inputs.launched(epoch, step_id, launched_step.prev);
    let deliver = st.shard.is_leader() && epoch == st.sampled.epoch();
    let vocab_size = model.vocab_size();
    let deliver = deliver.then(|| to_sampler(sampler, step, vocab_size));
    st.readback
        .send(Readback {
            step_id,
            logits: launched_step.logits,
            span: launched_step.span,
            launched,
            deliver,
        })
        .map_err(|_| "the readback thread ended")?;
    Ok(())
}
