//! The routing rules over generated engine states: every pick against a brute-force reading
//! of the rules, the prompt's block hashes against the scheduler's own prefix cache.

use super::*;
use crate::sched::{CachedBlock, PrefixCache};

/// A splitmix-style generator: the states are drawn, not picked.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

const BLOCK: usize = 16;

fn prompt(rng: &mut Rng, len: usize) -> Vec<u32> {
    (0..len).map(|_| rng.below(30_000) as u32).collect()
}

/// An engine whose cache holds a random leading share of `prompts`' blocks.
fn engine(rng: &mut Rng, prompts: &[Vec<u32>]) -> EngineLoad {
    let mut cached_blocks = HashSet::new();
    for p in prompts {
        let hashes = prompt_block_hashes(p, BLOCK);
        let n = rng.below(hashes.len() + 1);
        cached_blocks.extend(&hashes[..n]);
    }
    let kv_capacity_tokens = 1024 + rng.below(8192);
    EngineLoad {
        role: [Role::Both, Role::Prefill, Role::Decode, Role::Encode][rng.below(4)],
        alive: rng.below(8) != 0,
        num_running: rng.below(40),
        num_waiting: rng.below(8),
        num_queued_prefill_tokens: rng.below(4096),
        num_kv_tokens: rng.below(kv_capacity_tokens),
        kv_capacity_tokens,
        block_size: BLOCK,
        cached_blocks,
        takes_kv: rng.below(4) != 0,
    }
}

#[test]
fn prompt_hashes_are_the_prefix_caches_keys() {
    let mut rng = Rng(1);
    for _ in 0..50 {
        let len = rng.below(200);
        let tokens = prompt(&mut rng, len);
        let mut cache = PrefixCache::new(64, BLOCK);
        let hashes = prompt_block_hashes(&tokens, BLOCK);
        assert_eq!(hashes.len(), len / BLOCK);
        let mut parent = ROOT_HASH;
        for (i, (block, &hash)) in tokens.chunks_exact(BLOCK).zip(&hashes).enumerate() {
            assert_eq!(cache.hash_block(parent, block, 0), hash);
            assert!(cache.insert(i as u32, hash, parent, block, 0));
            parent = hash;
        }
        // The engine's own lookup finds every block the router's hashes name.
        let mut hits: Vec<CachedBlock> = Vec::new();
        cache.match_prefix(&tokens, 0, usize::MAX, &mut hits);
        assert_eq!(hits.iter().map(|h| h.hash).collect::<Vec<_>>(), hashes);
    }
}

#[test]
fn prefill_picks_follow_the_rules() {
    let mut rng = Rng(7);
    let cfg = RouteConfig::default();
    for case in 0..2000 {
        let prompts: Vec<Vec<u32>> = (0..3)
            .map(|_| {
                let len = 1 + rng.below(2000);
                prompt(&mut rng, len)
            })
            .collect();
        let engines: Vec<EngineLoad> = (0..1 + rng.below(6))
            .map(|_| engine(&mut rng, &prompts))
            .collect();
        let p = &prompts[rng.below(3)];
        let hashes = prompt_block_hashes(p, BLOCK);
        let picked = pick_prefill(&cfg, &engines, &hashes, p.len());
        let candidates: Vec<usize> = (0..engines.len())
            .filter(|&i| engines[i].alive && engines[i].role.prefills())
            .collect();
        let Some(i) = picked else {
            assert!(candidates.is_empty(), "case {case}: nothing picked");
            continue;
        };
        assert!(candidates.contains(&i), "case {case}: {i} may not prefill");
        let work = |j: usize| {
            let e = &engines[j];
            (e.num_queued_prefill_tokens + p.len() - hit_tokens(e, &hashes, p.len()))
                / cfg.bucket_tokens
        };
        for &j in &candidates {
            assert!(work(i) <= work(j), "case {case}: {j} has less work ahead");
            if work(j) == work(i) {
                assert!(
                    hit_tokens(&engines[i], &hashes, p.len())
                        >= hit_tokens(&engines[j], &hashes, p.len()),
                    "case {case}: {j} holds more of the prompt at equal work"
                );
            }
        }
    }
}

#[test]
fn a_repeated_long_prompt_goes_to_the_engine_that_has_it() {
    let mut rng = Rng(3);
    for _ in 0..100 {
        let len = 1500 + rng.below(2000);
        let p = prompt(&mut rng, len);
        let hashes = prompt_block_hashes(&p, BLOCK);
        let mut engines: Vec<EngineLoad> = (0..4)
            .map(|_| EngineLoad {
                role: Role::Both,
                alive: true,
                num_running: rng.below(4),
                num_waiting: 0,
                num_queued_prefill_tokens: rng.below(64),
                num_kv_tokens: 0,
                kv_capacity_tokens: 1 << 20,
                block_size: BLOCK,
                cached_blocks: HashSet::new(),
                takes_kv: true,
            })
            .collect();
        let holder = rng.below(4);
        engines[holder].cached_blocks.extend(&hashes);
        let picked = pick_prefill(&RouteConfig::default(), &engines, &hashes, p.len());
        assert_eq!(picked, Some(holder));
        // Not once it is dead.
        engines[holder].alive = false;
        let picked = pick_prefill(&RouteConfig::default(), &engines, &hashes, p.len());
        assert_ne!(picked, Some(holder));
        assert!(picked.is_some());
    }
}

