//! The prefix store's side of the core: stored blocks admitted as computed and loaded
//! by the step that admits them, registered blocks handed out to be saved, on the fake
//! device of `sim.rs` against one-request-at-a-time reference outputs.

use std::collections::HashMap;

use super::sim::*;
use super::*;
use crate::sched::{StoredBlock, StoredPrefix};

/// Runs `s` to idle on `dev`, copying each block it registers into `store` before the next
/// step is planned (as the actor sends saves ahead of the next step).
fn drive_saving(s: &mut Scheduler, dev: &mut Device, store: &mut HashMap<u64, Vec<u8>>) -> Outputs {
    let mut out = Outputs::default();
    for _ in 0..10_000 {
        let Some(plan) = s.schedule() else { break };
        let sampled = dev.execute(&plan);
        out.apply(s.on_step_done(plan.step_id, &sampled, fake_secs(&plan)));
        for save in s.take_kv_saves() {
            store.insert(save.hash, dev.block_payload(save.block_id));
        }
    }
    assert!(!s.has_unfinished(), "ran out of steps");
    out
}

/// What a store would stage for `tokens`: consecutive stored blocks from `first_block`.
fn staged(
    store: &HashMap<u64, Vec<u8>>,
    tokens: &[u32],
    first_block: usize,
    bs: usize,
) -> StoredPrefix {
    let mut parent = crate::sched::ROOT_HASH;
    let mut blocks = Vec::new();
    for (i, block) in tokens[..tokens.len() - 1].chunks_exact(bs).enumerate() {
        let hash = crate::sched::block_hash(parent, block, 0);
        parent = hash;
        if i < first_block {
            continue;
        }
        let Some(payload) = store.get(&hash) else {
            break;
        };
        blocks.push(StoredBlock {
            hash,
            payload: payload.as_slice().into(),
            state: None,
        });
    }
    StoredPrefix {
        first_block,
        blocks,
    }
}

#[test]
fn a_prefix_from_the_store_is_loaded_not_computed_and_outputs_match() {
    let cfg = small_cfg();
    let bs = cfg.block_size;
    let mut store = HashMap::new();
    let a = req(1, prompt(3, 23), 6);
    let mut s = Scheduler::new(cfg.clone());
    s.set_kv_store(true);
    let mut dev = Device::new(&cfg);
    s.add(a.clone()).unwrap();
    let out_a = drive_saving(&mut s, &mut dev, &mut store);
    // Prompt and generated blocks alike, every full block once.
    assert_eq!(store.len(), (23 + 6 - 1) / bs);

    // A restart: nothing on the device, the store kept.
    let mut s = Scheduler::new(cfg.clone());
    s.set_kv_store(true);
    let mut dev = Device::new(&cfg);
    let mut b = req(2, prompt(3, 21), 5);
    b.prompt_ids.extend([901, 902, 903]);
    let stored = staged(&store, &b.prompt_ids, 0, bs);
    assert_eq!(stored.blocks.len(), 5, "21 shared tokens: five full blocks");
    s.add_with_stored(b.clone(), stored).unwrap();
    let plan = s.schedule().unwrap();
    assert_eq!(plan.rows[0].num_cached_tokens, 5 * bs);
    assert_eq!(plan.kv_loads.len(), 5);
    let loaded: Vec<u32> = plan.kv_loads.iter().map(|l| l.block_id).collect();
    assert_eq!(loaded, plan.rows[0].block_table[..5]);
    let sampled = dev.execute(&plan);
    let mut out = Outputs::default();
    out.apply(s.on_step_done(plan.step_id, &sampled, fake_secs(&plan)));
    out.merge(drive_saving(&mut s, &mut dev, &mut store));
    out.merge(out_a);
    expect_reference(&out, &[a.clone(), b.clone()], &cfg);
    assert_eq!(s.num_stored_hit_blocks(), 5);

    // Loaded blocks are device hits for the next request.
    s.add_with_stored(
        req(3, prompt(3, 22), 2),
        staged(&store, &prompt(3, 22), 0, bs),
    )
    .unwrap();
    let plan = s.schedule().unwrap();
    assert_eq!(plan.rows[0].num_cached_tokens, 5 * bs, "device hits");
    assert!(plan.kv_loads.is_empty());
    // A stored block whose hash is not its tokens' is never taken (nor any after it),
    // nor blocks after a gap.
    let cold = |id, stored| {
        let mut cold = Scheduler::new(cfg.clone());
        cold.set_kv_store(true);
        cold.add_with_stored(req(id, prompt(3, 22), 2), stored)
            .unwrap();
        let plan = cold.schedule().unwrap();
        (plan.rows[0].num_cached_tokens, plan.kv_loads.len())
    };
    let mut bad = staged(&store, &prompt(3, 22), 0, bs);
    bad.blocks[2].hash ^= 1;
    assert_eq!(cold(4, bad), (2 * bs, 2));
    assert_eq!(cold(5, staged(&store, &prompt(3, 22), 1, bs)), (0, 0));
}

