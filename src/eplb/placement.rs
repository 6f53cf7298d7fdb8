//! One layer's placement: how many replicas each logical expert gets and which rank holds
//! each replica. Replicas go, one at a time, to the expert with the most load per replica;
//! then replicas (heaviest first) go to the least loaded rank with a free slot that does
//! not hold that expert yet (the longest-processing-time rule). Ties break by lowest id,
//! so a placement is a function of the loads alone.

/// Physical slot `p` lives on rank `p / slots_per_rank` and holds logical expert
/// `physical_to_logical[p]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerPlacement {
    pub physical_to_logical: Vec<usize>,
    pub slots_per_rank: usize,
}

impl LayerPlacement {
    pub fn rank_of_slot(&self, slot: usize) -> usize {
        slot / self.slots_per_rank
    }

    /// Replicas of each logical expert.
    pub fn num_replicas(&self, num_logical: usize) -> Vec<usize> {
        let mut n = vec![0; num_logical];
        for &e in &self.physical_to_logical {
            n[e] += 1;
        }
        n
    }

    /// (rank, logical expert) pairs held under `self` and not under `before`: the
    /// replicas a rebalance from `before` moves onto ranks.
    pub fn num_moved_from(&self, before: &LayerPlacement) -> usize {
        let held = |p: &LayerPlacement| -> std::collections::BTreeSet<(usize, usize)> {
            let slots = p.physical_to_logical.iter().enumerate();
            slots.map(|(slot, &e)| (p.rank_of_slot(slot), e)).collect()
        };
        held(self).difference(&held(before)).count()
    }

    /// The physical slots of logical expert `logical`, lowest first (a token routed to it
    /// goes to one of them).
    pub fn slots_of(&self, logical: usize) -> Vec<usize> {
        (0..self.physical_to_logical.len())
            .filter(|&p| self.physical_to_logical[p] == logical)
            .collect()
    }
}

/// Places `load.len()` logical experts on `num_physical` slots over `num_ranks` ranks
/// (`num_physical` a multiple of `num_ranks`, at least the number of experts).
pub fn place_layer(load: &[f64], num_physical: usize, num_ranks: usize) -> LayerPlacement {
    let num_logical = load.len();
    assert!(
        num_physical >= num_logical && num_physical.is_multiple_of(num_ranks),
        "{num_physical} slots for {num_logical} experts over {num_ranks} ranks"
    );
    let slots_per_rank = num_physical / num_ranks;
    // A second replica on a rank that has one already relieves nobody: at most one per rank.
    let mut replicas = vec![1usize; num_logical];
    for _ in num_logical..num_physical {
        let hottest = (0..num_logical)
            .filter(|&e| replicas[e] < num_ranks)
            .max_by(|&a, &b| {
                let (la, lb) = (load[a] / replicas[a] as f64, load[b] / replicas[b] as f64);
                la.total_cmp(&lb).then(b.cmp(&a))
            })
            .unwrap_or(0);
        replicas[hottest] += 1;
    }
    let mut items: Vec<(f64, usize)> = (0..num_logical)
        .flat_map(|e| std::iter::repeat_n((load[e] / replicas[e] as f64, e), replicas[e]))
        .collect();
    items.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut rank_load = vec![0.0f64; num_ranks];
    let mut rank_experts: Vec<Vec<usize>> = vec![Vec::with_capacity(slots_per_rank); num_ranks];
    for (weight, e) in items {
        let pick = |avoid_duplicates: bool| {
            (0..num_ranks)
                .filter(|&r| rank_experts[r].len() < slots_per_rank)
                .filter(|&r| !avoid_duplicates || !rank_experts[r].contains(&e))
                .min_by(|&a, &b| rank_load[a].total_cmp(&rank_load[b]).then(a.cmp(&b)))
        };
        let rank = pick(true)
            .or_else(|| pick(false))
            .expect("slots are counted to hold every replica");
        rank_load[rank] += weight;
        rank_experts[rank].push(e);
    }
    LayerPlacement {
        physical_to_logical: rank_experts.into_iter().flatten().collect(),
        slots_per_rank,
    }
}

/// Each rank's load under `placement` when an expert's tokens split evenly over its
/// replicas.
pub fn rank_loads(placement: &LayerPlacement, load: &[f64], num_ranks: usize) -> Vec<f64> {
    let replicas = placement.num_replicas(load.len());
    let mut out = vec![0.0; num_ranks];
    for (slot, &e) in placement.physical_to_logical.iter().enumerate() {
        out[placement.rank_of_slot(slot)] += load[e] / replicas[e] as f64;
    }
    out
}
