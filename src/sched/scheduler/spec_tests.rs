//! Decode rows that carry prompt-lookup drafts, through the fake device of `sim.rs`, whose
//! "model" reads every position back through the block table: a rejected draft left in
//! the KV, or a position rolled back wrongly, changes the output.

use super::sim::*;
use super::*;
use crate::sched::{FinishReason, RowInput};

fn spec_cfg(num_speculative_tokens: usize) -> SchedulerConfig {
    SchedulerConfig {
        num_speculative_tokens,
        ..small_cfg()
    }
}

/// Runs `reqs` through a scheduler; returns outputs, steps run and drafts accepted.
fn run(cfg: &SchedulerConfig, reqs: &[SeqRequest], depth: usize) -> (Outputs, u64, usize) {
    let mut s = Scheduler::new(cfg.clone());
    let mut dev = Device::new(cfg);
    dev.next = predictable_next;
    for r in reqs {
        s.add(r.clone()).unwrap();
    }
    let out = drive(&mut s, &mut dev, depth, |_, _, _| {});
    assert_idle_and_full(&s);
    (out, s.next_step_id, dev.num_accepted)
}

fn requests() -> Vec<SeqRequest> {
    (1..=12u64)
        .map(|id| SeqRequest {
            ignore_eos: id % 3 == 0,
            ..req(
                id,
                prompt(id as u32, 3 + (id as usize * 5) % 17),
                10 + id as usize * 3,
            )
        })
        .collect()
}

#[test]
fn speculative_runs_equal_one_at_a_time_runs_with_fewer_steps() {
    let reqs = requests();
    for depth in [1, 2] {
        let (plain, plain_steps, _) = run(&spec_cfg(0), &reqs, depth);
        expect_reference_with(&plain, &reqs, &spec_cfg(0), predictable_next);
        for k in [1, 3, 5] {
            let cfg = spec_cfg(k);
            let (out, steps, accepted) = run(&cfg, &reqs, depth);
            expect_reference_with(&out, &reqs, &cfg, predictable_next);
            assert!(
                accepted > 0,
                "K = {k}, depth {depth}: no draft was accepted"
            );
            if depth == 1 {
                assert!(
                    steps < plain_steps,
                    "K = {k}: {steps} steps vs {plain_steps}"
                );
            }
        }
    }
}

#[test]
fn a_verify_row_carries_its_drafts_and_rolls_back_what_was_rejected() {
    let cfg = SchedulerConfig {
        block_size: 4,
        ..spec_cfg(3)
    };
    let mut s = Scheduler::new(cfg.clone());
    // A prompt that repeats: the last token (2) was followed by 3, 1, 2 before.
    s.add(SeqRequest {
        ignore_eos: true,
        ..req(1, vec![1, 2, 3, 1, 2], 20)
    })
    .unwrap();
    let prefill = s.schedule().unwrap();
    assert_eq!(prefill.rows[0].num_draft_tokens, 0);
    s.on_step_done(prefill.step_id, &[9], 0.01);
    // After 9 nothing matches: a plain decode row.
    let plain = s.schedule().unwrap();
    assert_eq!(plain.rows[0].num_draft_tokens, 0);
    assert_eq!(plain.rows[0].input, RowInput::Tokens(vec![9]));
    s.on_step_done(plain.step_id, &[1], 0.01);
    // History 1 2 3 1 2 9 1: "1" was last followed by "2 9 1" (latest occurrence first).
    let verify = s.schedule().unwrap();
    let row = &verify.rows[0];
    assert_eq!(row.input, RowInput::Tokens(vec![1, 2, 9, 1]));
    assert_eq!((row.num_draft_tokens, row.num_cached_tokens), (3, 6));
    // One draft accepted (2), then the target said 7.
    let events = s.on_step_verified(verify.step_id, &[&[2, 7]], 0.01);
    let tokens: Vec<u32> = events
        .iter()
        .filter_map(|e| match e {
            SeqEvent::Token { token, .. } => Some(*token),
            _ => None,
        })
        .collect();
    assert_eq!(tokens, vec![2, 7]);
    // Positions 6 (token 1) and 7 (draft 2) stay; the rejected drafts' are recomputed.
    let next = s.schedule().unwrap();
    assert_eq!(next.rows[0].num_cached_tokens, 8);
    assert!(matches!(&next.rows[0].input, RowInput::Tokens(t) if t[0] == 7));
}