#[test]
fn a_stored_state_resumes_a_stored_prefix_on_another_engine_with_no_replay() {
    // The sim's slots see the last `num_replay_tokens` tokens: a resume from any state
    // but a cold run's samples wrong tokens.
    let cfg = SchedulerConfig {
        num_state_slots: Some(2),
        num_replay_tokens: 6,
        num_saved_states: 8,
        ..small_cfg()
    };
    let bs = cfg.block_size;
    let mut rng = 0x5eed_u64;
    for case in 0..24u32 {
        rng = crate::sampling::splitmix64(rng);
        let len = 2 * bs + 1 + (rng % 40) as usize;
        let a = req(1, prompt(case, len), 1 + (rng >> 20) as usize % 6);
        // The engine that prefills keeps blocks and the prompt's last state.
        let (mut store, mut s, mut dev) = (
            HashMap::new(),
            Scheduler::new(cfg.clone()),
            Device::new(&cfg),
        );
        s.set_kv_store(true);
        s.add(a.clone()).unwrap();
        drive_saving(&mut s, &mut dev, &mut store);
        let num_blocks = (len - 1) / bs;
        assert_eq!(
            dev.kept_states.len(),
            1,
            "the prompt's last boundary's state alone"
        );
        let mut stored = staged(&store, &a.prompt_ids, 0, bs);
        for block in &mut stored.blocks {
            block.state = dev
                .kept_states
                .get(&block.hash)
                .map(|b| b.as_slice().into());
        }
        assert_eq!(stored.blocks.len(), num_blocks, "len {len}");
        assert!(
            stored.blocks[num_blocks - 1].state.is_some(),
            "len {len}: no state kept at the prompt's last boundary"
        );

        // Another engine takes the same prompt with them: it computes the last partial
        // block only, from the stored state.
        let (mut s, mut dev) = (Scheduler::new(cfg.clone()), Device::new(&cfg));
        s.set_kv_store(true);
        let b = SeqRequest {
            seq_id: 2,
            ..a.clone()
        };
        s.add_with_stored(b.clone(), stored).unwrap();
        let plan = s.schedule().unwrap();
        let row = &plan.rows[0];
        assert_eq!(row.num_cached_tokens, num_blocks * bs);
        assert_eq!((row.state_start, row.replay_until), (0, num_blocks * bs));
        assert_eq!(plan.state_imports.len(), 1);
        assert_eq!(plan.state_imports[0].position, num_blocks * bs);
        let mut out = Outputs::default();
        let sampled = dev.execute(&plan);
        out.apply(s.on_step_done(plan.step_id, &sampled, fake_secs(&plan)));
        out.merge(drive(&mut s, &mut dev, 1, |_, _, _| {}));
        expect_reference(&out, &[b], &cfg);
        assert_eq!((s.num_resumed_hits(), s.num_replayed_hits()), (1, 0));
        assert_eq!(dev.num_state_imports, 1);
    }
}
