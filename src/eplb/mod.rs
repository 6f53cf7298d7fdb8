//! Expert-parallel load balancing (EPLB) for MoE layers: pure logic, no devices. Per layer,
//! the tokens each logical expert received over a sliding window of steps decide a logical →
//! physical placement: hot experts get redundant replicas (physical = logical + redundant
//! slots, an equal number per rank), and replicas are bin-packed so that the most loaded
//! rank carries as little as possible. A rebalance runs every `period_steps` steps, the
//! first at a quarter period, and waits while a prefill is running (moving weights then
//! would stall the long step). `moe_lb` — the slowest rank's load over the mean — is what
//! the placement minimises and what the engine reports.
//!
//! The expert-parallel execution that follows the map (dispatch / combine across ranks,
//! weights moved when the map changes) belongs to the model and the rank workers.

mod placement;
mod window;

pub use placement::{LayerPlacement, place_layer, rank_loads};
pub use window::LoadWindow;

/// The shape of the expert-parallel group and how often to rebalance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EplbConfig {
    pub num_layers: usize,
    pub num_logical_experts: usize,
    /// Extra physical expert slots across all ranks, for replicas of hot experts.
    pub num_redundant_experts: usize,
    /// The EP size: ranks that hold experts.
    pub num_ranks: usize,
    /// Steps of load statistics a rebalance looks at.
    pub window_steps: usize,
    /// Steps between rebalances (the first comes after a quarter of it).
    pub period_steps: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EplbError {
    #[error(
        "{num_physical} physical experts ({num_logical} logical + {num_redundant} redundant) do not divide over {num_ranks} ranks"
    )]
    Indivisible {
        num_physical: usize,
        num_logical: usize,
        num_redundant: usize,
        num_ranks: usize,
    },
    #[error("EPLB needs at least one layer, expert, rank, window step and period step")]
    Empty,
    #[error("{got} layers of expert loads, the model has {want} MoE layers")]
    LayerCount { got: usize, want: usize },
    #[error("layer {layer}: {got} expert loads, the model has {want} experts")]
    LoadShape {
        layer: usize,
        got: usize,
        want: usize,
    },
}

impl EplbConfig {
    pub fn num_physical_experts(&self) -> usize {
        self.num_logical_experts + self.num_redundant_experts
    }

    pub fn validate(&self) -> Result<(), EplbError> {
        if self.num_layers == 0
            || self.num_logical_experts == 0
            || self.num_ranks == 0
            || self.window_steps == 0
            || self.period_steps == 0
        {
            return Err(EplbError::Empty);
        }
        if !self.num_physical_experts().is_multiple_of(self.num_ranks) {
            return Err(EplbError::Indivisible {
                num_physical: self.num_physical_experts(),
                num_logical: self.num_logical_experts,
                num_redundant: self.num_redundant_experts,
                num_ranks: self.num_ranks,
            });
        }
        Ok(())
    }
}

/// When to rebalance: every `period` steps, the first at a quarter period; a rebalance
/// that falls due during a prefill waits for the first step without one.
#[derive(Debug, Clone)]
pub struct RebalanceClock {
    period_steps: u64,
    num_steps: u64,
    next_due: u64,
}

impl RebalanceClock {
    pub fn new(period_steps: u64) -> Self {
        RebalanceClock {
            period_steps,
            num_steps: 0,
            next_due: (period_steps / 4).max(1),
        }
    }

    /// Counts a step; true when a rebalance should run after it.
    pub fn tick(&mut self, prefill_running: bool) -> bool {
        self.num_steps += 1;
        if self.num_steps < self.next_due || prefill_running {
            return false;
        }
        self.next_due = self.num_steps + self.period_steps;
        true
    }
}

/// What a user sets; the model supplies layers and experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EplbSettings {
    pub num_ranks: usize,
    pub num_redundant_experts: usize,
    pub window_steps: usize,
    pub period_steps: u64,
}

impl EplbSettings {
    pub fn for_model(&self, num_layers: usize, num_logical_experts: usize) -> EplbConfig {
        EplbConfig {
            num_layers,
            num_logical_experts,
            num_redundant_experts: self.num_redundant_experts,
            num_ranks: self.num_ranks,
            window_steps: self.window_steps,
            period_steps: self.period_steps,
        }
    }
}

