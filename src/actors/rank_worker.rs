//! The rank worker actor: owns one rank's backend, weights and KV cache, on its own OS
//! thread (a `ThreadLocalActorSpawner` each: device contexts are bound to one thread).
//! It runs the steps the scheduler plans and hands logits to the sampler; rows that
//! continue the previous step take their input token from `SampledTokens` (ZOS).

use std::path::PathBuf;
use std::sync::Arc as StdArc;
use std::time::Instant;

use ractor::thread_local::ThreadLocalActor;
use ractor::{ActorProcessingErr, ActorRef};

use super::fault::FaultPlan;
use super::sampled_tokens::SampledTokens;
use super::sampler::{RowSampling, SamplerMsg, StepLogits};
use crate::engine::Device;
use crate::kernels::Backend;
use crate::kernels::cpu::CpuBackend;
use crate::model::llama::{LlamaModel, SeqStep};
use crate::sched::{RowInput, StepPlan};

pub enum RankMsg {
    /// Run one step. Step-sized: the plan and sampling parameters travel as `Arc`s.
    Step {
        epoch: u64,
        plan: StdArc<StepPlan>,
        sampling: StdArc<Vec<Option<RowSampling>>>,
        sampler: ActorRef<SamplerMsg>,
    },
}

pub struct RankArgs {
    pub rank: usize,
    pub model_path: PathBuf,
    pub num_kv_blocks: usize,
    pub block_size: usize,
    pub sampled: SampledTokens,
    pub faults: FaultPlan,
    pub batch_invariant: bool,
    pub device: Device,
    pub dummy_weights: bool,
    pub enforce_eager: bool,
}

/// One rank's model, weights and KV cache on its device: all a step needs.
trait DeviceModel {
    /// Runs the step; plain-greedy rows are picked on the device, the other sampling rows'
    /// logits come back to the host.
    fn step(
        &mut self,
        block_size: usize,
        steps: &[SeqStep<'_>],
        sampling: &[Option<RowSampling>],
    ) -> StepLogits;
    fn vocab_size(&self) -> usize;
}

struct OnBackend<B: Backend> {
    backend: B,
    model: LlamaModel<B>,
    cache: B::KvCache,
}

impl<B: Backend> DeviceModel for OnBackend<B> {
    fn step(
        &mut self,
        block_size: usize,
        steps: &[SeqStep<'_>],
        sampling: &[Option<RowSampling>],
    ) -> StepLogits {
        self.model
            .forward_on_device(&self.backend, &mut self.cache, block_size, steps);
        let vocab = self.model.cfg.vocab_size;
        let logits = self.model.device_logits();
        let (mut greedy, mut host) = (Vec::new(), Vec::new());
        for (row, s) in sampling.iter().enumerate() {
            match s {
                Some(s) if s.is_device_greedy() => greedy.push(row),
                Some(_) => host.push(row),
                None => {}
            }
        }
        let mut out = StepLogits {
            picked: vec![None; sampling.len()],
            host_row: vec![None; sampling.len()],
            host: Vec::new(),
        };
        if !greedy.is_empty() {
            for (&row, pick) in greedy
                .iter()
                .zip(self.backend.greedy_rows(logits, vocab, &greedy))
            {
                out.picked[row] = Some(pick);
            }
        }
        if !host.is_empty() {
            out.host = self.backend.download_rows(logits, vocab, &host);
            for (i, &row) in host.iter().enumerate() {
                out.host_row[row] = Some(i);
            }
        }
        out
    }
    fn vocab_size(&self) -> usize {
        self.model.cfg.vocab_size
    }
}

fn load_on<B: Backend + 'static>(
    backend: B,
    args: &RankArgs,
) -> Result<Box<dyn DeviceModel>, ActorProcessingErr> {
    let loaded = if args.dummy_weights {
        crate::model::load_dummy(&args.model_path, &backend)?
    } else {
        crate::model::load(&args.model_path, &backend)?
    };
    let shape = loaded
        .model
        .kv_cache_shape(args.num_kv_blocks, args.block_size);
    let cache = backend.alloc_kv_cache(shape);
    Ok(Box::new(OnBackend {
        backend,
        model: loaded.model,
        cache,
    }))
}

fn load_model(args: &RankArgs) -> Result<Box<dyn DeviceModel>, ActorProcessingErr> {
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
        Device::Cuda(_) => Err(crate::engine::NO_CUDA.into()),
    }
}

pub struct RankState {
    model: Box<dyn DeviceModel>,
    block_size: usize,
    sampled: SampledTokens,
    faults: FaultPlan,
    /// Input ids of the current step's rows, reused across steps.
    inputs: Vec<Vec<u32>>,
    /// When the last step's compute ended: the gap to the next step's start is idle time.
    last_step_end: Option<Instant>,
}

#[derive(Default)]
pub struct RankWorker;

impl ThreadLocalActor for RankWorker {
    type Msg = RankMsg;
    type State = RankState;
    type Arguments = RankArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<RankMsg>,
        args: RankArgs,
    ) -> Result<RankState, ActorProcessingErr> {
        if args.faults.take_start_failure() {
            return Err(format!("rank {} failed to start (injected fault)", args.rank).into());
        }
        Ok(RankState {
            model: load_model(&args)?,
            block_size: args.block_size,
            sampled: args.sampled,
            faults: args.faults,
            inputs: Vec::new(),
            last_step_end: None,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<RankMsg>,
        msg: RankMsg,
        st: &mut RankState,
    ) -> Result<(), ActorProcessingErr> {
        let RankMsg::Step {
            epoch,
            plan,
            sampling,
            sampler,
        } = msg;
        if epoch != st.sampled.epoch() {
            // Planned before a reset: every sequence in it is being recomputed.
            return Ok(());
        }
        st.inputs.resize_with(plan.rows.len(), Vec::new);
        for (row, input) in plan.rows.iter().zip(st.inputs.iter_mut()) {
            input.clear();
            match &row.input {
                RowInput::Tokens(ids) => input.extend_from_slice(ids),
                RowInput::FromPrevious {
                    prev_step,
                    prev_row,
                } => {
                    match st.sampled.wait(epoch, *prev_step, *prev_row) {
                        Some(token) => input.push(token),
                        // The engine was reset while we waited: this step is void.
                        None => return Ok(()),
                    }
                }
            }
        }
        // Timed from here: waiting on the previous step's tokens is not this step's cost.
        let started = Instant::now();
        let idle_secs = st
            .last_step_end
            .map_or(0.0, |end| (started - end).as_secs_f64());
        if st.faults.take_step_panic() {
            panic!("rank worker panicked mid-step (injected fault)");
        }
        let steps: Vec<SeqStep<'_>> = plan
            .rows
            .iter()
            .zip(&st.inputs)
            .map(|(row, input)| SeqStep {
                token_ids: input,
                num_cached_tokens: row.num_cached_tokens,
                block_table: &row.block_table,
            })
            .collect();
        let logits = st.model.step(st.block_size, &steps, &sampling);
        let vocab_size = st.model.vocab_size();
        st.last_step_end = Some(Instant::now());
        // A sampler that died with this step in flight is being replaced; the restart
        // resets the scheduler, which no longer waits for these logits.
        let _ = sampler.cast(SamplerMsg::Sample {
            epoch,
            step_id: plan.step_id,
            logits: StdArc::new(logits),
            vocab_size,
            sampling,
            started,
            idle_secs,
        });
        Ok(())
    }
}