#[test]
fn a_stop_inside_the_accepted_drafts_ends_the_request_there() {
    let cfg = spec_cfg(4);
    let mut s = Scheduler::new(cfg.clone());
    s.add(req(1, vec![5, 6, 7, 5, 6], 20)).unwrap();
    let prefill = s.schedule().unwrap();
    s.on_step_done(prefill.step_id, &[7], 0.01);
    let verify = s.schedule().unwrap();
    assert_eq!(verify.rows[0].input, RowInput::Tokens(vec![7, 5, 6, 7]));
    // Draft 5 accepted, then the stop token: 6 and 7 never reach the request.
    let events = s.on_step_verified(verify.step_id, &[&[5, STOP]], 0.01);
    assert_eq!(
        events,
        vec![
            SeqEvent::Token {
                seq_id: 1,
                token: 5
            },
            SeqEvent::Finished {
                seq_id: 1,
                reason: FinishReason::Stop
            }
        ]
    );
    assert_idle_and_full(&s);
}

/// Step seconds of the sim: 1 ms a step plus 0.1 ms a token, so that a draft unlikely to
/// be accepted costs more than it is expected to yield.
fn costly_tokens_secs(plan: &StepPlan) -> f64 {
    1e-3 + plan
        .rows
        .iter()
        .map(|r| r.num_tokens() as f64 * 1e-4)
        .sum::<f64>()
}

/// Like `run`, with step times from `costly_tokens_secs`; returns the drafts verified too.
fn run_costly(cfg: &SchedulerConfig, reqs: &[SeqRequest]) -> (Outputs, usize, usize) {
    let mut s = Scheduler::new(cfg.clone());
    let mut dev = Device::new(cfg);
    dev.next = predictable_next;
    for r in reqs {
        s.add(r.clone()).unwrap();
    }
    let mut outputs = Outputs::default();
    while let Some(plan) = s.schedule() {
        let sampled = dev.execute_verified(&plan);
        let rows: Vec<&[u32]> = sampled.iter().map(Vec::as_slice).collect();
        outputs.apply(s.on_step_verified(plan.step_id, &rows, costly_tokens_secs(&plan)));
    }
    assert!(!s.has_unfinished());
    assert_idle_and_full(&s);
    (outputs, dev.num_drafts, dev.num_accepted)
}

#[test]
fn confidence_scheduling_verifies_fewer_drafts_with_the_same_output() {
    let reqs = requests();
    let fixed = spec_cfg(5);
    let confidence = SchedulerConfig {
        confidence_verify: true,
        ..spec_cfg(5)
    };
    let (out_fixed, drafts_fixed, _) = run_costly(&fixed, &reqs);
    let (out_conf, drafts_conf, accepted_conf) = run_costly(&confidence, &reqs);
    expect_reference_with(&out_fixed, &reqs, &fixed, predictable_next);
    expect_reference_with(&out_conf, &reqs, &confidence, predictable_next);
    assert!(accepted_conf > 0, "confidence mode accepted no draft");
    assert!(
        drafts_conf < drafts_fixed,
        "confidence mode verified {drafts_conf} drafts, fixed {drafts_fixed}"
    );
}

/// Drafts verified for a decoding sequence in its third step, alone or beside a long
/// prompt still prefilling; step seconds from a per-token cost that dwarfs the fixed one.
fn drafts_in_third_step(long_prompt: Option<usize>) -> usize {
    let cfg = SchedulerConfig {
        confidence_verify: true,
        num_blocks: 256,
        max_step_tokens: 96,
        max_context_tokens: 512,
        ..spec_cfg(5)
    };
    let secs = |plan: &StepPlan| {
        1e-4 + 1e-3 * plan.rows.iter().map(|r| r.num_tokens()).sum::<usize>() as f64
    };
    let mut s = Scheduler::new(cfg).with_cost_model(CostModel::with_prior([1e-4, 1e-3, 0.0, 0.0]));
    // A drafter seen right many times before (an uncalibrated one verifies everything).
    for c in s.ngram_calibration.lock().unwrap().iter_mut() {
        (0..20).for_each(|_| c.observe(5, 5));
    }
    let looped = [1, 2, 3].repeat(4);
    s.add(SeqRequest {
        ignore_eos: true,
        ..req(1, looped[..11].to_vec(), 40)
    })
    .unwrap();
    let first = s.schedule().unwrap();
    s.on_step_done(first.step_id, &[3], secs(&first));
    if let Some(len) = long_prompt {
        s.add(req(2, prompt(9, len), 4)).unwrap();
    }
    // The target follows the loop: every draft of the second step is accepted.
    let second = s.schedule().unwrap();
    let tokens: Vec<Vec<u32>> = second
        .rows
        .iter()
        .filter(|r| r.sample)
        .map(|r| match (&r.input, r.seq_id) {
            (RowInput::Tokens(t), 1) => {
                let next = |tok: u32| tok % 3 + 1;
                t.iter().map(|&tok| next(tok)).collect()
            }
            _ => Vec::new(),
        })
        .collect();
    let rows: Vec<&[u32]> = tokens.iter().map(Vec::as_slice).collect();
    s.on_step_verified(second.step_id, &rows, secs(&second));
    let third = s.schedule().unwrap();
    if long_prompt.is_some() {
        assert!(
            third
                .rows
                .iter()
                .any(|r| r.seq_id == 2 && r.num_tokens() > 1),
            "the long prompt is still prefilling in the third step"
        );
    }
    third
        .rows
        .iter()
        .find(|r| r.seq_id == 1)
        .expect("the decoding sequence has a row")
        .num_draft_tokens
}

