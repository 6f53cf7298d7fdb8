//! The runner layer: everything that executes a model on a device, below the actors that
//! drive it. A `DeviceModel` is one rank's model, weights and cache on its backend — the
//! Llama family on any `Backend` (with its draft model), DeepSeek-V4 on the host or one
//! GPU (with its MTP drafter); `StepInputs` applies a step's ZOS remap and hands the
//! model the step as the rank runs it (`RankStep`); the readback thread waits for each
//! launched step and hands it on; the decode-latency curve is measured here as a rank
//! starts.

pub mod affinity;
pub mod decode_curve;
#[cfg(feature = "cuda")]
mod deepseek_v4_cuda;
pub mod fault;
pub mod image_encoder;
pub mod inputs;
pub mod rank_step;
pub mod readback;
pub mod sampled_tokens;
pub mod step_state;

mod deepseek_v4;
mod draft;
mod expert_placement;
mod images;
mod launch;
mod llama;
mod mtp;

use std::path::PathBuf;

use crate::kernels::collective::{GroupError, GroupJoin};
use crate::kernels::cpu::CpuBackend;
use crate::kernels::{Device, DeviceMark, Pending};
use crate::model::config::ModelConfig;
use crate::model::tensor_parallel::TpShard;
use crate::step::{Drawn, StepLogits};

use decode_curve::CurveJob;
use fault::FaultPlan;
use llama::load_on;
use rank_step::RankStep;
use sampled_tokens::SampledTokens;

/// What a rank reports once started: the decode latency curve it measured (a lone
/// rank), the cores it runs on.
#[derive(Debug, Clone, Default)]
pub struct RankReport {
    pub decode_curve: Option<crate::spec::LatencyCurve>,
    /// The rank's weights on its device (`None`: the model does not count them).
    pub weights: Option<crate::model::weights::WeightFootprint>,
    /// `None`: not pinned.
    pub cpu_cores: Option<Vec<usize>>,
}

impl RankReport {
    /// The cores as a cpulist (`0-15`), or `unpinned`.
    pub fn cores(&self) -> String {
        self.cpu_cores
            .as_deref()
            .map_or_else(|| "unpinned".into(), affinity::format_cpulist)
    }
}

/// Why a rank's model did not load (what its actor's start fails with).
pub type LoadError = Box<dyn std::error::Error + Send + Sync>;

/// What every rank of the engine starts from, whatever its place in a group: the
/// supervisor keeps it to (re)start the ranks.
#[derive(Clone)]
pub struct RankSettings {
    pub model_path: PathBuf,
    /// The full model's shape, for choosing group sizes.
    pub model_config: ModelConfig,
    /// The devices a group may use, one rank each (the configured group size of them).
    pub devices: Vec<Device>,
    pub num_kv_blocks: usize,
    /// Per-sequence state slots (DeepSeek-V4's window ring and compressor state); 0 for
    /// models without per-sequence state.
    pub num_state_slots: usize,
    /// Slot states saved with the prefix (`sched::SavedStates`); 0: none.
    pub num_saved_states: usize,
    pub block_size: usize,
    /// MoE models: plan expert placement from the routed loads and report the balance.
    pub eplb: Option<crate::eplb::EplbSettings>,
    /// DeepSeek-V4: which routed experts stay in host memory (`expert_placement`).
    pub cpu_moe: crate::model::deepseek_v4::expert_placement::CpuMoe,
    /// DeepSeek-V4: when host experts are copied to the device (`expert_streaming`).
    pub stream_experts: crate::model::deepseek_v4::expert_streaming::StreamExperts,
    pub faults: FaultPlan,
    pub batch_invariant: bool,
    /// CPU: see `CpuBackend::exact_activations`.
    pub exact_activations: bool,
    /// `--quantization`: see `Backend::quantization`.
    pub quantization: Option<crate::kernels::fp8::Quantization>,
    /// `--kv-cache-dtype`, checked against the device and the model by the engine.
    pub kv_dtype: crate::kernels::KvDtype,
    /// The prefix store a rank copies registered blocks to (`--kv-store-dir`, ...).
    pub kv_store: Option<crate::sync::Shared<crate::store::KvStore>>,
    /// A vision-language model's encoder, shared by the engine's ranks and encoder actor.
    pub images: Option<crate::sync::Shared<image_encoder::ImageEncoder>>,
    pub dummy_weights: bool,
    pub enforce_eager: bool,
    pub cpu_affinity: affinity::CpuAffinity,
    /// `--threads`: a CPU rank's kernel threads (`affinity::place_rank`).
    pub cpu_threads: Option<usize>,
    /// Measure (or load) the decode latency curve before the first step (`RankArgs::decode_curve`).
    pub decode_curve: Option<CurveJob>,
    /// The largest prefill a step runs (`DeviceModel::warm_up`); 0 skips the warm-up.
    pub warmup_tokens: usize,
    /// The most tokens a step of decode and verify rows may hold: graphs up to it are
    /// recorded before the first request (`RankArgs::graph_tokens`); 0 records none.
    pub graph_tokens: usize,
    /// `--spec draft`: the draft model each rank runs beside the model.
    pub draft_model_path: Option<PathBuf>,
    /// `--spec mtp`: DeepSeek-V4's MTP layer drafts for the verify rows.
    pub mtp: bool,
    /// DeepSeek-V4: a group is expert-parallel, sized by its routed experts.
    pub num_routed_experts: Option<usize>,
}

