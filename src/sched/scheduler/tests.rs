//! Scheduler scenarios, driven through the fake device of `sim.rs` and compared with
//! one-request-at-a-time reference outputs.

use crate::sched::{FinishReason, RowInput};
use std::collections::VecDeque;

use super::sim::*;
use super::*;

#[test]
fn add_rejects_requests_that_can_never_run() {
    let cfg = small_cfg();
    let mut small_pool = Scheduler::new(SchedulerConfig {
        num_blocks: 50,
        ..cfg.clone()
    });
    let err = small_pool.add(req(1, prompt(1, 200), 100)).unwrap_err();
    assert!(matches!(
        err,
        SchedError::NeverFits {
            seq_id: 1,
            num_blocks_needed: 64,
            num_blocks_total: 50
        }
    ));
    assert!(err.to_string().contains("request 1") && err.to_string().contains("64"));
    let mut s = Scheduler::new(cfg.clone());
    assert!(matches!(
        s.add(req(2, prompt(1, 256), 1)),
        Err(SchedError::PromptTooLong {
            seq_id: 2,
            num_prompt_tokens: 256,
            max_context_tokens: 256
        })
    ));
    assert!(matches!(
        s.add(req(3, vec![], 1)),
        Err(SchedError::EmptyPrompt { seq_id: 3 })
    ));
    assert!(matches!(
        s.add(req(4, vec![1], 0)),
        Err(SchedError::ZeroMaxTokens { seq_id: 4 })
    ));
    s.add(req(5, prompt(1, 10), 5)).unwrap();
    assert!(matches!(
        s.add(req(5, prompt(1, 10), 5)),
        Err(SchedError::DuplicateId { seq_id: 5 })
    ));
    let mut no_slots = Scheduler::new(SchedulerConfig {
        num_state_slots: Some(0),
        ..cfg
    });
    assert!(matches!(
        no_slots.add(req(6, vec![1], 1)),
        Err(SchedError::NoStateSlots { seq_id: 6 })
    ));
    // Exactly fits: 255 KV positions of a 256-token context in 64 blocks of 4.
    assert!(s.add(req(7, prompt(2, 200), 56)).is_ok());
}

#[test]
fn admission_takes_blocks_and_slot_together_or_nothing() {
    let cfg = SchedulerConfig {
        num_state_slots: Some(1),
        ..small_cfg()
    };
    let mut s = Scheduler::new(cfg.clone());
    s.add(req(1, prompt(1, 8), 4)).unwrap();
    s.add(req(2, prompt(2, 8), 4)).unwrap();
    let plan = s.schedule().unwrap();
    assert_eq!(plan.rows.len(), 1, "second request has no slot");
    assert_eq!(plan.rows[0].state_slot, Some(0));
    assert_eq!(
        s.num_free_blocks(),
        62,
        "no blocks taken for the slot-less request"
    );
    assert_eq!((s.num_running(), s.num_waiting()), (1, 1));

    // Blocks short, slot free: the slot must stay free.
    let cfg = SchedulerConfig {
        num_blocks: 4,
        num_state_slots: Some(2),
        ..small_cfg()
    };
    let mut s = Scheduler::new(cfg.clone());
    s.add(req(1, prompt(1, 12), 1)).unwrap();
    s.add(req(2, prompt(2, 12), 1)).unwrap();
    let plan = s.schedule().unwrap();
    assert_eq!(plan.rows.len(), 1);
    assert_eq!(
        (s.num_free_blocks(), s.num_free_state_slots()),
        (1, Some(1))
    );
    let mut dev = Device::new(&cfg);
    let sampled = dev.execute(&plan);
    s.on_step_done(plan.step_id, &sampled, 0.01);
    let out = drive(&mut s, &mut dev, 1, |_, _, _| {});
    assert!(out.0.contains_key(&2));
    assert_idle_and_full(&s);
}

