use super::*;

/// Zipf-skewed loads over `n` experts, the hottest at a rotating position per layer.
fn zipf(n: usize, s: f64, layer: usize, tokens: f64) -> Vec<u64> {
    let h: f64 = (1..=n).map(|k| 1.0 / (k as f64).powf(s)).sum();
    (0..n)
        .map(|e| {
            let rank = (e + n - (layer * 7) % n) % n + 1;
            (tokens / (rank as f64).powf(s) / h).round() as u64
        })
        .collect()
}

fn config() -> EplbConfig {
    EplbConfig {
        num_layers: 4,
        num_logical_experts: 64,
        num_redundant_experts: 16,
        num_ranks: 8,
        window_steps: 32,
        period_steps: 100,
    }
}

fn check_invariants(p: &LayerPlacement, num_logical: usize, num_physical: usize, num_ranks: usize) {
    assert_eq!(p.physical_to_logical.len(), num_physical);
    assert_eq!(p.slots_per_rank * num_ranks, num_physical);
    let replicas = p.num_replicas(num_logical);
    assert!(
        replicas.iter().all(|&r| r >= 1),
        "an expert has no slot: {replicas:?}"
    );
    for rank in 0..num_ranks {
        let held = &p.physical_to_logical[rank * p.slots_per_rank..(rank + 1) * p.slots_per_rank];
        let mut unique = held.to_vec();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(
            unique.len(),
            held.len(),
            "rank {rank} holds an expert twice: {held:?}"
        );
    }
}

#[test]
fn every_expert_is_placed_once_per_rank_at_most_and_capacity_is_exact() {
    for (num_logical, redundant, ranks) in [(64, 16, 8), (8, 0, 2), (10, 2, 4), (3, 5, 4)] {
        let load: Vec<f64> = zipf(num_logical, 1.3, 0, 1e5)
            .iter()
            .map(|&t| t as f64)
            .collect();
        let p = place_layer(&load, num_logical + redundant, ranks);
        check_invariants(&p, num_logical, num_logical + redundant, ranks);
        // Slots of an expert are where the map says.
        for e in 0..num_logical {
            for slot in p.slots_of(e) {
                assert_eq!(p.physical_to_logical[slot], e);
            }
        }
    }
}

#[test]
fn hot_experts_get_the_replicas_and_placement_is_deterministic() {
    let load: Vec<f64> = (0..16).map(|e| if e == 5 { 100.0 } else { 1.0 }).collect();
    let a = place_layer(&load, 20, 4);
    let b = place_layer(&load, 20, 4);
    assert_eq!(a, b);
    let replicas = a.num_replicas(16);
    // Four extra slots, one replica per rank at most: expert 5 on every rank.
    assert_eq!(replicas[5], 4, "{replicas:?}");
    assert_eq!(replicas.iter().sum::<usize>(), 20);
}

#[test]
fn skewed_loads_fall_from_unbalanced_to_within_ten_percent_after_a_rebalance() {
    let cfg = config();
    let mut eplb = Eplb::new(cfg).unwrap();
    let step_loads: Vec<Vec<u64>> = (0..cfg.num_layers)
        .map(|l| zipf(64, 1.0, l, 4096.0))
        .collect();
    // Until the first rebalance (a quarter period), the static placement serves the skew.
    let mut first = None;
    for step in 1..=cfg.period_steps {
        let before = eplb.moe_lb();
        if eplb.on_step(&step_loads, false).unwrap() {
            first = Some((step, before));
            break;
        }
    }
    let (step, before) = first.expect("a rebalance within the first period");
    assert_eq!(step, cfg.period_steps / 4);
    let unbalanced = before.iter().cloned().fold(0.0, f64::max);
    assert!(
        unbalanced > 1.5,
        "the static placement was already even: {before:?}"
    );
    let after = eplb.moe_lb();
    for (layer, lb) in after.iter().enumerate() {
        assert!(
            *lb <= 1.10,
            "layer {layer}: moe_lb {lb} after the rebalance (before {})",
            before[layer]
        );
    }
    for p in eplb.placements() {
        check_invariants(p, 64, 80, 8);
    }
}

#[test]
fn rebalances_come_every_period_after_the_first_quarter_and_wait_for_prefills() {
    let mut clock = RebalanceClock::new(100);
    let due: Vec<u64> = (1..=260).filter(|_| clock.tick(false)).collect::<Vec<_>>();
    assert_eq!(due, vec![25, 125, 225]);
    let mut clock = RebalanceClock::new(100);
    let mut fired = Vec::new();
    for step in 1..=140u64 {
        // A prefill runs on steps 20..=40: the rebalance due at 25 waits until 41.
        if clock.tick((20..=40).contains(&step)) {
            fired.push(step);
        }
    }
    assert_eq!(fired, vec![41]);
}

#[test]
fn the_window_forgets_old_steps() {
    let mut w = LoadWindow::new(1, 3, 2);
    w.record(&[vec![1, 0, 0]]).unwrap();
    w.record(&[vec![0, 5, 0]]).unwrap();
    assert_eq!(w.totals(0), &[1, 5, 0]);
    w.record(&[vec![0, 0, 7]]).unwrap();
    assert_eq!(w.totals(0), &[0, 5, 7]);
}

#[test]
fn bad_shapes_are_named() {
    let mut cfg = config();
    cfg.num_redundant_experts = 3;
    let e = Eplb::new(cfg).err().unwrap().to_string();
    assert!(
        e.contains("67 physical experts") && e.contains("8 ranks"),
        "{e}"
    );
    let mut eplb = Eplb::new(config()).unwrap();
    let e = eplb
        .on_step(&vec![vec![0; 64]; 3], false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("3 layers") && e.contains("4 MoE layers"), "{e}");
    let e = eplb
        .on_step(&vec![vec![0; 60]; 4], false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("60 expert loads"), "{e}");
    assert_eq!(moe_lb(&[0.0, 0.0]), 1.0);
    assert!((moe_lb(&[3.0, 1.0]) - 1.5).abs() < 1e-12);
}

#[test]
fn a_rebalance_counts_the_replicas_it_moves_onto_ranks() {
    let (num_logical, num_ranks) = (6, 2);
    let uniform = place_layer(&[1.0; 6], 8, num_ranks);
    assert_eq!(uniform.num_moved_from(&uniform), 0);
    let mut rng = 17u64;
    for _ in 0..50 {
        let load: Vec<f64> = (0..num_logical)
            .map(|_| {
                rng = crate::sampling::splitmix64(rng);
                (rng % 1000) as f64
            })
            .collect();
        let p = place_layer(&load, 8, num_ranks);
        // Brute force: each (rank, expert) pair held after and not before.
        let holds = |q: &LayerPlacement, rank: usize, e: usize| {
            q.slots_of(e).iter().any(|&s| q.rank_of_slot(s) == rank)
        };
        let moved = (0..num_ranks)
            .flat_map(|r| (0..num_logical).map(move |e| (r, e)))
            .filter(|&(r, e)| holds(&p, r, e) && !holds(&uniform, r, e))
            .count();
        assert_eq!(p.num_moved_from(&uniform), moved, "{load:?}");
    }
}
