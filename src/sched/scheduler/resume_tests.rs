//! Prefix hits of sequences with state slots resumed from saved states, on the fake
//! device of `sim.rs`, whose slots keep the last `num_replay_tokens` tokens they saw: a
//! sequence resumed without that window samples wrong tokens and fails the reference.

use std::collections::VecDeque;

use crate::sched::RowInput;

use super::sim::*;
use super::*;

fn state_cfg(num_saved_states: usize) -> SchedulerConfig {
    SchedulerConfig {
        num_state_slots: Some(2),
        num_replay_tokens: 6,
        num_saved_states,
        ..small_cfg()
    }
}

/// Runs `a` alone to the end, then admits `b` and returns its first plan.
fn after(
    s: &mut Scheduler,
    dev: &mut Device,
    a: &SeqRequest,
    b: &SeqRequest,
) -> (Outputs, StepPlan) {
    s.add(a.clone()).unwrap();
    let out = drive(s, dev, 1, |_, _, _| {});
    s.add(b.clone()).unwrap();
    (out, s.schedule().unwrap())
}

#[test]
fn a_hit_on_a_block_with_a_saved_state_resumes_there_with_no_replay() {
    let cfg = state_cfg(8);
    let mut s = Scheduler::new(cfg.clone());
    let mut dev = Device::new(&cfg);
    let a = req(1, prompt(1, 18), 3);
    // Four full blocks (16 tokens) hit, and the prompt's chunk ended at 16 to save there.
    let mut b = req(2, prompt(1, 16), 3);
    b.prompt_ids.extend([5, 6, 7]);
    let (mut out, plan) = after(&mut s, &mut dev, &a, &b);
    let row = &plan.rows[0];
    assert_eq!(row.num_cached_tokens, 16);
    assert_eq!((row.state_start, row.replay_until), (0, 16));
    assert_eq!(plan.state_loads.len(), 1);
    assert_eq!(plan.state_loads[0].position, 16);
    assert_eq!(row.input, RowInput::Tokens(b.prompt_ids[16..].to_vec()));
    let sampled = dev.execute(&plan);
    out.apply(s.on_step_done(plan.step_id, &sampled, 0.01));
    out.merge(drive(&mut s, &mut dev, 1, |_, _, _| {}));
    expect_reference(&out, &[a, b], &cfg);
    assert_eq!((s.num_resumed_hits(), s.num_replayed_hits()), (1, 0));
    assert_eq!(dev.num_state_loads, 1);
    assert_idle_and_full(&s);
}

#[test]
fn without_saved_states_a_hit_replays() {
    let cfg = state_cfg(0);
    let mut s = Scheduler::new(cfg.clone());
    let mut dev = Device::new(&cfg);
    let a = req(1, prompt(1, 18), 3);
    let b = req(2, prompt(1, 18), 3);
    let (mut out, plan) = after(&mut s, &mut dev, &a, &b);
    let row = &plan.rows[0];
    assert_eq!((row.num_cached_tokens, row.state_start), (10, 10));
    assert!(plan.state_loads.is_empty() && plan.state_saves.is_empty());
    let sampled = dev.execute(&plan);
    out.apply(s.on_step_done(plan.step_id, &sampled, 0.01));
    out.merge(drive(&mut s, &mut dev, 1, |_, _, _| {}));
    expect_reference(&out, &[a, b], &cfg);
    assert_eq!((s.num_resumed_hits(), s.num_replayed_hits()), (0, 1));
}