#[test]
fn prefix_hits_across_requests_and_salt_separates() {
    let cfg = small_cfg();
    let mut s = Scheduler::new(cfg.clone());
    let mut dev = Device::new(&cfg);
    let a = req(1, prompt(1, 10), 3);
    s.add(a.clone()).unwrap();
    let mut out = drive(&mut s, &mut dev, 1, |_, _, _| {});
    // Same first 8 tokens (two full blocks), different tail.
    let mut b = req(2, prompt(1, 8), 3);
    b.prompt_ids.extend([5, 6, 7]);
    let mut c = b.clone();
    c.seq_id = 3;
    c.cache_salt = 9;
    for r in [&b, &c] {
        s.add(r.clone()).unwrap();
    }
    let plan = s.schedule().unwrap();
    assert_eq!(plan.rows[0].num_cached_tokens, 8, "b reuses a's two blocks");
    assert_eq!(plan.rows[0].input, RowInput::Tokens(vec![5, 6, 7]));
    assert_eq!(
        plan.rows[1].num_cached_tokens, 0,
        "another salt shares nothing"
    );
    assert_eq!(
        s.prefix_cache_stats(),
        PrefixCacheStats {
            num_queried_blocks: 2 + 2 + 2,
            num_hit_blocks: 2
        }
    );
    let sampled = dev.execute(&plan);
    out.apply(s.on_step_done(plan.step_id, &sampled, 0.01));
    out.merge(drive(&mut s, &mut dev, 1, |_, _, _| {}));
    expect_reference(&out, &[a, b, c], &cfg);

    // A prompt of exactly two blocks matches only one: its last token must be computed.
    let d = req(4, prompt(1, 8), 1);
    s.add(d).unwrap();
    assert_eq!(s.schedule().unwrap().rows[0].num_cached_tokens, 4);
}

#[test]
fn a_prefix_hit_with_state_slots_replays_the_tokens_before_it() {
    let cfg = SchedulerConfig {
        num_state_slots: Some(2),
        num_replay_tokens: 6,
        ..small_cfg()
    };
    let mut s = Scheduler::new(cfg.clone());
    let mut dev = Device::new(&cfg);
    let a = req(1, prompt(1, 18), 3);
    s.add(a.clone()).unwrap();
    let mut out = drive(&mut s, &mut dev, 1, |_, _, _| {});
    let free_before = s.num_free_blocks();
    // Four full blocks (16 tokens) hit; the replay starts 6 tokens before them.
    let mut b = req(2, prompt(1, 16), 3);
    b.prompt_ids.extend([5, 6, 7]);
    s.add(b.clone()).unwrap();
    let plan = s.schedule().unwrap();
    let row = &plan.rows[0];
    assert_eq!(row.num_cached_tokens, 10);
    assert_eq!((row.state_start, row.replay_until), (10, 16));
    assert_eq!(row.input, RowInput::Tokens([&b.prompt_ids[10..]].concat()));
    assert_eq!(row.block_table.len(), 5);
    // The four hit blocks leave the evictable pool; one block is new.
    assert_eq!(free_before - s.num_free_blocks(), 5);
    let sampled = dev.execute(&plan);
    out.apply(s.on_step_done(plan.step_id, &sampled, 0.01));
    out.merge(drive(&mut s, &mut dev, 1, |_, _, _| {}));
    expect_reference(&out, &[a, b], &cfg);
}

#[test]
fn evicts_least_recently_released_cached_blocks_first() {
    // 6 blocks of 4; three finished requests leave 2 cached blocks each.
    let cfg = SchedulerConfig {
        num_blocks: 6,
        ..small_cfg()
    };
    let mut s = Scheduler::new(cfg.clone());
    let mut dev = Device::new(&cfg);
    for id in 1..=3 {
        s.add(req(id, prompt(id as u32, 8), 1)).unwrap();
        drive(&mut s, &mut dev, 1, |_, _, _| {});
    }
    let num_cached_blocks = |s: &Scheduler, id: u32| {
        let mut hits = Vec::new();
        s.prefix_cache
            .match_prefix(&prompt(id, 8), 0, usize::MAX, &mut hits);
        hits.len()
    };
    // A new 8-token prompt needs 2 blocks: it evicts request 1's (released first).
    s.add(req(4, prompt(4, 8), 1)).unwrap();
    drive(&mut s, &mut dev, 1, |_, _, _| {});
    let cached: Vec<usize> = (1..=4).map(|id| num_cached_blocks(&s, id)).collect();
    assert_eq!(cached, vec![0, 2, 2, 2]);
    // One more block: request 2's tail block goes (tail blocks are released first).
    s.add(req(5, prompt(5, 4), 1)).unwrap();
    drive(&mut s, &mut dev, 1, |_, _, _| {});
    let cached: Vec<usize> = (1..=4).map(|id| num_cached_blocks(&s, id)).collect();
    assert_eq!(cached, vec![0, 1, 2, 2]);
    assert_idle_and_full(&s);
}

