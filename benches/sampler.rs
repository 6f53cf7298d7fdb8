//! The sampler on one decode step's rows: 64 rows × 49152-token logits (SmolLM2's vocab)
//! per iteration, each row through `Sampler::sample_row` with its own seed and position.
//! Throughput is in rows, i.e. tokens per second.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use troupe::sampling::{SampleContext, Sampler, SamplingParams, splitmix64};

const NUM_ROWS: usize = 64;
const VOCAB_SIZE: usize = 49_152;
const NUM_PROMPT_TOKENS: usize = 256;
const NUM_OUTPUT_TOKENS: usize = 128;

/// Bell-shaped logits (a sum of four uniforms: mean 0, sd ≈ 2.3) with a few strong
/// candidates per row, roughly the shape of a language model's.
fn batch_logits() -> Vec<f32> {
    let unit = |i: usize, k: u64| (splitmix64(i as u64 * 4 + k) >> 11) as f32 / (1u64 << 53) as f32;
    let mut logits: Vec<f32> = (0..NUM_ROWS * VOCAB_SIZE)
        .map(|i| (unit(i, 0) + unit(i, 1) + unit(i, 2) + unit(i, 3) - 2.0) * 4.0)
        .collect();
    for row in 0..NUM_ROWS {
        for k in 0..4 {
            let id = splitmix64((row * 16 + k) as u64) as usize % VOCAB_SIZE;
            logits[row * VOCAB_SIZE + id] += 12.0 - 2.0 * k as f32;
        }
    }
    logits
}

fn token_ids(n: usize, salt: u64) -> Vec<u32> {
    (0..n)
        .map(|i| (splitmix64(salt ^ i as u64) % VOCAB_SIZE as u64) as u32)
        .collect()
}

fn bench(c: &mut Criterion) {
    let logits = batch_logits();
    let prompt = token_ids(NUM_PROMPT_TOKENS, 1);
    let output = token_ids(NUM_OUTPUT_TOKENS, 2);
    let cases = [
        ("greedy", SamplingParams::default(), false),
        (
            "temp0.8_top_p0.95",
            SamplingParams {
                temperature: 0.8,
                top_p: 0.95,
                ..Default::default()
            },
            false,
        ),
        (
            "temp0.8_top_k50_penalties",
            SamplingParams {
                temperature: 0.8,
                top_k: 50,
                repetition_penalty: 1.1,
                frequency_penalty: 0.3,
                presence_penalty: 0.2,
                ..Default::default()
            },
            true,
        ),
    ];
    let mut group = c.benchmark_group("sampler_64x49152");
    group.throughput(Throughput::Elements(NUM_ROWS as u64));
    group.sample_size(20);
    for (name, params, with_history) in cases {
        let mut sampler = Sampler::default();
        let mut position = 0u64;
        group.bench_function(name, |b| {
            b.iter(|| {
                for (row, row_logits) in logits.chunks_exact(VOCAB_SIZE).enumerate() {
                    let params = SamplingParams {
                        seed: row as u64,
                        ..params.clone()
                    };
                    let ctx = SampleContext {
                        position,
                        prompt_ids: if with_history { &prompt } else { &[] },
                        output_ids: if with_history { &output } else { &[] },
                        banned_ids: &[],
                    };
                    black_box(sampler.sample_row(row_logits, &params, &ctx));
                }
                position += 1;
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
