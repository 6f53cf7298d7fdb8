//! Expert parallelism for DeepSeek-V4's MoE layers on a group of ranks. Every rank runs
//! attention, the router and the mHC mixing for all tokens (the same numbers everywhere);
//! each routed (expert, token) product is computed by exactly one rank — the one holding
//! the expert's replica that the token falls to — and the shared expert by the leader; a
//! sum over the group then gives every rank the layer's whole output. With EPLB placing
//! experts for this group (`--eplb-ranks` equal to the group size), ownership follows its
//! placement, so a rebalance moves work between ranks at the same step on every rank (each
//! rank sees the same routed loads and computes the same placement).

use crate::eplb::LayerPlacement;
use crate::kernels::Backend;
use crate::kernels::collective::Collective;
use crate::kernels::cpu::CpuBackend;
use crate::model::tensor_parallel::TpShard;

/// Which routed products a rank computes.
#[derive(Debug, Clone)]
pub struct ExpertShard {
    pub shard: TpShard,
    /// Per layer, EPLB's placement over this group's ranks; `None`: expert `e` of `E` on
    /// rank `e · size / E` (contiguous equal shares).
    pub placements: Option<Vec<LayerPlacement>>,
}

impl ExpertShard {
    /// Whether this rank computes routed expert `expert` (of `num_experts`) for the step's
    /// token `token` at `layer`. A token of a replicated expert goes to replica
    /// `token % replicas`, so the replicas split the expert's tokens.
    pub fn computes(&self, layer: usize, num_experts: usize, expert: usize, token: usize) -> bool {
        let rank = match &self.placements {
            Some(p) => {
                let slots = p[layer].slots_of(expert);
                p[layer].rank_of_slot(slots[token % slots.len()])
            }
            None => expert * self.shard.size / num_experts,
        };
        rank == self.shard.rank
    }

    /// Whether this rank holds routed expert `expert` (of `num_experts`) at `layer`: it
    /// computes some of its tokens (`residency.rs` loads exactly these).
    pub fn holds(&self, layer: usize, num_experts: usize, expert: usize) -> bool {
        match &self.placements {
            Some(p) => p[layer]
                .slots_of(expert)
                .into_iter()
                .any(|slot| p[layer].rank_of_slot(slot) == self.shard.rank),
            None => expert * self.shard.size / num_experts == self.shard.rank,
        }
    }

    /// `computes` at `layer` as the table the kernels read (`ExpertOwners`): per expert its
    /// replica count, then each replica's rank, padded to the widest (returned second).
    pub fn owner_table(&self, layer: usize, num_experts: usize) -> (Vec<u32>, usize) {
        let ranks: Vec<Vec<u32>> = (0..num_experts)
            .map(|e| match &self.placements {
                Some(p) => p[layer]
                    .slots_of(e)
                    .into_iter()
                    .map(|slot| p[layer].rank_of_slot(slot) as u32)
                    .collect(),
                None => vec![(e * self.shard.size / num_experts) as u32],
            })
            .collect();
        let replicas = ranks.iter().map(Vec::len).max().unwrap_or(1).max(1);
        let mut table = Vec::with_capacity(num_experts * (1 + replicas));
        for r in &ranks {
            table.push(r.len() as u32);
            table.extend(r);
            table.resize(table.len() + replicas - r.len(), 0);
        }
        (table, replicas)
    }

    /// The shared expert runs on the leader only (it is summed like the routed ones).
    pub fn computes_shared(&self) -> bool {
        self.shard.is_leader()
    }
}

/// A rank's membership of an expert-parallel group.
pub struct ExpertGroup<B: Backend = CpuBackend> {
    pub shard: ExpertShard,
    pub collective: Box<dyn Collective<B>>,
    /// Seconds spent in `combine` so far: waiting for the slowest rank, mostly.
    pub combine_secs: f64,
}

impl<B: Backend> ExpertGroup<B> {
    pub fn new(shard: ExpertShard, collective: Box<dyn Collective<B>>) -> Self {
        ExpertGroup {
            shard,
            collective,
            combine_secs: 0.0,
        }
    }

    /// Sums the ranks' partial MoE outputs (`len` values) in place.
    pub fn combine(&mut self, b: &B, partial: &mut B::Buf, len: usize) {
        let started = std::time::Instant::now();
        self.collective.all_reduce_sum(b, partial, len);
        self.combine_secs += started.elapsed().as_secs_f64();
    }
}

/// Why `num_experts` routed experts cannot split over `size` ranks, or `None`.
pub fn ep_problem(num_experts: usize, size: usize) -> Option<String> {
    if size == 0 {
        return Some("expert parallel size must be at least 1".into());
    }
    (!num_experts.is_multiple_of(size)).then(|| {
        format!(
            "expert parallel size {size} does not divide the model's {num_experts} routed experts"
        )
    })
}

/// The largest expert-parallel group on at most `num_devices` devices.
pub fn largest_valid_ep(num_experts: usize, num_devices: usize) -> Option<usize> {
    (1..=num_devices)
        .rev()
        .find(|&size| ep_problem(num_experts, size).is_none())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eplb::place_layer;

    #[test]
    fn every_routed_product_has_exactly_one_rank() {
        let loads = [9.0, 1.0, 1.0, 1.0, 5.0, 1.0];
        for placements in [None, Some(vec![place_layer(&loads, 8, 2)])] {
            let shards: Vec<ExpertShard> = (0..2)
                .map(|rank| ExpertShard {
                    shard: TpShard { rank, size: 2 },
                    placements: placements.clone(),
                })
                .collect();
            for expert in 0..6 {
                for token in 0..10 {
                    let owners = shards
                        .iter()
                        .filter(|s| s.computes(0, 6, expert, token))
                        .count();
                    assert_eq!(owners, 1, "expert {expert}, token {token}");
                }
            }
            assert_eq!(shards.iter().filter(|s| s.computes_shared()).count(), 1);
            // The kernels' table says what `computes` says.
            for s in &shards {
                let (table, replicas) = s.owner_table(0, 6);
                for expert in 0..6 {
                    let entry = &table[expert * (1 + replicas)..(expert + 1) * (1 + replicas)];
                    for token in 0..10 {
                        let rank = entry[1 + token % entry[0] as usize] as usize;
                        assert_eq!(rank == s.shard.rank, s.computes(0, 6, expert, token));
                    }
                    // A rank holds the experts it computes some token of, and no other.
                    let computes_any = (0..10).any(|t| s.computes(0, 6, expert, t));
                    assert_eq!(s.holds(0, 6, expert), computes_any, "expert {expert}");
                }
            }
        }
        // The hot expert 0 has replicas on both ranks: its tokens are split between them.
        let p = place_layer(&loads, 8, 2);
        let shard = |rank| ExpertShard {
            shard: TpShard { rank, size: 2 },
            placements: Some(vec![p.clone()]),
        };
        assert!(p.slots_of(0).len() > 1, "{p:?}");
        assert!((0..10).any(|t| shard(0).computes(0, 6, 0, t)));
        assert!((0..10).any(|t| shard(1).computes(0, 6, 0, t)));
    }

    #[test]
    fn group_sizes_divide_the_routed_experts() {
        assert_eq!(ep_problem(6, 3), None);
        assert!(ep_problem(6, 4).unwrap().contains("6 routed experts"));
        assert!(ep_problem(6, 0).is_some());
        assert_eq!(largest_valid_ep(6, 5), Some(3));
        assert_eq!(largest_valid_ep(4, 3), Some(2));
        assert_eq!(largest_valid_ep(4, 0), None);
    }
}