#[test]
fn each_step_mixes_decode_rows_and_prefill_chunks() {
    let cfg = small_cfg();
    let mut s = Scheduler::new(cfg.clone());
    let mut dev = Device::new(&cfg);
    s.add(req(1, prompt(1, 6), 10)).unwrap();
    let plan = s.schedule().unwrap();
    let sampled = dev.execute(&plan);
    s.on_step_done(plan.step_id, &sampled, 0.01);
    s.add(req(2, prompt(2, 5), 10)).unwrap();
    let plan = s.schedule().unwrap();
    let shape: Vec<(SeqId, usize, usize, bool)> = plan
        .rows
        .iter()
        .map(|r| (r.seq_id, r.num_tokens(), r.num_cached_tokens, r.sample))
        .collect();
    assert_eq!(shape, vec![(1, 1, 6, true), (2, 5, 0, true)]);
    assert_eq!(plan.rows[0].input, RowInput::Tokens(vec![sampled[0]]));
}

#[test]
fn chunked_prefill_follows_the_cost_model_budget() {
    // 1 ms per token, nothing else: a 10.5 ms budget fits 10 tokens.
    let cfg = SchedulerConfig {
        step_time_budget_secs: 0.0105,
        ..small_cfg()
    };
    let model = CostModel::with_prior([0.0, 1e-3, 0.0, 0.0]);
    let mut s = Scheduler::new(cfg.clone()).with_cost_model(model);
    let mut dev = Device::new(&cfg);
    let p = prompt(3, 35);
    s.add(req(1, p.clone(), 2)).unwrap();
    // The prefill work ahead (what a router balances by) falls chunk by chunk.
    assert_eq!(s.num_queued_prefill_tokens(), p.len());
    let mut shapes = Vec::new();
    let mut outputs = Outputs::default();
    while let Some(plan) = s.schedule() {
        let r = &plan.rows[0];
        let computed = (r.num_cached_tokens + r.num_tokens()).min(p.len());
        shapes.push((
            r.num_cached_tokens,
            r.num_tokens(),
            r.block_table.len(),
            r.sample,
        ));
        if let RowInput::Tokens(t) = &r.input
            && r.num_cached_tokens < p.len()
        {
            assert_eq!(t[..], p[r.num_cached_tokens..r.num_cached_tokens + t.len()]);
        }
        let sampled = dev.execute(&plan);
        // Measured = predicted: the refit keeps the same coefficients.
        outputs.apply(s.on_step_done(plan.step_id, &sampled, r.num_tokens() as f64 * 1e-3));
        assert_eq!(s.num_queued_prefill_tokens(), p.len() - computed);
    }
    assert_eq!(
        shapes,
        vec![
            (0, 10, 3, false),
            (10, 10, 5, false),
            (20, 10, 8, false),
            (30, 5, 9, true),
            (35, 1, 9, true)
        ]
    );
    expect_reference(&outputs, &[req(1, p, 2)], &cfg);
}

#[test]
fn preemption_picks_the_newest_and_recompute_gives_the_same_tokens() {
    // 8 blocks of 4 = 32 positions; three requests growing to 6 + 10 tokens each.
    let cfg = SchedulerConfig {
        num_blocks: 8,
        ..small_cfg()
    };
    let reqs: Vec<SeqRequest> = (1..=3)
        .map(|id| SeqRequest {
            ignore_eos: true,
            ..req(id, prompt(id as u32, 6), 10)
        })
        .collect();
    let mut s = Scheduler::new(cfg.clone());
    let mut dev = Device::new(&cfg);
    for r in &reqs {
        s.add(r.clone()).unwrap();
    }
    let mut first_preempted = None;
    let out = drive(&mut s, &mut dev, 1, |s, _, _| {
        if first_preempted.is_none() && s.num_waiting() > 0 && s.num_running() == 2 {
            first_preempted = s.waiting.front().map(|&i| s.seq(i).seq_id);
        }
    });
    assert_eq!(
        first_preempted,
        Some(3),
        "LCFS: the last admitted is the victim"
    );
    expect_reference(&out, &reqs, &cfg);
    assert_idle_and_full(&s);
}

