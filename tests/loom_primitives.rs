//! Loom: every shared-memory primitive of the crate besides `SampledTokens` (its own
//! suite): the grammar matcher's busy cell, a group's abort hooks, the GPU's pick-slot
//! pool, the fault plan's one-shot flags, the drafters' shared calibration, the engine
//! handle's request ids, the prefix store's host tier, the server's admission gate, the
//! router's view of its engines and its in-flight counts, a device step's host-call flags.
//! Run with `cargo test --release --features loom --test loom_primitives`.
#![cfg(feature = "loom")]

use loom::sync::Arc;
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::thread;
use troupe::kernels::collective::GroupAbort;
use troupe::runner::fault::FaultPlan;
use troupe::sched::{KvSave, ROOT_HASH, block_hash};
use troupe::spec::{Drafter, NgramDrafter};
use troupe::store::{KvStore, KvStoreConfig};
use troupe::sync::{BusyCell, Gate, Refusal};

#[test]
fn a_waiter_on_a_busy_cell_sees_the_finished_work() {
    loom::model(|| {
        let cell = Arc::new(BusyCell::new(0u32));
        cell.mark_busy();
        let worker = cell.clone();
        let h = thread::spawn(move || worker.finish(|v| *v = 7));
        // The owner wants the value while the work may still run: it must wait for it.
        assert_eq!(cell.with_idle(|v| *v), 7);
        h.join().unwrap();
    });
}

#[test]
fn a_busy_cell_handed_to_two_workers_in_turn_ends_with_the_second() {
    loom::model(|| {
        let cell = Arc::new(BusyCell::new(Vec::<u32>::new()));
        cell.mark_busy();
        let first = cell.clone();
        let h = thread::spawn(move || first.finish(|v| v.push(1)));
        cell.with_idle(|v| assert_eq!(v, &[1]));
        h.join().unwrap();
        cell.mark_busy();
        let second = cell.clone();
        let h = thread::spawn(move || second.finish(|v| v.push(2)));
        cell.with_idle(|v| assert_eq!(v, &[1, 2]));
        h.join().unwrap();
    });
}

#[test]
fn a_hook_registered_during_an_abort_runs_in_that_abort_or_the_next() {
    loom::model(|| {
        let abort = GroupAbort::default();
        let hits = Arc::new(AtomicUsize::new(0));
        let (group, counted) = (abort.clone(), hits.clone());
        let h = thread::spawn(move || {
            group.register(Box::new(move || {
                counted.fetch_add(1, Ordering::SeqCst);
            }))
        });
        abort.abort();
        h.join().unwrap();
        let after_first = hits.load(Ordering::SeqCst);
        assert!(after_first <= 1, "a hook ran twice in one abort");
        abort.abort();
        assert_eq!(
            hits.load(Ordering::SeqCst),
            after_first + 1,
            "a hook was lost"
        );
    });
}

#[test]
fn an_injected_fault_strikes_exactly_once() {
    loom::model(|| {
        let faults = FaultPlan::default();
        faults.panic_next_step();
        faults.lose_device(1);
        let other = faults.clone();
        let h = thread::spawn(move || {
            other.note_model_released();
            (other.take_step_panic(0), other.take_step_panic(1))
        });
        faults.note_model_released();
        let mine = (faults.take_step_panic(0), faults.take_step_panic(1));
        let theirs = h.join().unwrap();
        assert_eq!(faults.num_models_released(), 2, "a release was lost");
        // One panic for the step flag, one for the dying device, whoever takes them.
        let struck = [mine.0, mine.1, theirs.0, theirs.1]
            .iter()
            .filter(|&&x| x)
            .count();
        assert_eq!(struck, 2, "{mine:?} {theirs:?}");
        assert!(faults.take_start_failure(1), "a lost device stays lost");
    });
}

#[test]
fn drafters_sharing_a_calibration_lose_no_observation() {
    loom::model(|| {
        let calibration = NgramDrafter::calibration(1, 1, 2);
        let history = [3, 4, 3];
        let mut a = NgramDrafter::with_calibration(1, 1, calibration.clone());
        let mut b = NgramDrafter::with_calibration(1, 1, calibration.clone());
        assert!(!a.propose(&history, 2).is_empty());
        assert!(!b.propose(&history, 2).is_empty());
        let h = thread::spawn(move || a.observe(2, 1));
        b.observe(2, 2);
        h.join().unwrap();
        let observed = calibration.lock().unwrap()[0].num_observed();
        assert_eq!(observed, 2);
    });
}