/// What it takes to start one rank: its place, and the settings every rank shares.
pub struct RankArgs {
    /// The rank's place in its tensor-parallel group.
    pub shard: TpShard,
    /// The rank's device among the engine's devices (what fault injection names).
    pub device_slot: usize,
    pub sampled: SampledTokens,
    pub settings: RankSettings,
}

impl RankArgs {
    pub fn device(&self) -> Device {
        self.settings.devices[self.device_slot]
    }

    /// The decode latency curve to measure (or load) before the first step: a lone rank's
    /// only, as a group's ranks would each need the others.
    pub fn decode_curve(&self) -> Option<&CurveJob> {
        self.settings
            .decode_curve
            .as_ref()
            .filter(|_| self.shard.size == 1)
    }

    /// The most tokens of decode and verify rows whose graphs are recorded before the first
    /// request (0: none): a lone rank's only, as a group's rank would record steps without
    /// its peers' collectives.
    pub fn graph_tokens(&self) -> usize {
        if self.shard.size == 1 {
            self.settings.graph_tokens
        } else {
            0
        }
    }
}

/// Where the next step finds the token a row of this step drew.
#[derive(Debug, Clone)]
pub enum PrevToken {
    /// Already on the host (a backend that picks on the host).
    Host(u32),
    /// Entry `i` of the backend's greedy picks, still on the device: the next step's
    /// embedding reads it there, nobody waits for it.
    Device(u32),
    /// A verify row's drafts and its picks (one per draft and one after), made on the
    /// host.
    HostVerified { drafts: Vec<u32>, picks: Vec<u32> },
    /// A verify row whose picks (entries `first..`, one per draft and one after)
    /// stay on the device: a row continuing it has the device verify `drafts` against
    /// them (`VerifiedRow`), or reads them (`DeviceModel::device_picks`), without waiting
    /// for the sampler.
    DeviceVerified { first: u32, drafts: Vec<u32> },
    /// Drawn by the host's sampler (`SampledTokens`), after these drafts (empty: a row
    /// without drafts).
    Sampled { drafts: Vec<u32> },
}

impl PrevToken {
    /// A verify row's outcome from its picks: the drafts that equal the pick at their
    /// position, then the pick after them.
    pub fn verified(drafts: &[u32], picks: &[u32]) -> Drawn {
        let num_accepted = num_accepted(drafts, picks);
        Drawn {
            token: picks[num_accepted],
            num_rejected: (drafts.len() - num_accepted) as u32,
        }
    }

    /// The tokens a verify row yielded: its accepted drafts, then the pick after them.
    pub fn yielded(drafts: &[u32], picks: &[u32]) -> Vec<u32> {
        let num_accepted = num_accepted(drafts, picks);
        let mut tokens = drafts[..num_accepted].to_vec();
        tokens.push(picks[num_accepted]);
        tokens
    }
}

fn num_accepted(drafts: &[u32], picks: &[u32]) -> usize {
    crate::spec::verify::num_accepted_by_picks(drafts, picks.iter().copied())
}

/// A step launched on the device.
pub struct LaunchedStep {
    /// Waits for the step's picks to land and returns what the sampler needs.
    pub logits: Pending<StepLogits>,
    /// The step's first and last work on the device's timeline (CUDA events).
    pub span: Option<(DeviceMark, DeviceMark)>,
    /// Per plan row, for rows with a greedy pick: where the next step finds it.
    pub prev: Vec<Option<PrevToken>>,
}

