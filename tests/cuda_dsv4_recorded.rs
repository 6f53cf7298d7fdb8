//! DeepSeek-V4 decode steps recorded as CUDA graphs (`model::deepseek_v4::recorded`) give
//! the eager steps' logits and expert counts bit for bit, over a generated schedule:
//! sequences of random prompts, decode steps over random subsets of them (so the rows of
//! a step, its closing windows and its block tables change from step to step), slots
//! reused by new sequences, and one sequence long enough that the indexer's span outgrows
//! its first recorded size. Needs a GPU: run by `scripts/gpu-tests.sh` on the device machine.
#![cfg(feature = "cuda")]

mod common;

use common::Rng;
use common::dsv4::{CHECKPOINTS, dir};
use troupe::kernels::cuda::CudaBackend;
use troupe::model::deepseek_v4::cache::{SlotSpan, lcm_rates};
use troupe::model::deepseek_v4::{DsSeqStep, DsV4Model};

fn model(name: &str, record: bool) -> DsV4Model<CudaBackend> {
    let b = CudaBackend::new(0, false, record).expect("a GPU");
    DsV4Model::load_dir_on(b, &dir(name), false).unwrap()
}

struct Seq {
    slot: u32,
    tokens: Vec<u32>,
    cached: usize,
    target: usize,
}

const SLOTS: usize = 4;
/// Past 4 · 64 positions the CSA indexer sees more than 64 entries: a second span.
const LONGEST: usize = 300;

#[test]
fn recorded_decode_steps_equal_eager_steps_bit_for_bit() {
    for (seed, name) in CHECKPOINTS.iter().enumerate() {
        let eager = model(name, false);
        let recorded = model(name, true);
        let cfg = &eager.cfg;
        let vocab = cfg.vocab_size;
        let block_size = 2 * lcm_rates(cfg);
        let per_seq = LONGEST.div_ceil(block_size) + 1;
        let num_blocks = SLOTS * per_seq;
        let tables: Vec<Vec<u32>> = (0..SLOTS)
            .map(|s| {
                (0..per_seq)
                    .map(|i| (num_blocks - 1 - (i * SLOTS + s)) as u32)
                    .collect()
            })
            .collect();
        let mut caches = [&eager, &recorded].map(|m| m.new_cache(SLOTS, num_blocks, block_size));
        let mut rng = Rng(0x5eed_0000 + seed as u64);
        let new_seq = |rng: &mut Rng, slot: usize, target: usize| Seq {
            slot: slot as u32,
            tokens: (0..1 + rng.below(20))
                .map(|_| rng.below(vocab) as u32)
                .collect(),
            cached: 0,
            target,
        };
        let mut seqs: Vec<Seq> = (0..SLOTS)
            .map(|s| {
                let target = if s == 0 { LONGEST } else { 20 + rng.below(100) };
                new_seq(&mut rng, s, target)
            })
            .collect();
        let mut started = SLOTS;
        let mut decode_steps = 0;
        for step in 0.. {
            // Fresh sequences prefill alone, so that the decode steps are decode only.
            let fresh: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].cached == 0).collect();
            let chosen: Vec<usize> = if !fresh.is_empty() {
                fresh
            } else {
                let live: Vec<usize> = (0..seqs.len())
                    .filter(|&i| seqs[i].cached < seqs[i].target)
                    .collect();
                if live.is_empty() {
                    break;
                }
                let some: Vec<usize> = live.iter().copied().filter(|_| rng.below(4) != 0).collect();
                if some.is_empty() { vec![live[0]] } else { some }
            };
            let decode = chosen.iter().all(|&i| seqs[i].cached > 0);
            for &i in &chosen {
                if seqs[i].cached > 0 {
                    let t = rng.below(vocab) as u32;
                    seqs[i].tokens.push(t);
                }
            }
            let ds: Vec<DsSeqStep<'_>> = chosen
                .iter()
                .map(|&i| {
                    let s = &seqs[i];
                    let len = s.tokens.len() - s.cached;
                    DsSeqStep {
                        token_ids: &s.tokens[s.cached..],
                        num_cached_tokens: s.cached,
                        block_table: &tables[s.slot as usize],
                        state_slot: s.slot,
                        span: SlotSpan::default(),
                        num_logit_rows: 1.min(len),
                    }
                })
                .collect();
            let [ce, cr] = &mut caches;
            let mut counts =
                [(); 2].map(|_| vec![vec![0u64; cfg.num_routed_experts]; cfg.num_layers]);
            let want = eager.forward_counting(ce, &ds, &mut counts[0]).unwrap();
            let got = recorded.forward_counting(cr, &ds, &mut counts[1]).unwrap();
            if let Some(i) = (0..want.len()).find(|&i| want[i].to_bits() != got[i].to_bits()) {
                panic!(
                    "{name} step {step} ({} rows, decode {decode}): logit {i} is {} recorded, {} eager",
                    ds.len(),
                    got[i],
                    want[i]
                );
            }
            assert_eq!(counts[0], counts[1], "{name} step {step}: expert counts");
            decode_steps += usize::from(decode);
            for &i in &chosen {
                seqs[i].cached = seqs[i].tokens.len();
            }
            // A finished sequence's slot takes a new one, a few times.
            for seq in &mut seqs {
                if seq.cached >= seq.target && started < 2 * SLOTS {
                    let target = 10 + rng.below(40);
                    *seq = new_seq(&mut rng, seq.slot as usize, target);
                    started += 1;
                }
            }
        }
        let replayed = recorded.backend.replayed_steps() as usize;
        assert!(
            replayed * 2 >= decode_steps,
            "{name}: only {replayed} of {decode_steps} decode steps were replayed"
        );
        assert_eq!(
            eager.backend.replayed_steps(),
            0,
            "{name}: the eager model recorded"
        );
    }
}
