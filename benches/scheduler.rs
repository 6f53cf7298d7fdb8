//! The pure scheduling core: block allocate/free, prefix match against a cache of 1M
//! blocks, and one `schedule()` plan over 1024 running decode sequences (goal ≤ 50 µs).

use std::hint::black_box;

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use troupe::sched::{
    BlockManager, PrefixCache, ROOT_HASH, Scheduler, SchedulerConfig, SeqRequest, block_hash,
};

const BLOCK_SIZE: usize = 16;

fn bench_blocks(c: &mut Criterion) {
    let mut blocks = BlockManager::new(65_536);
    let mut held = Vec::with_capacity(64);
    c.bench_function("block_allocate_free_64", |b| {
        b.iter(|| {
            for _ in 0..64 {
                held.push(blocks.allocate().expect("pool is large enough").block_id);
            }
            for &block in held.iter().rev() {
                blocks.free(block);
            }
            held.clear();
        })
    });
}

fn bench_prefix_match(c: &mut Criterion) {
    // 1M cached blocks: 8192 distinct 128-block chains.
    let num_blocks = 1 << 20;
    let blocks_per_chain = 128;
    let mut cache = PrefixCache::new(num_blocks, BLOCK_SIZE);
    let chain_tokens = |chain: u32| -> Vec<u32> {
        (0..(blocks_per_chain * BLOCK_SIZE) as u32)
            .map(|i| chain.wrapping_mul(2_654_435_761) ^ i)
            .collect()
    };
    for chain in 0..(num_blocks / blocks_per_chain) as u32 {
        let tokens = chain_tokens(chain);
        let mut parent = ROOT_HASH;
        for (i, block) in tokens.chunks_exact(BLOCK_SIZE).enumerate() {
            let hash = block_hash(parent, block, 0);
            let block_id = chain * blocks_per_chain as u32 + i as u32;
            assert!(cache.insert(block_id, hash, parent, block, 0));
            parent = hash;
        }
    }
    assert_eq!(cache.num_cached_blocks(), num_blocks);
    let mut prompt = chain_tokens(4242);
    prompt.push(7); // a 2049-token prompt: 128 full blocks, all hits
    let mut hits = Vec::with_capacity(blocks_per_chain);
    c.bench_function("prefix_match_2048_tokens_1m_cached", |b| {
        b.iter(|| {
            hits.clear();
            cache.match_prefix(
                black_box(&prompt[..prompt.len() - 1]),
                0,
                usize::MAX,
                &mut hits,
            );
            assert_eq!(hits.len(), blocks_per_chain);
        })
    });
}

/// A scheduler with 1024 sequences past prefill (100-token prompts, 7 blocks each).
fn running_decode_scheduler() -> Scheduler {
    let cfg = SchedulerConfig {
        num_blocks: 16_384,
        max_num_seqs: 1024,
        max_step_tokens: 1 << 20,
        step_time_budget_secs: 1e9,
        ..SchedulerConfig::default()
    };
    let mut sched = Scheduler::new(cfg);
    for seq_id in 0..1024u64 {
        let prompt_ids = (0..100u32).map(|i| (seq_id as u32) * 131 + i).collect();
        sched
            .add(SeqRequest {
                seq_id,
                prompt_ids,
                max_tokens: 1000,
                stop_ids: vec![],
                ignore_eos: true,
                cache_salt: 0,
                verified_by_picks: true,
                score_prompt: false,
            })
            .expect("fits");
    }
    let plan = sched.schedule().expect("prefill");
    assert_eq!(plan.rows.len(), 1024);
    sched.on_step_done(plan.step_id, &[1; 1024], 0.05);
    sched
}

fn bench_schedule(c: &mut Criterion) {
    let idle = running_decode_scheduler();
    c.bench_function("schedule_1024_decode_rows", |b| {
        b.iter_batched(
            || idle.clone(),
            |mut sched| {
                let plan = sched.schedule().expect("decode step");
                debug_assert_eq!(plan.rows.len(), 1024);
                (sched, plan)
            },
            BatchSize::LargeInput,
        )
    });
    // ZOS: one step in flight, so every row is `FromPrevious`.
    let mut zos = idle.clone();
    zos.schedule().expect("decode step");
    c.bench_function("schedule_1024_decode_rows_zos", |b| {
        b.iter_batched(
            || zos.clone(),
            |mut sched| {
                let plan = sched.schedule().expect("decode step");
                (sched, plan)
            },
            BatchSize::LargeInput,
        )
    });
}

criterion_group!(benches, bench_blocks, bench_prefix_match, bench_schedule);
criterion_main!(benches);