#[test]
fn a_state_evicted_falls_back_to_an_earlier_one_within_the_replay_or_to_the_replay() {
    // One saved state: the last boundary a's rows ended at holds it (its decode passed 20).
    let cfg = state_cfg(1);
    let mut s = Scheduler::new(cfg.clone());
    let mut dev = Device::new(&cfg);
    let a = req(1, prompt(1, 18), 4);
    // b hits five blocks (20 tokens of a's prompt and output): the state at 20 is there.
    let mut b = req(2, prompt(1, 18), 1);
    let (mut out, _) = {
        s.add(a.clone()).unwrap();
        let out = drive(&mut s, &mut dev, 1, |_, _, _| {});
        (out, ())
    };
    let a_tokens = &out.0[&1].0;
    b.prompt_ids.extend_from_slice(&a_tokens[..3]);
    b.prompt_ids.push(9);
    s.add(b.clone()).unwrap();
    let plan = s.schedule().unwrap();
    assert_eq!(plan.rows[0].num_cached_tokens, 20);
    assert_eq!(plan.state_loads.len(), 1);
    let sampled = dev.execute(&plan);
    out.apply(s.on_step_done(plan.step_id, &sampled, 0.01));
    out.merge(drive(&mut s, &mut dev, 1, |_, _, _| {}));
    // c repeats a's prompt: 16 tokens hit, the one state is at 20 (past the hit) and 16's
    // was evicted: the replay.
    let c = req(3, prompt(1, 18), 2);
    s.add(c.clone()).unwrap();
    let plan = s.schedule().unwrap();
    assert_eq!(
        (plan.rows[0].num_cached_tokens, plan.rows[0].state_start),
        (10, 10)
    );
    let sampled = dev.execute(&plan);
    out.apply(s.on_step_done(plan.step_id, &sampled, 0.01));
    out.merge(drive(&mut s, &mut dev, 1, |_, _, _| {}));
    expect_reference(&out, &[a, b, c], &cfg);
    assert_eq!((s.num_resumed_hits(), s.num_replayed_hits()), (1, 1));
}

#[test]
fn random_requests_with_few_saved_states_match_the_reference() {
    // Shared prefixes, preemption, ZOS and a device reset, with fewer saved states
    // than boundaries: every resume (saved, replayed or from an earlier block) must give
    // the slot the window a cold run has.
    for (num_saved, reset_at) in [(3, None), (24, Some(40))] {
        let cfg = SchedulerConfig {
            num_blocks: 40,
            num_state_slots: Some(6),
            // Replays longer than a step: their chunks end inside them, where a state is
            // not yet exact and must not be saved.
            num_replay_tokens: 10,
            num_saved_states: num_saved,
            max_num_seqs: 8,
            max_step_tokens: 9,
            max_context_tokens: 96,
            ..small_cfg()
        };
        let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ num_saved as u64;
        let mut next = move |m: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % m
        };
        let reqs: Vec<SeqRequest> = (0..120)
            .map(|id| {
                let mut p = prompt(7 + next(2) as u32, 4 + next(40) as usize);
                p.extend(prompt(500 + id as u32, next(9) as usize));
                SeqRequest {
                    ignore_eos: true,
                    ..req(id, p, 1 + next(12) as usize)
                }
            })
            .collect();
        let mut s = Scheduler::new(cfg.clone());
        let mut dev = Device::new(&cfg);
        let mut pending: VecDeque<SeqRequest> = reqs.iter().cloned().collect();
        let out = drive(&mut s, &mut dev, 2, |s, tick, queue| {
            for _ in 0..(tick % 3) {
                if let Some(r) = pending.pop_front() {
                    s.add(r).unwrap();
                }
            }
            if Some(tick) == reset_at {
                queue.clear();
                s.reset_device_state();
                // Planned steps' rows are recomputed; their outputs never come.
            }
            if !pending.is_empty() && !s.has_unfinished() {
                s.add(pending.pop_front().unwrap()).unwrap();
            }
        });
        assert!(pending.is_empty());
        expect_reference(&out, &reqs, &cfg);
        assert!(s.num_resumed_hits() > 0, "{num_saved} states: no resume");
        assert!(s.num_replayed_hits() > 0, "{num_saved} states: no replay");
        assert!(dev.num_state_loads > 0);
        assert_idle_and_full(&s);
    }
}