#[test]
fn a_prefill_sharing_the_step_is_priced_into_the_verify_budget() {
    let alone = drafts_in_third_step(None);
    let beside = drafts_in_third_step(Some(400));
    // Alone, each draft adds a large share of a short step; beside a prefill chunk of
    // dozens of tokens the same drafts cost little of it, so more are worth verifying.
    assert!(
        beside > alone,
        "drafts verified beside a prefill: {beside}, alone: {alone}"
    );
}

#[test]
fn a_continued_verify_row_is_planned_as_if_its_drafts_were_accepted() {
    let cfg = SchedulerConfig {
        block_size: 4,
        continue_verify_rows: true,
        ..spec_cfg(3)
    };
    let mut s = Scheduler::new(cfg.clone());
    s.add(SeqRequest {
        ignore_eos: true,
        ..req(1, vec![1, 2, 3, 1, 2], 20)
    })
    .unwrap();
    let prefill = s.schedule().unwrap();
    s.on_step_done(prefill.step_id, &[9], 0.01);
    let plain = s.schedule().unwrap();
    s.on_step_done(plain.step_id, &[1], 0.01);
    let verify = s.schedule().unwrap();
    assert_eq!(verify.rows[0].input, RowInput::Tokens(vec![1, 2, 9, 1]));
    // Planned while the verify row runs: it reads that row's last token, at the position
    // after all three drafts (6 + 1 + 3).
    let next = s.schedule().expect("the sequence does not sit out");
    let row = &next.rows[0];
    let RowInput::FromPrevious {
        prev_step,
        prev_row,
        drafts,
    } = &row.input
    else {
        panic!("not a continuation: {:?}", row.input);
    };
    assert_eq!((*prev_step, *prev_row), (verify.step_id, 0));
    assert_eq!(
        (row.num_cached_tokens, row.num_draft_tokens),
        (10, drafts.len())
    );
    assert!(row.block_table.len() * cfg.block_size >= 10 + 1 + drafts.len());
    // One draft accepted, then 7: the continuation ran at position 8, not 10.
    let events = s.on_step_verified(verify.step_id, &[&[2, 7]], 0.01);
    assert_eq!(events.len(), 2);
    s.on_step_verified(next.step_id, &[&[5]], 0.01);
    let after = s.schedule().unwrap();
    assert_eq!(after.rows[0].num_cached_tokens, 9);
    assert!(matches!(&after.rows[0].input, RowInput::Tokens(t) if t[0] == 5));
    let seq = s.seqs.iter().flatten().next().unwrap();
    assert_eq!(seq.tokens, vec![1, 2, 3, 1, 2, 9, 1, 2, 7, 5]);
}