#[test]
fn a_pool_slot_has_one_holder_and_none_is_lost() {
    loom::model(|| {
        let pool = troupe::sync::SlotPool::default();
        pool.put(1u32);
        let made = Arc::new(AtomicUsize::new(0));
        // Bit s: slot s is held now.
        let held = Arc::new(AtomicUsize::new(0));
        let use_slot = |pool: &troupe::sync::SlotPool<u32>,
                        made: &AtomicUsize,
                        held: &AtomicUsize,
                        base: u32| {
            let slot = pool.take_or(|| base + made.fetch_add(1, Ordering::SeqCst) as u32);
            let before = held.fetch_or(1 << slot, Ordering::SeqCst);
            assert_eq!(before & (1 << slot), 0, "slot {slot} handed to two holders");
            held.fetch_and(!(1 << slot), Ordering::SeqCst);
            pool.put(slot);
        };
        let (other, made2, held2) = (pool.clone(), made.clone(), held.clone());
        let h = thread::spawn(move || use_slot(&other, &made2, &held2, 10));
        use_slot(&pool, &made, &held, 20);
        h.join().unwrap();
        // Every slot that existed came back: the first one, plus any made meanwhile.
        assert_eq!(pool.num_free(), 1 + made.load(Ordering::SeqCst));
    });
}

#[test]
fn concurrent_submitters_get_distinct_request_ids() {
    loom::model(|| {
        let ids = troupe::api::RequestIds::default();
        let other = ids.clone();
        let h = thread::spawn(move || (other.next(), other.next()));
        let mine = ids.next();
        let (a, b) = h.join().unwrap();
        let mut all = [mine, a, b];
        all.sort_unstable();
        assert_eq!(all, [1, 2, 3], "ids repeated or skipped");
    });
}

#[test]
fn a_prefix_store_lookup_beside_a_save_sees_the_whole_block_or_none() {
    loom::model(|| {
        let cfg = KvStoreConfig {
            host_bytes: 1 << 20,
            ..Default::default()
        };
        let store = Arc::new(KvStore::open(&cfg, "loom", 4, 3).unwrap());
        // One full block; the last token is never matched.
        let tokens = [5u32, 6, 7, 8, 9];
        let hash = block_hash(ROOT_HASH, &tokens[..4], 0);
        let saver = store.clone();
        let h = thread::spawn(move || {
            let save = KvSave {
                block_id: 0,
                hash,
                parent_hash: ROOT_HASH,
                cache_salt: 0,
                tokens: tokens[..4].into(),
            };
            saver.save(&save, vec![1u8, 2, 3].into());
        });
        let staged = store.stage(&tokens, 0, 0);
        match staged.blocks.as_slice() {
            [] => {}
            [block] => assert_eq!((block.hash, &*block.payload), (hash, &[1u8, 2, 3][..])),
            more => panic!("one block saved, {} found", more.len()),
        }
        assert_eq!(store.stats().host_hit_blocks, staged.blocks.len() as u64);
        h.join().unwrap();
        assert_eq!(store.stage(&tokens, 0, 0).blocks.len(), 1);
        assert_eq!(store.stats().host_bytes, 3);
    });
}

#[test]
fn two_requests_at_a_gate_of_one_let_exactly_one_in_and_the_ticket_comes_back() {
    loom::model(|| {
        let gate = Gate::new(1);
        let other = gate.clone();
        let h = thread::spawn(move || other.enter().map(drop).is_ok());
        let mine = gate.enter();
        let theirs = h.join().unwrap();
        // Either both got in one after the other (the thread's ticket dropped first) or
        // exactly one did; never two inside at once.
        match &mine {
            Ok(_) => assert!(gate.num_inside() == 1),
            Err(r) => assert_eq!(*r, Refusal::Full),
        }
        assert!(mine.is_ok() || theirs);
        drop(mine);
        assert_eq!(gate.num_inside(), 0);
    });
}

#[test]
fn a_gate_closed_while_a_request_enters_admits_it_whole_or_refuses_it_as_closed() {
    loom::model(|| {
        let gate = Gate::new(4);
        let other = gate.clone();
        let h = thread::spawn(move || other.enter().map(|t| (t, ())));
        gate.close();
        let entered = h.join().unwrap();
        match entered {
            Ok((ticket, ())) => {
                assert_eq!(gate.num_inside(), 1);
                drop(ticket);
            }
            Err(r) => assert_eq!(r, Refusal::Closed),
        }
        assert_eq!(gate.num_inside(), 0);
        assert_eq!(gate.enter().err(), Some(Refusal::Closed));
    });
}