#[test]
fn stop_preempted_ends_the_victim_instead_of_recomputing_it() {
    let cfg = SchedulerConfig {
        num_blocks: 8,
        stop_preempted: true,
        ..small_cfg()
    };
    let reqs: Vec<SeqRequest> = (1..=3)
        .map(|id| SeqRequest {
            ignore_eos: true,
            ..req(id, prompt(id as u32, 6), 10)
        })
        .collect();
    let mut s = Scheduler::new(cfg.clone());
    let mut dev = Device::new(&cfg);
    for r in &reqs {
        s.add(r.clone()).unwrap();
    }
    let out = drive(&mut s, &mut dev, 1, |_, _, _| {});
    assert_eq!(s.num_preemptions(), 1);
    let (victim_tokens, victim_reason) = &out.0[&3];
    assert_eq!(*victim_reason, Some(FinishReason::Preempted));
    let (want, _) = reference(&reqs[2], cfg.max_context_tokens);
    assert!(
        want.starts_with(victim_tokens),
        "the victim's tokens so far are still right"
    );
    assert!(victim_tokens.len() < want.len());
    for r in &reqs[..2] {
        let (want, reason) = reference(r, cfg.max_context_tokens);
        assert_eq!(
            out.0[&r.seq_id],
            (want, Some(reason)),
            "survivors are untouched"
        );
    }
    assert_idle_and_full(&s);
}

fn mixed_requests(n: u64) -> Vec<SeqRequest> {
    (0..n)
        .map(|id| {
            // Every third request shares a 12-token prefix with request 0.
            let mut p = prompt(if id % 3 == 0 { 0 } else { id as u32 }, 12);
            p.extend(prompt(100 + id as u32, (id as usize * 5) % 17));
            req(id, p, 3 + (id as usize * 7) % 20)
        })
        .collect()
}

#[test]
fn zos_on_and_off_give_identical_outputs() {
    let cfg = SchedulerConfig {
        num_blocks: 40,
        max_step_tokens: 48,
        ..small_cfg()
    };
    let reqs = mixed_requests(24);
    let mut runs = Vec::new();
    for depth in [1, 2] {
        let mut s = Scheduler::new(cfg.clone());
        let mut dev = Device::new(&cfg);
        for r in &reqs {
            s.add(r.clone()).unwrap();
        }
        runs.push((
            drive(&mut s, &mut dev, depth, |_, _, _| {}),
            dev.num_from_previous,
        ));
        assert!(
            s.num_preemptions() > 0,
            "the pool is small enough to preempt"
        );
        assert_idle_and_full(&s);
    }
    assert_eq!(runs[0].1, 0, "ZOS off never reads a previous step's token");
    assert!(runs[1].1 > 0, "ZOS on chains decode rows");
    assert_eq!(runs[0].0, runs[1].0);
    expect_reference(&runs[1].0, &reqs, &cfg);
}

#[test]
fn abort_in_flight_releases_everything_after_the_steps_finish() {
    let cfg = small_cfg();
    let mut s = Scheduler::new(cfg.clone());
    let mut dev = Device::new(&cfg);
    s.add(req(1, prompt(1, 9), 50)).unwrap();
    s.add(SeqRequest {
        ignore_eos: true,
        ..req(2, prompt(2, 9), 50)
    })
    .unwrap();
    let p0 = s.schedule().unwrap();
    let p1 = s.schedule().unwrap();
    assert!(matches!(
        p1.rows[0].input,
        RowInput::FromPrevious {
            prev_step: 0,
            prev_row: 0,
            ..
        }
    ));
    assert!(s.abort(1));
    assert!(!s.abort(1), "already aborted");
    assert!(!s.abort(99), "unknown");
    let held = cfg.num_blocks - s.num_free_blocks();
    assert!(
        held >= 3,
        "request 1's blocks are still read by steps 0 and 1"
    );
    let mut out = Outputs::default();
    for plan in [p0, p1] {
        let sampled = dev.execute(&plan);
        out.apply(s.on_step_done(plan.step_id, &sampled, 0.01));
    }
    assert!(
        !out.0.contains_key(&1),
        "nothing emitted for an aborted request"
    );
    assert!(s.abort(2));
    assert!(s.schedule().is_none());
    assert_idle_and_full(&s);
}

