//! One batch-1 decode step of the default model (SmolLM2-135M, Q4_1) at a 256-token
//! context, through the same forward pass `troupe generate` runs.

use criterion::{Criterion, criterion_group, criterion_main};
use troupe::kernels::Backend;
use troupe::kernels::cpu::CpuBackend;
use troupe::model::llama::SeqStep;
use troupe::model::{self, hub};

fn bench(c: &mut Criterion) {
    let path = model::resolve_model_path(hub::DEFAULT_MODEL).expect("default model");
    let backend = CpuBackend::default();
    let mut loaded = model::load(&path, &backend).expect("model loads");
    let block_size = 16;
    let context = 256;
    let table: Vec<u32> = (0..(context / block_size + 1) as u32).collect();
    let mut cache = backend.alloc_kv_cache(loaded.model.kv_cache_shape(table.len(), block_size));
    let prompt: Vec<u32> = (0..context as u32).map(|i| 100 + i * 37 % 40000).collect();
    let prefill = SeqStep {
        token_ids: &prompt,
        num_cached_tokens: 0,
        block_table: &table,
        num_logit_rows: 1,
        state: None,
    };
    loaded
        .model
        .forward(&backend, &mut cache, block_size, &[prefill]);
    let token = [42u32];
    c.bench_function("decode_step_smollm2_ctx256", |b| {
        b.iter(|| {
            // Rewrites the slot of position 256 each time: the step's cost, not a growing context.
            let step = SeqStep {
                token_ids: &token,
                num_cached_tokens: context,
                block_table: &table,
                num_logit_rows: 1,
                state: None,
            };
            loaded
                .model
                .forward(&backend, &mut cache, block_size, &[step])
        })
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30);
    targets = bench
}
criterion_main!(benches);