#[test]
fn a_forwarded_engine_forgotten_during_a_poll_is_gone_or_freshly_reported() {
    use troupe::cluster::agent::EngineReport;
    use troupe::cluster::registry::Registry;
    let report = |name: &str| EngineReport {
        node_name: name.into(),
        http_url: String::new(),
        role: "both".into(),
        num_running: 0,
        num_waiting: 0,
        num_queued_prefill_tokens: 0,
        num_kv_tokens: 0,
        kv_capacity_tokens: 0,
        block_size: 16,
        cached_blocks: Vec::new(),
        takes_kv: false,
        draining: false,
    };
    loom::model(move || {
        let registry = Arc::new(Registry::default());
        let (e1, e2) = (ractor::ActorId::Local(1), ractor::ActorId::Local(2));
        registry.replace(vec![(e1, report("e1"))], &[e1]);
        let poller = {
            let registry = registry.clone();
            thread::spawn(move || {
                registry.replace(vec![(e1, report("e1")), (e2, report("e2"))], &[e1, e2])
            })
        };
        registry.forget("e1");
        poller.join().unwrap();
        let names: Vec<String> = registry
            .reports()
            .into_iter()
            .map(|r| r.node_name)
            .collect();
        // The forget came after the poll (e1 gone) or before it (the poll's fresh view).
        assert!(names == ["e2"] || names == ["e1", "e2"], "{names:?}");
    });
}

/// Two forwarded requests to one engine entering and ending beside a load reader: the
/// reader sees 0, 1 or 2 in flight, never more, and the count is gone once both end.
#[test]
fn in_flight_counts_see_every_request_and_forget_finished_ones() {
    use troupe::cluster::in_flight::InFlightCounts;
    loom::model(|| {
        // The router shares them as `troupe::sync::Shared` (std's Arc); the lock inside is
        // loom's.
        let counts = std::sync::Arc::new(InFlightCounts::default());
        let forwards: Vec<_> = (0..2)
            .map(|_| {
                let counts = counts.clone();
                thread::spawn(move || drop(InFlightCounts::enter(&counts, "e1")))
            })
            .collect();
        let seen = counts.get("e1");
        assert!(seen <= 2, "{seen}");
        for f in forwards {
            f.join().unwrap();
        }
        assert_eq!(counts.get("e1"), 0);
        assert!(
            counts.snapshot().is_empty(),
            "a finished engine's count stays"
        );
    });
}

/// A device step's host calls meeting the serving thread through two flag words
/// (`HostFlags`): each call's inputs are seen by the host, each answer by the device,
/// in order, and no raise is lost to the other side's lowering.
#[test]
fn host_calls_through_flags_hand_over_inputs_and_answers_in_order() {
    use loom::cell::UnsafeCell;
    use loom::sync::atomic::AtomicU32;
    use troupe::sync::HostFlags;
    struct Shared {
        started: AtomicU32,
        answered: AtomicU32,
        // The staging: the call's input (device → host) and answer (host → device).
        input: UnsafeCell<u32>,
        output: UnsafeCell<u32>,
    }
    // SAFETY: the cells are handed over by the flags' acquire/release pairs, which loom
    // checks for races.
    unsafe impl Sync for Shared {}
    const CALLS: u32 = 2;
    loom::model(|| {
        let shared = Arc::new(Shared {
            started: AtomicU32::new(0),
            answered: AtomicU32::new(0),
            input: UnsafeCell::new(0),
            output: UnsafeCell::new(0),
        });
        let host = {
            let shared = shared.clone();
            thread::spawn(move || {
                let flags = HostFlags {
                    started: &shared.started,
                    answered: &shared.answered,
                };
                for want in 0..CALLS {
                    let tag = loop {
                        if let Some(tag) = flags.take_started() {
                            break tag;
                        }
                        thread::yield_now();
                    };
                    assert_eq!(tag, want, "calls out of order");
                    let input = shared.input.with(|p| unsafe { *p });
                    assert_eq!(input, 10 + tag, "the call's input had not landed");
                    shared.output.with_mut(|p| unsafe { *p = 100 + input });
                    flags.answer(tag);
                }
            })
        };
        let flags = HostFlags {
            started: &shared.started,
            answered: &shared.answered,
        };
        for tag in 0..CALLS {
            shared.input.with_mut(|p| unsafe { *p = 10 + tag });
            flags.raise_started(tag);
            while !flags.take_answer(tag) {
                thread::yield_now();
            }
            let answer = shared.output.with(|p| unsafe { *p });
            assert_eq!(
                answer,
                110 + tag,
                "the answer was read before it was written"
            );
        }
        host.join().unwrap();
    });
}