#[test]
fn device_reset_then_continuing_gives_the_same_outputs() {
    let cfg = SchedulerConfig {
        num_blocks: 40,
        max_step_tokens: 48,
        ..small_cfg()
    };
    let reqs = mixed_requests(16);
    let mut s = Scheduler::new(cfg.clone());
    let mut dev = Device::new(&cfg);
    for r in &reqs {
        s.add(r.clone()).unwrap();
    }
    let mut stale = Vec::new();
    let out = drive(&mut s, &mut dev, 2, |s, tick, queue| {
        if tick == 17 || tick == 40 {
            stale.extend(queue.drain(..).map(|p| p.step_id));
            s.reset_device_state();
            assert_eq!(s.num_free_blocks(), cfg.num_blocks);
            assert_eq!(s.num_running(), 0);
        }
    });
    assert!(!stale.is_empty());
    for step_id in stale {
        assert!(
            s.on_step_done(step_id, &[1, 2, 3], 0.01).is_empty(),
            "stale step ignored"
        );
    }
    expect_reference(&out, &reqs, &cfg);
    assert_idle_and_full(&s);
}

#[test]
fn random_requests_and_aborts_all_end_and_pools_refill() {
    let cfg = SchedulerConfig {
        num_blocks: 48,
        num_state_slots: Some(12),
        max_num_seqs: 16,
        max_step_tokens: 64,
        max_context_tokens: 96,
        ..small_cfg()
    };
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = move |m: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % m
    };
    let reqs: Vec<SeqRequest> = (0..200)
        .map(|id| {
            let shared = next(3) == 0;
            let mut p = prompt(
                if shared { 7 } else { id as u32 + 1 },
                1 + next(40) as usize,
            );
            p.extend(prompt(500 + id as u32, next(10) as usize));
            SeqRequest {
                cache_salt: next(2),
                ignore_eos: next(4) == 0,
                ..req(id, p, 1 + next(60) as usize)
            }
        })
        .collect();
    let aborts: Vec<(usize, SeqId)> = (0..40).map(|_| (next(600) as usize, next(200))).collect();
    let mut s = Scheduler::new(cfg.clone());
    let mut dev = Device::new(&cfg);
    let mut pending: VecDeque<SeqRequest> = reqs.iter().cloned().collect();
    let mut aborted = Vec::new();
    let depth = 2;
    let out = drive(&mut s, &mut dev, depth, |s, tick, _| {
        // Requests trickle in, a few per tick.
        for _ in 0..(tick % 3) {
            if let Some(r) = pending.pop_front() {
                s.add(r).unwrap();
            }
        }
        for &(_, id) in aborts.iter().filter(|(t, _)| *t == tick) {
            if s.abort(id) {
                aborted.push(id);
            }
        }
        s.check_block_integrity();
        if !pending.is_empty() && !s.has_unfinished() {
            s.add(pending.pop_front().unwrap()).unwrap();
        }
    });
    assert!(pending.is_empty());
    for r in &reqs {
        let (tokens, reason) = reference(r, cfg.max_context_tokens);
        let got = out.0.get(&r.seq_id);
        if aborted.contains(&r.seq_id) {
            let (got_tokens, got_reason) = got.cloned().unwrap_or_default();
            assert!(got_reason.is_none() || got_reason == Some(reason));
            assert_eq!(
                got_tokens[..],
                tokens[..got_tokens.len()],
                "aborted {}",
                r.seq_id
            );
        } else {
            assert_eq!(got, Some(&(tokens, Some(reason))), "request {}", r.seq_id);
        }
    }
    assert!(!aborted.is_empty());
    assert!(s.prefix_cache_stats().num_hit_blocks > 0);
    assert!(s.num_preemptions() > 0);
    assert_idle_and_full(&s);
}
