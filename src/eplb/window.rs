//! Per-layer expert load over the last `window_steps` steps: a ring of per-step counts and
//! their running sums.

use super::EplbError;

pub struct LoadWindow {
    num_experts: usize,
    window_steps: usize,
    /// Per layer, per step in the ring, tokens per expert.
    ring: Vec<Vec<Vec<u64>>>,
    totals: Vec<Vec<u64>>,
    /// The ring position the next step overwrites.
    next: usize,
}

impl LoadWindow {
    pub fn new(num_layers: usize, num_experts: usize, window_steps: usize) -> Self {
        LoadWindow {
            num_experts,
            window_steps,
            ring: vec![vec![vec![0; num_experts]; window_steps]; num_layers],
            totals: vec![vec![0; num_experts]; num_layers],
            next: 0,
        }
    }

    /// Adds a step (tokens per expert, per layer), dropping the step that falls out.
    pub fn record(&mut self, tokens_per_expert: &[Vec<u64>]) -> Result<(), EplbError> {
        if tokens_per_expert.len() != self.ring.len() {
            return Err(EplbError::LayerCount {
                got: tokens_per_expert.len(),
                want: self.ring.len(),
            });
        }
        for (layer, counts) in tokens_per_expert.iter().enumerate() {
            if counts.len() != self.num_experts {
                return Err(EplbError::LoadShape {
                    layer,
                    got: counts.len(),
                    want: self.num_experts,
                });
            }
        }
        for (layer, counts) in tokens_per_expert.iter().enumerate() {
            let slot = &mut self.ring[layer][self.next];
            for ((total, old), &new) in self.totals[layer]
                .iter_mut()
                .zip(slot.iter_mut())
                .zip(counts)
            {
                *total = *total - *old + new;
                *old = new;
            }
        }
        self.next = (self.next + 1) % self.window_steps;
        Ok(())
    }

    /// Tokens per expert of `layer` over the window.
    pub fn totals(&self, layer: usize) -> &[u64] {
        &self.totals[layer]
    }

    /// `totals` as the loads placement weighs.
    pub fn load(&self, layer: usize) -> Vec<f64> {
        self.totals[layer].iter().map(|&t| t as f64).collect()
    }
}
