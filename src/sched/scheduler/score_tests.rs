//! Scored prompts (prompt logprobs) in the core: no prefix hits taken, short chunks.

use crate::sched::RowInput;
use crate::sched::sequence::MAX_SCORED_CHUNK_TOKENS;

use super::sim::*;
use super::*;

#[test]
fn a_scored_prompt_takes_no_prefix_hits_but_leaves_its_blocks() {
    let cfg = small_cfg();
    let mut s = Scheduler::new(cfg.clone());
    let mut dev = Device::new(&cfg);
    let a = req(1, prompt(1, 10), 3);
    s.add(a.clone()).unwrap();
    let mut out = drive(&mut s, &mut dev, 1, |_, _, _| {});
    let mut b = req(2, prompt(1, 10), 3);
    b.score_prompt = true;
    s.add(b.clone()).unwrap();
    let plan = s.schedule().unwrap();
    assert_eq!(
        plan.rows[0].num_cached_tokens, 0,
        "every position is computed"
    );
    assert_eq!(plan.rows[0].input, RowInput::Tokens(prompt(1, 10)));
    let sampled = dev.execute(&plan);
    out.apply(s.on_step_done(plan.step_id, &sampled, 0.01));
    out.merge(drive(&mut s, &mut dev, 1, |_, _, _| {}));
    // A plain request after it still shares the prompt's blocks.
    let c = req(3, prompt(1, 10), 3);
    s.add(c.clone()).unwrap();
    let plan = s.schedule().unwrap();
    assert_eq!(plan.rows[0].num_cached_tokens, 8);
    let sampled = dev.execute(&plan);
    out.apply(s.on_step_done(plan.step_id, &sampled, 0.01));
    out.merge(drive(&mut s, &mut dev, 1, |_, _, _| {}));
    expect_reference(&out, &[a, b, c], &cfg);
}

#[test]
fn a_scored_prompt_runs_in_short_chunks_beside_a_long_plain_one() {
    let cfg = SchedulerConfig {
        block_size: 16,
        num_blocks: 256,
        max_context_tokens: 2048,
        ..SchedulerConfig::default()
    };
    let mut s = Scheduler::new(cfg.clone());
    let mut dev = Device::new(&cfg);
    let mut scored = req(1, prompt(3, 700), 4);
    scored.score_prompt = true;
    let plain = req(2, prompt(4, 700), 4);
    s.add(scored.clone()).unwrap();
    s.add(plain.clone()).unwrap();
    let (mut longest, mut plain_longest) = (0, 0);
    let out = drive(&mut s, &mut dev, 2, |_, _, queue| {
        for row in queue.iter().flat_map(|p| &p.rows) {
            let len = row.num_tokens();
            match row.seq_id {
                1 => longest = longest.max(len),
                _ => plain_longest = plain_longest.max(len),
            }
        }
    });
    assert!(longest <= MAX_SCORED_CHUNK_TOKENS, "{longest}");
    assert!(
        plain_longest > MAX_SCORED_CHUNK_TOKENS,
        "the plain prompt is not held back"
    );
    expect_reference(&out, &[scored, plain], &cfg);
}
