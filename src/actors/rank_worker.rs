//! The rank worker actor: owns one rank's backend, weights and KV cache, on its own OS
//! thread (a `ThreadLocalActorSpawner` each: device contexts are bound to one thread).
//! It launches the steps the scheduler plans; a readback thread hands each step's picks
//! and logits to the sampler in order, so the worker is free to launch the next step
//! meanwhile. A row that continues the previous step (ZOS) takes its input token from the
//! previous step's greedy picks where they lie (on the device: no host round trip), or,
//! for rows the sampler drew on the host, from `SampledTokens`.

use std::path::PathBuf;
use std::sync::Arc as StdArc;
use std::time::Instant;

use ractor::thread_local::ThreadLocalActor;
use ractor::{ActorProcessingErr, ActorRef};

use super::decode_curve::{self, CurveJob};
use super::fault::FaultPlan;
use super::sampled_tokens::SampledTokens;
use super::sampler::{RowSampling, SamplerMsg, StepLogits};
use crate::kernels::Device;
use crate::kernels::collective::GroupJoin;
use crate::kernels::cpu::CpuBackend;
use crate::kernels::{DeviceMark, NOT_PICKED, Pending};
use crate::model::llama::{SeqStep, SlotState};
use crate::model::tensor_parallel::TpShard;
use crate::sched::{RowInput, StepPlan};

mod deepseek_v4;
#[cfg(feature = "cuda")]
mod deepseek_v4_cuda;
mod draft;
mod llama;
mod mtp;

use llama::load_on;

pub enum RankMsg {
    /// The readback thread could not deliver a step (a device error while waiting for
    /// it): the worker fails, so its supervisor restarts it and the engine recomputes.
    ReadbackFailed(String),
    /// Join the tensor-parallel group (sent to every rank once all have started, so no
    /// rank waits in a rendezvous for a peer that failed to start).
    JoinGroup(GroupJoin),
    /// Run one step. Step-sized: the plan and sampling parameters travel as `Arc`s.
    Step {
        epoch: u64,
        plan: StdArc<StepPlan>,
        sampling: StdArc<Vec<Option<RowSampling>>>,
        sampler: ActorRef<SamplerMsg>,
    },
}

pub struct RankArgs {
    /// The rank's place in its tensor-parallel group.
    pub shard: TpShard,
    /// The rank's device among the engine's devices (what fault injection names).
    pub device_slot: usize,
    pub model_path: PathBuf,
    pub num_kv_blocks: usize,
    pub num_state_slots: usize,
    pub block_size: usize,
    pub sampled: SampledTokens,
    /// MoE models: plan expert placement from the routed loads and report the balance.
    pub eplb: Option<crate::eplb::EplbSettings>,
    pub moe_balance: crate::eplb::BalanceReport,
    pub faults: FaultPlan,
    pub batch_invariant: bool,
    pub device: Device,
    pub dummy_weights: bool,
    /// `--spec draft`: the draft model this rank runs beside the model.
    pub draft_model_path: Option<PathBuf>,
    /// `--spec mtp`: DeepSeek-V4's MTP layer drafts for the verify rows.
    pub mtp: bool,
    pub enforce_eager: bool,
    /// Measure (or load) the decode latency curve before the first step.
    pub decode_curve: Option<CurveJob>,
}

/// Where the next step finds the token a row of this step drew.
#[derive(Debug, Clone, Copy)]
enum PrevToken {
    /// Already on the host (a backend that picks on the host).
    Host(u32),
    /// Entry `i` of the backend's greedy picks, still on the device: the next step's
    /// embedding reads it there, nobody waits for it.
    Device(u32),
}

/// A step launched on the device.
struct LaunchedStep {
    /// Waits for the step's picks to land and returns what the sampler needs.
    logits: Pending<StepLogits>,
    /// The step's first and last work on the device's timeline (CUDA events).
    span: Option<(DeviceMark, DeviceMark)>,
    /// Per plan row, for rows with a greedy pick: where the next step finds it.
    prev: Vec<Option<PrevToken>>,
}