#[test]
fn under_zos_verifying_sequences_are_continued_not_sat_out_with_the_same_output() {
    let reqs = requests();
    for num_blocks in [256, 20] {
        for k in [1, 3, 5] {
            let sat_out = SchedulerConfig {
                num_blocks,
                ..spec_cfg(k)
            };
            let mut sitting = Scheduler::new(sat_out.clone());
            let mut dev = Device::new(&sat_out);
            dev.next = predictable_next;
            for r in &reqs {
                sitting.add(r.clone()).unwrap();
            }
            drive(&mut sitting, &mut dev, 2, |_, _, _| {});
            assert!(sitting.num_sat_out_rows() > 0, "K = {k}: nothing sat out");
            let plain = SchedulerConfig {
                num_blocks,
                ..spec_cfg(0)
            };
            let (_, plain_steps, _) = run(&plain, &reqs, 2);
            let cfg = SchedulerConfig {
                continue_verify_rows: true,
                ..sat_out
            };
            let mut s = Scheduler::new(cfg.clone());
            let mut dev = Device::new(&cfg);
            dev.next = predictable_next;
            for r in &reqs {
                s.add(r.clone()).unwrap();
            }
            let mut continued_verify_rows = 0;
            let out = drive(&mut s, &mut dev, 2, |_, _, queue| {
                let (Some(first), Some(second)) = (queue.front(), queue.get(1)) else {
                    return;
                };
                let verifying: Vec<usize> = (0..first.rows.len())
                    .filter(|&r| first.rows[r].num_draft_tokens > 0)
                    .collect();
                continued_verify_rows += second
                    .rows
                    .iter()
                    .filter(|r| {
                        matches!(r.input, RowInput::FromPrevious { prev_step, prev_row, .. }
                            if prev_step == first.step_id && verifying.contains(&prev_row))
                    })
                    .count();
            });
            assert_idle_and_full(&s);
            expect_reference_with(&out, &reqs, &cfg, predictable_next);
            assert!(dev.num_accepted > 0, "K = {k}: no draft accepted");
            assert!(
                continued_verify_rows > 0,
                "K = {k}: no verify row continued"
            );
            assert_eq!(s.num_sat_out_rows(), 0, "K = {k}");
            // A sequence whose verify rows only the sampler can verify still sits out.
            let by_sampler: Vec<SeqRequest> = reqs
                .iter()
                .map(|r| SeqRequest {
                    verified_by_picks: false,
                    score_prompt: false,
                    ..r.clone()
                })
                .collect();
            let mut waiting = Scheduler::new(cfg.clone());
            let mut dev = Device::new(&cfg);
            dev.next = predictable_next;
            for r in &by_sampler {
                waiting.add(r.clone()).unwrap();
            }
            let out = drive(&mut waiting, &mut dev, 2, |_, _, _| {});
            expect_reference_with(&out, &by_sampler, &cfg, predictable_next);
            assert!(waiting.num_sat_out_rows() > 0, "K = {k}: none sat out");
            // With blocks to spare (drafts reserve positions that may not be kept, and
            // tight pools preempt for them).
            assert!(
                num_blocks < 256 || s.next_step_id < plain_steps,
                "K = {k}, {num_blocks} blocks: {} steps vs {plain_steps} without drafts",
                s.next_step_id
            );
        }
    }
}

/// Four long looping requests under confidence scheduling over a flat measured curve (1 ms
/// a step, verify steps alike); each step reports a period of 1 ms, or `verify_secs` when
/// it verified drafts. Returns the outputs, the requests and the drafts verified.
fn run_priced(verify_secs: f64) -> (Outputs, Vec<SeqRequest>, usize) {
    let cfg = SchedulerConfig {
        confidence_verify: true,
        num_blocks: 256,
        ..spec_cfg(5)
    };
    let flat = |from: usize| crate::spec::LatencyCurve::new(vec![(from, 1e-3), (512, 1e-3)]);
    let mut s = Scheduler::new(cfg.clone());
    s.set_decode_curve(flat(1).unwrap().with_verify(flat(2).unwrap()));
    // A drafter seen right many times before: what it is worth is not in question here.
    for c in s.ngram_calibration.lock().unwrap().iter_mut() {
        (0..20).for_each(|_| c.observe(5, 5));
    }
    let mut dev = Device::new(&cfg);
    dev.next = predictable_next;
    let reqs: Vec<SeqRequest> = (1..=4u64)
        .map(|id| SeqRequest {
            ignore_eos: true,
            ..req(id, prompt(id as u32, 8 + id as usize), 160)
        })
        .collect();
    for r in &reqs {
        s.add(r.clone()).unwrap();
    }
    let mut outputs = Outputs::default();
    while let Some(plan) = s.schedule() {
        let sampled = dev.execute_verified(&plan);
        let rows: Vec<&[u32]> = sampled.iter().map(Vec::as_slice).collect();
        outputs.apply(s.on_step_verified(plan.step_id, &rows, fake_secs(&plan)));
        let verifies = plan.rows.iter().any(|r| r.num_draft_tokens > 0);
        s.observe_step_period(plan.step_id, if verifies { verify_secs } else { 1e-3 });
    }
    assert_idle_and_full(&s);
    (outputs, reqs, dev.num_drafts)
}

#[test]
fn verify_steps_seen_to_run_dearer_than_the_curve_says_are_priced_out() {
    let cfg = SchedulerConfig {
        confidence_verify: true,
        ..spec_cfg(5)
    };
    let (honest_out, reqs, honest) = run_priced(1e-3);
    expect_reference_with(&honest_out, &reqs, &cfg, predictable_next);
    let (dear_out, _, dear) = run_priced(20e-3);
    expect_reference_with(&dear_out, &reqs, &cfg, predictable_next);
    // Once verify steps were seen to run 20× a plain one (8× as priced, the bound), no
    // draft pays for one.
    assert!(
        honest > 200,
        "verify steps priced as the curve says: {honest} drafts"
    );
    assert!(
        dear * 3 < honest,
        "{dear} drafts verified at 20× the price, {honest} at the curve's"
    );
}