/// One rank's model, weights and KV cache on its device: all a step needs. What only some
/// models can do is asked for by name (`kv_copies`, `slot_states`): each model answers,
/// none inherits an empty answer.
pub trait DeviceModel: Send {
    /// Launches the step: rows without processors are picked on the device (greedy ones,
    /// and sampled ones where the backend samples), the other sampling rows' logits are
    /// copied to the host before this returns. Each row says where its input lies (its
    /// tokens, a pick on the device, or a verify row's picks the device applies).
    fn step(&mut self, step: &RankStep<'_>) -> LaunchedStep;
    fn vocab_size(&self) -> usize;
    fn join_group(&mut self, join: GroupJoin) -> Result<(), GroupError>;
    /// The hardware, for keying measurements.
    fn device_label(&self) -> String;
    /// Runs one prefill of up to `tokens` tokens (a step's most) before the first request,
    /// so that request does not pay the first step's costs: kernels loaded on first launch,
    /// the memory pool grown to a step's peak. The KV blocks and state slots it writes are
    /// free again after it.
    fn warm_up(&mut self, block_size: usize, tokens: usize) -> Result<(), String>;
    /// What the weights take on the device and run in.
    fn weight_footprint(&self) -> crate::model::weights::WeightFootprint;
    /// The last step's picks where they stay on the device (`PrevToken::DeviceVerified`
    /// rows read theirs through it); `None` where every pick goes to the host.
    fn device_picks(&self) -> Option<&dyn crate::kernels::DevicePicks>;
    /// The token counts steps run at as recorded graphs, ascending, and the most tokens a
    /// row of one may hold (`StepGraphs`); `None`: no graphs.
    fn graph_sizes(&self) -> Option<(&'static [usize], usize)>;
    /// Whether `step` takes rows continuing a `PrevToken::DeviceVerified` row as
    /// `VerifiedRow`s, without the host waiting for that row's picks.
    fn verifies_on_device(&self) -> bool;
    /// Its KV cache as a prefix store copies it; `None` where the cache cannot be copied
    /// so (the engine refuses a store).
    fn kv_copies(&mut self) -> Option<&mut dyn KvCopies>;
    /// Its per-sequence state slots; `None` for a model without them.
    fn slot_states(&mut self) -> Option<&mut dyn SlotStates>;
}

/// A model's KV blocks copied out for a prefix store and back in.
pub trait KvCopies {
    /// KV blocks `blocks` as the cache stores them, back to back; `None` where it cannot.
    fn kv_blocks(&mut self, blocks: &[u32]) -> Option<Vec<u8>>;
    /// Fills each `(block, bytes)` from `kv_blocks`' bytes; false where it cannot.
    fn set_kv_blocks(&mut self, blocks: &[(u32, &[u8])]) -> bool;
}

/// A model's per-sequence state slots (DeepSeek-V4's compressor and window state), saved
/// at block boundaries and resumed from there.
pub trait SlotStates {
    /// Puts saved states into slots before a step's rows run (`StepPlan::state_loads`);
    /// false where one is not held.
    fn load_states(&mut self, loads: &[crate::sched::StateLoad]) -> bool;
    /// Saves slots' states after a step's rows ran (`StepPlan::state_saves`); false where
    /// one is not held.
    fn save_states(&mut self, saves: &[crate::sched::StateSave]) -> bool;
    /// Saved state `saved`'s bytes, for a prefix store (`StateSave::keep_as`); `None`
    /// where the states cannot be copied so.
    fn saved_state(&mut self, saved: u32) -> Option<Vec<u8>>;
    /// Writes states a store kept (`saved_state`'s bytes) into slots before a step's rows
    /// run (`StepPlan::state_imports`); false where one does not fit.
    fn import_states(&mut self, imports: &[crate::sched::StateImport]) -> bool;
}

/// The model at `args.settings.model_path` on `args.device()`, loaded.
pub fn load_model(args: &RankArgs) -> Result<Box<dyn DeviceModel>, LoadError> {
    if crate::model::is_deepseek_v4_dir(&args.settings.model_path) {
        return match args.device() {
            Device::Cpu => Ok(deepseek_v4::load(args)?),
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => Ok(deepseek_v4_cuda::load(args, ordinal)?),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => Err(crate::kernels::NO_CUDA.into()),
        };
    }
    match args.device() {
        Device::Cpu => load_on(
            CpuBackend {
                batch_invariant: args.settings.batch_invariant,
                exact_activations: args.settings.exact_activations,
                quantization: args.settings.quantization,
                records_steps: false,
            },
            args,
        ),
        #[cfg(feature = "cuda")]
        Device::Cuda(ordinal) => {
            let mut backend = crate::kernels::cuda::CudaBackend::new(
                ordinal,
                args.settings.batch_invariant,
                !args.settings.enforce_eager,
            )?;
            backend.quantization = args.settings.quantization;
            load_on(backend, args)
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(crate::kernels::NO_CUDA.into()),
    }
}

/// Hands free heap memory back to the OS: after loading or moving weights, resident
/// memory is then the weights, not the weights and the buffers they were read through.
pub fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free heap memory to the kernel.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// A warm-up prefill's prompt of `tokens` ids spread over the vocabulary (hash-routed
/// layers route by id, and one id would make a lighter step than a real prompt's), and the
/// block table of the blocks from 0 it fills.
pub(crate) fn warmup_prompt(
    tokens: usize,
    vocab: usize,
    block_size: usize,
) -> (Vec<u32>, Vec<u32>) {
    let ids = (0..tokens as u64)
        .map(|i| (i * 7919 % vocab as u64) as u32)
        .collect();
    let table = (0..tokens.div_ceil(block_size) as u32).collect();
    (ids, table)
}

/// Each row's tokens with its last `num_drafts[i]` placeholders replaced by `drafts[i]`
/// (rows without drafts keep their tokens).
pub(crate) fn fill_placeholders<'a>(
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
