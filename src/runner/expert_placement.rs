//! A DeepSeek-V4 rank's routed-expert placement from the machine it runs on: the device
//! room measured after everything else is placed, the host's available memory, the
//! user's flags (`model::deepseek_v4::expert_placement` decides; this reads the sizes).

use std::path::{Path, PathBuf};

use super::RankArgs;
use crate::eplb::{Eplb, MoeBalance};
use crate::kernels::deepseek_v4::DsV4Kernels;
use crate::model::deepseek_v4::DsV4Model;
use crate::model::deepseek_v4::config::DsV4Config;
use crate::model::deepseek_v4::expert_placement::{
    CpuMoe, ExpertPlacement, PlacementSizes, place_experts,
};
use crate::model::llama::SeqStep;

/// Device memory kept free for a step's activations, cuBLAS and the allocator's slack.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub const DEVICE_MARGIN_BYTES: usize = 6 << 30;

/// Host memory the experts leave to everything else (the prefix store, the OS).
const HOST_MARGIN_BYTES: usize = 4 << 30;

/// One routed expert's bytes as stored: MXFP4 (17 bytes per 32 values) where the width
/// takes it, as the released checkpoints and `--dummy-weights` keep them; else bf16.
pub fn expert_bytes(cfg: &DsV4Config) -> usize {
    let values = 3 * cfg.moe_intermediate_size * cfg.hidden_size;
    if cfg.hidden_size.is_multiple_of(32) && cfg.moe_intermediate_size.is_multiple_of(32) {
        values / 32 * 17
    } else {
        values * 2
    }
}

/// `MemAvailable` of `/proc/meminfo`, in bytes (unbounded where it cannot be read).
pub fn host_available_bytes() -> usize {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("MemAvailable:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<usize>().ok())
        })
        .map_or(usize::MAX, |kib| kib << 10)
}

/// Heap blocks of 1 MiB and more in pages of their own from now on: glibc otherwise raises
/// its mmap threshold as blocks are freed and packs such blocks side by side, and the
/// driver page-locks (`Backend::pin_host`) whole pages, one registration each.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub fn pin_friendly_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes the allocator's threshold for later allocations.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
    }
}

/// The placement for `args`' flags on this machine: `device_room_bytes` is what the
/// device has left for routed experts (`None`: the device is the host).
pub fn placement(
    args: &RankArgs,
    cfg: &DsV4Config,
    device_room_bytes: Option<usize>,
) -> Result<ExpertPlacement, String> {
    let (layers, experts) = (cfg.num_layers, cfg.num_routed_experts);
    if args.settings.cpu_moe == CpuMoe::Auto && device_room_bytes.is_none() {
        return Ok(ExpertPlacement::all_on_device(layers, experts));
    }
    let sizes = PlacementSizes {
        num_layers: layers,
        num_experts: experts,
        expert_bytes: expert_bytes(cfg),
        device_room_bytes,
        host_room_bytes: host_available_bytes().saturating_sub(HOST_MARGIN_BYTES),
    };
    let placement = place_experts(args.settings.cpu_moe, &sizes).map_err(|e| e.to_string())?;
    if placement.any_on_host() && args.shard.size > 1 {
        return Err(format!(
            "{}: host experts run beside one device, not in an expert-parallel group of {}",
            args.settings.cpu_moe, args.shard.size
        ));
    }
    if placement.any_on_host() {
        tracing::info!("{}", placement.describe(sizes.expert_bytes));
    }
    Ok(placement)
}

/// After each EPLB rebalance (`seen`: the rebalances already followed), the split layers'
/// hottest experts over EPLB's window go to the device and their coldest to the host, as
/// many on each side as before (`ExpertPlacement::following`). Returns the experts moved.
pub fn follow_loads<B: DsV4Kernels>(
    model: &mut DsV4Model<B>,
    eplb: &Eplb,
    seen: &mut u64,
    dir: &Path,
    dummy: bool,
) -> usize {
    if eplb.num_rebalances() == *seen {
        return 0;
    }
    *seen = eplb.num_rebalances();
    let Some(next) = model
        .expert_placement()
        .filter(|p| p.has_split_layer())
        .map(|p| p.following(|l| eplb.load(l)))
    else {
        return 0;
    };
    let moved = model
        .move_experts(dir, dummy, next)
        .unwrap_or_else(|e| panic!("EPLB: moving experts between the device and host memory: {e}"));
    super::trim_heap();
    tracing::info!(
        moved,
        "EPLB moved routed experts between the device and host memory"
    );
    moved
}

/// EPLB on a DeepSeek-V4 rank (`--eplb-ranks`): the planner, fed each step's routed loads,
/// and the experts this rank moved to follow it.
pub struct Balancer {
    pub eplb: Eplb,
    /// The rebalances whose placement this rank's experts follow.
    followed: u64,
    /// Routed experts moved since the rank started: between the device and host memory,
    /// and (a group's ranks) onto this rank.
    pub num_moved: u64,
    /// Where moved experts are read from, and whether they are seeded instead
    /// (`--dummy-weights`).
    pub weights: (PathBuf, bool),
}

impl Balancer {
    /// The planner for this model's layers and routed experts; `None` without
    /// `--eplb-ranks`.
    pub fn for_model(
        args: &RankArgs,
        layers: usize,
        experts: usize,
    ) -> Result<Option<Self>, String> {
        let Some(settings) = args.settings.eplb else {
            return Ok(None);
        };
        let eplb =
            Eplb::new(settings.for_model(layers, experts)).map_err(|e| format!("EPLB: {e}"))?;
        Ok(Some(Balancer {
            eplb,
            followed: 0,
            num_moved: 0,
            weights: (
                args.settings.model_path.clone(),
                args.settings.dummy_weights,
            ),
        }))
    }

    /// Feeds a step's routed loads (`expert_tokens` of `steps`) to the planner and moves
    /// the experts where it rebalanced (`follow_loads`): the balance after the step.
    pub fn step<B: DsV4Kernels>(
        &mut self,
        model: &mut DsV4Model<B>,
        expert_tokens: &[Vec<u64>],
        steps: &[SeqStep<'_>],
    ) -> MoeBalance {
        // Weights would move between ranks after a rebalance: never mid-prefill.
        let prefill_running = steps.iter().any(|s| s.token_ids.len() > 1);
        self.eplb
            .on_step(expert_tokens, prefill_running)
            .unwrap_or_else(|e| panic!("EPLB: {e}"));
        let (dir, dummy) = (&self.weights.0, self.weights.1);
        self.num_moved += follow_loads(model, &self.eplb, &mut self.followed, dir, dummy) as u64;
        let mut balance = MoeBalance::of(&self.eplb);
        balance.num_moved_experts = self.num_moved;
        balance
    }
}