/// One rank's model, weights and KV cache on its device: all a step needs.
trait DeviceModel {
    /// Launches the step: rows without processors are picked on the device (greedy ones,
    /// and sampled ones where the backend samples), the other sampling rows' logits are
    /// copied to the host before this returns.
    fn step(
        &mut self,
        block_size: usize,
        steps: &[SeqStep<'_>],
        picked_rows: &[u32],
        sampling: &[Option<RowSampling>],
    ) -> LaunchedStep;
    fn vocab_size(&self) -> usize;
    fn join_group(&mut self, join: GroupJoin) -> Result<(), String>;
    /// The hardware, for keying measurements.
    fn device_label(&self) -> String;
}

fn load_model(args: &RankArgs) -> Result<Box<dyn DeviceModel>, ActorProcessingErr> {
    if crate::model::is_deepseek_v4_dir(&args.model_path) {
        return match args.device {
            Device::Cpu => Ok(deepseek_v4::load(args)?),
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => Ok(deepseek_v4_cuda::load(args, ordinal)?),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => Err(crate::kernels::NO_CUDA.into()),
        };
    }
    match args.device {
        Device::Cpu => load_on(
            CpuBackend {
                batch_invariant: args.batch_invariant,
            },
            args,
        ),
        #[cfg(feature = "cuda")]
        Device::Cuda(ordinal) => load_on(
            crate::kernels::cuda::CudaBackend::new(
                ordinal,
                args.batch_invariant,
                !args.enforce_eager,
            )?,
            args,
        ),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(crate::kernels::NO_CUDA.into()),
    }
}

/// A launched step on its way to the sampler.
struct Readback {
    epoch: u64,
    step_id: u64,
    logits: Pending<StepLogits>,
    span: Option<(DeviceMark, DeviceMark)>,
    vocab_size: usize,
    sampling: StdArc<Vec<Option<RowSampling>>>,
    sampler: ActorRef<SamplerMsg>,
    /// When the worker began launching it.
    launched: Instant,
    /// Hand it to the sampler: the group's leader's steps of the current epoch only.
    deliver: bool,
}

/// When a step began on the device, and how long the device idled before it. Steps
/// overlap: one launched while the step before it still ran began when that one's picks
/// landed; one launched later began at its launch, the device idle in between.
/// Per plan row: how many of its last tokens are placeholders a drafting model fills in.
fn num_placeholders(sampling: &[Option<RowSampling>]) -> Vec<usize> {
    sampling
        .iter()
        .map(|s| s.as_ref().map_or(0, |s| s.drafts.len()))
        .collect()
}

/// Each row's tokens with its last `num_drafts[i]` placeholders replaced by `drafts[i]`
/// (rows without drafts keep their tokens).
fn fill_placeholders<'a>(
    rows: impl Iterator<Item = &'a [u32]>,
    num_drafts: &[usize],
    drafts: &[Vec<(u32, f32)>],
) -> Vec<Vec<u32>> {
    rows.zip(num_drafts)
        .zip(drafts)
        .map(|((tokens, &k), d)| {
            let known = &tokens[..tokens.len() - k];
            known.iter().copied().chain(d.iter().map(|x| x.0)).collect()
        })
        .collect()
}

fn step_window(launched: Instant, previous_done: Option<Instant>) -> (Instant, f64) {
    match previous_done {
        None => (launched, 0.0),
        Some(done) => (
            done.max(launched),
            launched.saturating_duration_since(done).as_secs_f64(),
        ),
    }
}