#[test]
fn decode_picks_follow_the_rules() {
    let mut rng = Rng(11);
    for case in 0..2000 {
        let engines: Vec<EngineLoad> = (0..1 + rng.below(6))
            .map(|_| engine(&mut rng, &[]))
            .collect();
        let need = rng.below(4096);
        let fits = |j: usize| {
            let e = &engines[j];
            e.alive && e.role.decodes() && e.num_kv_tokens + need <= e.kv_capacity_tokens
        };
        let candidates: Vec<usize> = (0..engines.len()).filter(|&j| fits(j)).collect();
        match pick_decode(&engines, need) {
            None => assert!(candidates.is_empty(), "case {case}"),
            Some(i) => {
                assert!(fits(i), "case {case}");
                let load = |j: usize| {
                    let e = &engines[j];
                    (e.num_running + e.num_waiting, e.num_kv_tokens)
                };
                assert!(
                    candidates.iter().all(|&j| load(i) <= load(j)),
                    "case {case}"
                );
            }
        }
    }
}

#[test]
fn routes_hand_a_prefill_engines_prompts_to_a_decode_engine() {
    let mut rng = Rng(13);
    let (mut handed, mut direct) = (0, 0);
    for case in 0..3000 {
        let prompts: Vec<Vec<u32>> = (0..2)
            .map(|_| {
                let len = 1 + rng.below(1500);
                prompt(&mut rng, len)
            })
            .collect();
        let engines: Vec<EngineLoad> = (0..1 + rng.below(5))
            .map(|_| engine(&mut rng, &prompts))
            .collect();
        let p = &prompts[rng.below(2)];
        let hashes = prompt_block_hashes(p, BLOCK);
        let cfg = RouteConfig {
            min_hand_off_tokens: [0, 64, 256][rng.below(3)],
            ..RouteConfig::default()
        };
        let threshold = BLOCK.max(cfg.min_hand_off_tokens);
        let route = pick_route(&cfg, &engines, Some((&hashes, p.len())));
        let prefill = pick_prefill(&cfg, &engines, &hashes, p.len());
        let Some(Route {
            target,
            prefill_from,
        }) = route
        else {
            // A prefill-only pick and nothing decodes it.
            assert!(pick_decode(&engines, p.len()).is_none(), "case {case}");
            continue;
        };
        let Some(prefill) = prefill else {
            // Nothing prefills: a decode engine does it itself.
            assert_eq!(Some(target), pick_decode(&engines, p.len()), "case {case}");
            assert_eq!(prefill_from, None, "case {case}");
            continue;
        };
        if engines[prefill].role == Role::Both {
            assert_eq!((target, prefill_from), (prefill, None), "case {case}");
            continue;
        }
        // The prefill pick only prefills: the decode pick answers.
        assert_eq!(Some(target), pick_decode(&engines, p.len()), "case {case}");
        assert!(engines[target].role.decodes(), "case {case}");
        let left = p.len() - hit_tokens(&engines[target], &hashes, p.len());
        match prefill_from {
            Some(from) => {
                assert_eq!(from, prefill, "case {case}");
                assert!(
                    left > threshold && engines[target].takes_kv,
                    "case {case}: the decode engine holds the prompt"
                );
                handed += 1;
            }
            None => {
                assert!(
                    left <= threshold || !engines[target].takes_kv,
                    "case {case}: {left} tokens left to compute"
                );
                direct += 1;
            }
        }
    }
    assert!(
        handed > 100 && direct > 0,
        "{handed} handed over, {direct} direct"
    );
    // A request the router cannot read goes by load to an engine that decodes.
    let cfg = RouteConfig::default();
    let engines: Vec<EngineLoad> = (0..4).map(|_| engine(&mut rng, &[])).collect();
    if let Some(r) = pick_route(&cfg, &engines, None) {
        assert_eq!(Some(r.target), pick_decode(&engines, 0));
        assert_eq!(r.prefill_from, None);
    }
}

#[test]
fn encoder_picks_take_the_fewest_patches_in_flight() {
    let mut rng = Rng(5);
    for _ in 0..200 {
        let engines: Vec<EngineLoad> = (0..1 + rng.below(6))
            .map(|_| engine(&mut rng, &[]))
            .collect();
        let patches: Vec<usize> = engines.iter().map(|_| rng.below(4) * 1024).collect();
        let picked = pick_encoder(&engines, &patches);
        let eligible: Vec<usize> = (0..engines.len())
            .filter(|&i| engines[i].alive && engines[i].role == Role::Encode)
            .collect();
        match picked {
            None => assert!(eligible.is_empty()),
            Some(i) => {
                assert!(eligible.contains(&i), "picked engine {i} cannot encode");
                let fewest = eligible.iter().map(|&j| patches[j]).min().unwrap();
                assert_eq!(patches[i], fewest);
                // Ties go to the first.
                assert_eq!(Some(&i), eligible.iter().find(|&&j| patches[j] == fewest));
            }
        }
        // An encode engine is never given a request to generate.
        if let Some(r) = pick_route(&RouteConfig::default(), &engines, None) {
            assert_ne!(engines[r.target].role, Role::Encode);
        }
    }
}