/// EPLB for one model: statistics, the current placement of every layer, the clock.
pub struct Eplb {
    cfg: EplbConfig,
    window: LoadWindow,
    placements: Vec<LayerPlacement>,
    clock: RebalanceClock,
    num_rebalances: u64,
}

impl Eplb {
    /// Starts from the static placement: expert `e` on rank `e * ranks / experts` order,
    /// redundant slots given to the lowest experts (no statistics yet).
    pub fn new(cfg: EplbConfig) -> Result<Self, EplbError> {
        cfg.validate()?;
        let uniform = vec![1.0; cfg.num_logical_experts];
        let placements = (0..cfg.num_layers)
            .map(|_| place_layer(&uniform, cfg.num_physical_experts(), cfg.num_ranks))
            .collect();
        Ok(Eplb {
            cfg,
            window: LoadWindow::new(cfg.num_layers, cfg.num_logical_experts, cfg.window_steps),
            placements,
            clock: RebalanceClock::new(cfg.period_steps),
            num_rebalances: 0,
        })
    }

    pub fn placements(&self) -> &[LayerPlacement] {
        &self.placements
    }

    /// The expert-parallel group size the placements are for.
    pub fn num_ranks(&self) -> usize {
        self.cfg.num_ranks
    }

    pub fn num_rebalances(&self) -> u64 {
        self.num_rebalances
    }

    /// `layer`'s tokens per logical expert over the window.
    pub fn load(&self, layer: usize) -> Vec<f64> {
        self.window.load(layer)
    }

    /// Records one step's tokens per (layer, logical expert); returns true when the
    /// placements were recomputed after it (the caller then moves expert weights).
    pub fn on_step(
        &mut self,
        tokens_per_expert: &[Vec<u64>],
        prefill_running: bool,
    ) -> Result<bool, EplbError> {
        self.window.record(tokens_per_expert)?;
        if !self.clock.tick(prefill_running) {
            return Ok(false);
        }
        for layer in 0..self.cfg.num_layers {
            let load = self.window.load(layer);
            self.placements[layer] =
                place_layer(&load, self.cfg.num_physical_experts(), self.cfg.num_ranks);
        }
        self.num_rebalances += 1;
        Ok(true)
    }

    /// Per layer, the slowest rank's load over the mean under the current placement and the
    /// window's loads (1.0: perfectly even; layers without load count as 1.0).
    pub fn moe_lb(&self) -> Vec<f64> {
        (0..self.cfg.num_layers)
            .map(|layer| {
                let load = self.window.load(layer);
                moe_lb(&rank_loads(
                    &self.placements[layer],
                    &load,
                    self.cfg.num_ranks,
                ))
            })
            .collect()
    }
}

/// What the engine reports of its EPLB: the worst layer's `moe_lb` under the current
/// placement, and how many rebalances ran. The rank that routes tokens reports it with
/// each step's logits; the scheduler keeps the latest for status.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MoeBalance {
    pub worst_moe_lb: f64,
    pub num_rebalances: u64,
    /// Expert replicas the rebalances moved onto ranks of the group that applies them
    /// (0: a lone rank, or a group the placement is not for).
    pub num_moved_experts: u64,
    /// `moe_lb` of the ranks' measured busy time since the placement last changed (0.0:
    /// not measured: one rank, or a backend that does not time it).
    pub measured_moe_lb: f64,
}

impl MoeBalance {
    pub fn of(eplb: &Eplb) -> Self {
        MoeBalance {
            worst_moe_lb: eplb.moe_lb().into_iter().fold(1.0, f64::max),
            num_rebalances: eplb.num_rebalances(),
            num_moved_experts: 0,
            measured_moe_lb: 0.0,
        }
    }
}

/// The slowest rank's load over the mean (1.0 when nothing ran).
pub fn moe_lb(rank_loads: &[f64]) -> f64 {
    let total: f64 = rank_loads.iter().sum();
    if total <= 0.0 {
        return 1.0;
    }
    let max = rank_loads.iter().cloned().fold(0.0, f64::max);
    max / (total / rank_loads.len() as f64)
}

#[cfg(test)]
mod tests;