/// Waits for each launched step's picks, in launch order, and hands them to the sampler,
/// so the worker itself goes on to launch the next step. Ends when the worker drops its
/// sender, or after a failed readback, which it reports to the worker.
fn spawn_readback(
    rank: usize,
    worker: ActorRef<RankMsg>,
    faults: FaultPlan,
) -> std::io::Result<crossbeam_channel::Sender<Readback>> {
    let (tx, rx) = crossbeam_channel::unbounded::<Readback>();
    std::thread::Builder::new()
        .name(format!("troupe-readback-{rank}"))
        .spawn(move || {
            // When the previous step's picks landed, and its last work on the device.
            let mut last_done: Option<Instant> = None;
            let mut last_end: Option<DeviceMark> = None;
            for r in rx {
                let waited = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    if faults.take_readback_failure() {
                        panic!("waiting for a step's picks failed (injected fault)");
                    }
                    (r.logits)()
                }));
                let logits = match waited {
                    Ok(logits) => logits,
                    Err(panic) => {
                        let reason = panic
                            .downcast_ref::<&str>()
                            .map(|s| s.to_string())
                            .or_else(|| panic.downcast_ref::<String>().cloned())
                            .unwrap_or_else(|| "a readback panicked".into());
                        // A worker already gone is being restarted anyway.
                        let _ = worker.cast(RankMsg::ReadbackFailed(format!(
                            "rank {rank}: step {}: {reason}",
                            r.step_id
                        )));
                        return;
                    }
                };
                let (started, idle_secs) = step_window(r.launched, last_done);
                last_done = Some(Instant::now());
                // Both events are reached: this step's picks landed after its last work.
                let device_idle_secs = match (&last_end, &r.span) {
                    (Some(end), Some((start, _))) => end.secs_until(start),
                    _ => None,
                };
                if let Some((_, end)) = r.span {
                    last_end = Some(end);
                }
                tracing::debug!(
                    rank,
                    step = r.step_id,
                    deliver = r.deliver,
                    "step read back"
                );
                if !r.deliver {
                    continue;
                }
                // A sampler that died with this step in flight is being replaced; the
                // restart resets the scheduler, which no longer waits for these logits.
                let _ = r.sampler.cast(SamplerMsg::Sample {
                    epoch: r.epoch,
                    step_id: r.step_id,
                    logits: StdArc::new(logits),
                    vocab_size: r.vocab_size,
                    sampling: r.sampling,
                    started,
                    idle_secs,
                    device_idle_secs,
                });
            }
        })?;
    Ok(tx)
}

pub struct RankState {
    model: Box<dyn DeviceModel>,
    block_size: usize,
    sampled: SampledTokens,
    faults: FaultPlan,
    shard: TpShard,
    device_slot: usize,
    /// Input ids of the current step's rows, reused across steps.
    inputs: Vec<Vec<u32>>,
    /// Per row of the current step: its input's index among the device's picks.
    picked_rows: Vec<u32>,
    /// The last launched step (epoch, step id) and where its rows' tokens are.
    prev: Option<(u64, u64, Vec<Option<PrevToken>>)>,
    readback: crossbeam_channel::Sender<Readback>,
}

#[derive(Default)]
pub struct RankWorker;

impl ThreadLocalActor for RankWorker {
    type Msg = RankMsg;
    type State = RankState;
    type Arguments = RankArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<RankMsg>,
        args: RankArgs,
    ) -> Result<RankState, ActorProcessingErr> {
        if args.faults.take_start_failure(args.device_slot) {
            return Err(format!(
                "rank {} (device slot {}) failed to start (injected fault)",
                args.shard.rank, args.device_slot
            )
            .into());
        }
        let mut model = load_model(&args)?;
        if let Some(job) = &args.decode_curve {
            let device = model.device_label();
            let block_size = args.block_size;
            let curve = decode_curve::run(job, &device, args.num_kv_blocks, |rows| {
                decode_curve::time_decode_step(rows, |steps, sampling| {
                    let launched = model.step(block_size, steps, &[], sampling);
                    let _ = (launched.logits)();
                })
            });
            match curve {
                Ok(curve) => {
                    *job.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(curve);
                }
                // Verification then prices steps with the fitted cost model alone.
                Err(e) => tracing::warn!("decode latency curve not measured: {e}"),
            }
        }
        let readback = spawn_readback(args.shard.rank, myself, args.faults.clone())?;
        Ok(RankState {
            model,
            block_size: args.block_size,
            sampled: args.sampled,
            faults: args.faults,
            shard: args.shard,
            device_slot: args.device_slot,
            inputs: Vec::new(),
            picked_rows: Vec::new(),
            prev: None,
            readback,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<RankMsg>,
        msg: RankMsg,
        st: &mut RankState,
    ) -> Result<(), ActorProcessingErr> {
        let (epoch, plan, sampling, sampler) = match msg {
            RankMsg::ReadbackFailed(reason) => return Err(reason.into()),
            RankMsg::JoinGroup(join) => {
                return st.model.join_group(join).map_err(|e| {
                    format!("rank {} could not join its group: {e}", st.shard.rank).into()
                });
            }
            RankMsg::Step {
                epoch,
                plan,
                sampling,
                sampler,
            } => (epoch, plan, sampling, sampler),
        };
        // Planned before a reset: every sequence in it is being recomputed. A lone rank
        // skips it; a group's ranks all run it (nothing reaches the sampler), because a
        // rank that skipped would leave its peers waiting in a collective.
        let void = epoch != st.sampled.epoch();
        let in_group = st.shard.size > 1;
        if void && !in_group {
            return Ok(());
        }
        st.inputs.resize_with(plan.rows.len(), Vec::new);
        st.picked_rows.clear();
        for (row, input) in plan.rows.iter().zip(st.inputs.iter_mut()) {
            input.clear();
            let mut picked = NOT_PICKED;
            match &row.input {
                RowInput::Tokens(ids) => input.extend_from_slice(ids),
                RowInput::FromPrevious {
                    prev_step,
                    prev_row,
                } => {
                    let known = match &st.prev {
                        Some((e, s, prev)) if *e == epoch && s == prev_step => {
                            prev.get(*prev_row).copied().flatten()
                        }
                        _ => None,
                    };
                    match known {
                        Some(PrevToken::Host(token)) => input.push(token),
                        Some(PrevToken::Device(i)) => {
                            // A placeholder: the embedding reads the pick on the device.
                            input.push(0);
                            picked = i;
                        }
                        None => {
                            tracing::debug!(
                                rank = st.shard.rank,
                                step = plan.step_id,
                                prev_step,
                                prev_row,
                                "waiting for a sampled token"
                            );
                            match st.sampled.wait(epoch, *prev_step, *prev_row) {
                                Some(token) => input.push(token),
                                // The engine was reset while we waited: this step is void.
                                None if in_group => input.push(0),
                                None => return Ok(()),
                            }
                        }
                    }
                }
            }
            st.picked_rows.push(picked);
        }
        if st.picked_rows.iter().all(|&p| p == NOT_PICKED) {
            st.picked_rows.clear();
        }
        // Timed from here: waiting on the previous step's tokens is not this step's cost.
        let launched = Instant::now();
        if st.faults.take_step_panic(st.device_slot) {
            panic!(
                "rank {} worker panicked mid-step (injected fault)",
                st.shard.rank
            );
        }
        let steps: Vec<SeqStep<'_>> = plan
            .rows
            .iter()
            .zip(&st.inputs)
            .map(|(row, input)| SeqStep {
                token_ids: input,
                num_cached_tokens: row.num_cached_tokens,
                block_table: &row.block_table,
                num_logit_rows: 1 + row.num_draft_tokens,
                state: row.state_slot.map(|slot| SlotState {
                    slot,
                    state_start: row.state_start,
                    replay_until: row.replay_until,
                }),
            })
            .collect();
        tracing::debug!(
            rank = st.shard.rank,
            step = plan.step_id,
            rows = steps.len(),
            device_picks = st.picked_rows.len(),
            "step launching"
        );
        let step = st
            .model
            .step(st.block_size, &steps, &st.picked_rows, &sampling);
        st.prev = Some((epoch, plan.step_id, step.prev));
        st.readback
            .send(Readback {
                epoch,
                step_id: plan.step_id,
                logits: step.logits,
                span: step.span,
                vocab_size: st.model.vocab_size(),
                sampling,
                sampler,
                launched,
                deliver: st.shard.is_leader() && epoch == st.sampled.epoch(),
            })
            .map_err(|_| "the readback thread ended")?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn overlapping_steps_are_timed_from_the_previous_steps_end() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        // Launched at 10 while the step before ran until 25: it began at 25, no idle.
        assert_eq!(step_window(ms(10), Some(ms(25))), (ms(25), 0.0));
        // Launched at 40 after the step before ended at 25: 15 ms idle.
        let (start, idle) = step_window(ms(40), Some(ms(25)));
        assert_eq!(start, ms(40));
        assert!((idle - 0.015).abs() < 1e-9, "{idle}");
        assert_eq!(step_window(ms(5), None), (ms(5), 0.0));
    }
}
