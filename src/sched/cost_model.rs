//! Step-time cost model: predicts a step's seconds from its rows, refits itself online.
//!
//! A row that computes `q` new tokens on top of `c` cached ones costs roughly
//! `c1·q` (weights, MLP), `c2·q·c` (attention over the prefix) and `c3·q²` (attention
//! within the chunk); a step adds a fixed `c0` (launch, sync, sampling). So
//!
//! `secs = c0 + c1·Σq + c2·Σq·c + c3·Σq²`
//!
//! is linear in the four step features and is fitted by least squares over the last
//! [`WINDOW_SAMPLES`] measured steps. Columns are scaled to unit RMS (features span ten
//! orders of magnitude) and the fit is ridge-regularized *towards the prior*, not zero:
//! with decode-only traffic `Σq = Σq²` and the data cannot split `c1` from `c3`, so the
//! prior settles that direction. Coefficients are clamped at ≥ 0, which keeps predicted
//! cost monotone in `q` and lets [`CostModel::largest_chunk`] solve a quadratic in O(1).
//! A refit costs O(WINDOW_SAMPLES).

use std::collections::VecDeque;

use crate::spec::StepCost;
pub use crate::spec::StepFeatures;

/// Samples kept for the fit: enough to average noise, few enough to follow drift.
pub const WINDOW_SAMPLES: usize = 256;
/// Below this many samples predictions use the prior coefficients.
pub const MIN_FIT_SAMPLES: usize = 8;
/// Ridge strength per sample, in unit-RMS feature space.
const RIDGE_PER_SAMPLE: f64 = 1e-6;

#[derive(Debug, Clone)]
pub struct CostModel {
    /// `[c0, c1, c2, c3]` in seconds, seconds/token, seconds/token², seconds/token².
    coefficients: [f64; 4],
    prior: [f64; 4],
    samples: VecDeque<([f64; 4], f64)>,
}

impl StepCost for CostModel {
    fn step_secs(&self, features: &StepFeatures) -> f64 {
        self.predict_features(features)
    }
}

impl Default for CostModel {
    /// A prior of a mid-size model on one accelerator: 1 ms per step, 20 µs per token,
    /// attention terms small. Only its order of magnitude matters; a few steps refit it.
    fn default() -> Self {
        Self::with_prior([1e-3, 2e-5, 2e-9, 1e-9])
    }
}

impl CostModel {
    pub fn with_prior(prior: [f64; 4]) -> Self {
        Self {
            coefficients: prior,
            prior,
            samples: VecDeque::with_capacity(WINDOW_SAMPLES),
        }
    }

    /// `[c0, c1, c2, c3]` now in use.
    pub fn coefficients(&self) -> [f64; 4] {
        self.coefficients
    }

    pub fn num_samples(&self) -> usize {
        self.samples.len()
    }

    /// Predicted seconds of a step made of `rows`, each `(q new tokens, c cached)`.
    pub fn predict(&self, rows: &[(usize, usize)]) -> f64 {
        self.predict_features(&StepFeatures::of_rows(rows))
    }

    pub fn predict_features(&self, features: &StepFeatures) -> f64 {
        crate::spec::LinearCost(self.coefficients).step_secs(features)
    }

    /// Records one measured step and refits. Non-finite or negative times are dropped.
    pub fn observe(&mut self, rows: &[(usize, usize)], secs: f64) {
        self.observe_features(&StepFeatures::of_rows(rows), secs);
    }

    pub fn observe_features(&mut self, features: &StepFeatures, secs: f64) {
        if !secs.is_finite() || secs < 0.0 {
            return;
        }
        if self.samples.len() == WINDOW_SAMPLES {
            self.samples.pop_front();
        }
        self.samples.push_back((features.as_array(), secs));
        if self.samples.len() >= MIN_FIT_SAMPLES {
            self.refit();
        }
    }

    /// Largest `q ≤ max_q` such that `fixed_rows` plus a row `(q, cached)` is predicted
    /// within `budget_secs`; at least 1 (when `max_q ≥ 1`) so a prefill always progresses.
    pub fn largest_chunk(
        &self,
        fixed_rows: &[(usize, usize)],
        cached: usize,
        max_q: usize,
        budget_secs: f64,
    ) -> usize {
        let fitting = self.largest_fitting_chunk(
            &StepFeatures::of_rows(fixed_rows),
            cached,
            max_q,
            budget_secs,
        );
        fitting.max(max_q.min(1))
    }

    /// Like [`Self::largest_chunk`] but 0 when not even one token fits.
    pub fn largest_fitting_chunk(
        &self,
        base: &StepFeatures,
        cached: usize,
        max_q: usize,
        budget_secs: f64,
    ) -> usize {
        let with_row = |q: usize| {
            let mut f = *base;
            f.add_row(q, cached);
            self.predict_features(&f)
        };
        if max_q == 0 || with_row(1) > budget_secs {
            return 0;
        }
        // Solve a·q² + b·q ≤ remaining, with a, b ≥ 0 (clamped coefficients).
        let [_, c1, c2, c3] = self.coefficients;
        let remaining = budget_secs - self.predict_features(base);
        let (a, b) = (c3, c1 + c2 * cached as f64);
        let q_real = if a > 0.0 {
            (-b + (b * b + 4.0 * a * remaining).sqrt()) / (2.0 * a)
        } else if b > 0.0 {
            remaining / b
        } else {
            f64::INFINITY
        };
        let mut q = q_real.clamp(1.0, max_q as f64) as usize;
        // Floating-point fix-up: the closed form can be off by one either way.
        while q > 1 && with_row(q) > budget_secs {
            q -= 1;
        }
        while q < max_q && with_row(q + 1) <= budget_secs {
            q += 1;
        }
        q
    }

    fn refit(&mut self) {
        let n = self.samples.len() as f64;
        // Column scales: RMS of each feature over the window (1 for an all-zero column).
        let mut scale = [0.0f64; 4];
        for (x, _) in &self.samples {
            for k in 0..4 {
                scale[k] += x[k] * x[k];
            }
        }
        for s in &mut scale {
            *s = if *s > 0.0 { (*s / n).sqrt() } else { 1.0 };
        }
        // Normal equations in scaled space: (ZᵀZ + λI)γ = Zᵀy + λγ_prior, β = γ / scale.
        let lambda = RIDGE_PER_SAMPLE * n;
        let mut a = [[0.0f64; 4]; 4];
        let mut rhs = [0.0f64; 4];
        for (x, y) in &self.samples {
            let z: [f64; 4] = std::array::from_fn(|k| x[k] / scale[k]);
            for i in 0..4 {
                rhs[i] += z[i] * y;
                for j in 0..4 {
                    a[i][j] += z[i] * z[j];
                }
            }
        }
        for k in 0..4 {
            a[k][k] += lambda;
            rhs[k] += lambda * self.prior[k] * scale[k];
        }
        if let Some(gamma) = solve4(a, rhs) {
            for k in 0..4 {
                let beta = gamma[k] / scale[k];
                self.coefficients[k] = if beta.is_finite() {
                    beta.max(0.0)
                } else {
                    self.prior[k]
                };
            }
        }
    }
}

/// Gaussian elimination with partial pivoting; `None` if singular.
fn solve4(mut a: [[f64; 4]; 4], mut b: [f64; 4]) -> Option<[f64; 4]> {
    for col in 0..4 {
        let pivot = (col..4).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[pivot][col].abs() < 1e-300 {
            return None;
        }
        a.swap(col, pivot);
        b.swap(col, pivot);
        for row in col + 1..4 {
            let f = a[row][col] / a[col][col];
            let pivot_row = a[col];
            for (x, p) in a[row].iter_mut().zip(pivot_row).skip(col) {
                *x -= f * p;
            }
            b[row] -= f * b[col];
        }
    }
    let mut x = [0.0f64; 4];
    for row in (0..4).rev() {
        let tail: f64 = (row + 1..4).map(|k| a[row][k] * x[k]).sum();
        x[row] = (b[row] - tail) / a[row][row];
    }
    Some(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TRUE: [f64; 4] = [2e-3, 5e-5, 3e-8, 1e-7];

    fn true_secs(rows: &[(usize, usize)]) -> f64 {
        CostModel::with_prior(TRUE).predict(rows)
    }

    /// Deterministic pseudo-random mixed steps: decode rows plus 0–2 prefill chunks.
    fn synthetic_steps(n: usize) -> Vec<Vec<(usize, usize)>> {
        let mut rng = 12345u64;
        let mut next = |m: u64| {
            rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (rng >> 33) % m
        };
        (0..n)
            .map(|_| {
                let mut rows: Vec<(usize, usize)> =
                    (0..next(64)).map(|_| (1, next(2000) as usize)).collect();
                for _ in 0..next(3) {
                    rows.push((1 + next(1024) as usize, next(3000) as usize));
                }
                rows
            })
            .collect()
    }

    #[test]
    fn recovers_known_coefficients() {
        let mut model = CostModel::default();
        for rows in synthetic_steps(200) {
            let secs = true_secs(&rows);
            model.observe(&rows, secs);
        }
        for (k, (got, want)) in model.coefficients().iter().zip(TRUE).enumerate() {
            assert!(
                (got - want).abs() <= 1e-3 * want,
                "c{k}: got {got:e}, want {want:e}"
            );
        }
    }

    #[test]
    fn tolerates_noise_and_keeps_prior_before_enough_samples() {
        let mut model = CostModel::default();
        let steps = synthetic_steps(300);
        for rows in &steps[..MIN_FIT_SAMPLES - 1] {
            model.observe(rows, true_secs(rows));
        }
        assert_eq!(model.coefficients(), CostModel::default().coefficients());
        for (i, rows) in steps.iter().enumerate() {
            let noise = 1.0 + 0.02 * ((i % 7) as f64 - 3.0) / 3.0;
            model.observe(rows, true_secs(rows) * noise);
        }
        let probe = [(1, 500), (1, 900), (512, 1000)];
        let (got, want) = (model.predict(&probe), true_secs(&probe));
        assert!(
            (got - want).abs() < 0.03 * want,
            "predicted {got}, true {want}"
        );
    }

    #[test]
    fn largest_chunk_is_the_largest_within_budget() {
        let model = CostModel::with_prior(TRUE);
        let fixed = [(1, 100), (1, 2000), (1, 50)];
        for (cached, budget) in [(0, 0.05), (1000, 0.05), (4000, 0.02), (0, 0.5)] {
            let q = model.largest_chunk(&fixed, cached, 100_000, budget);
            let mut rows = fixed.to_vec();
            rows.push((q, cached));
            assert!(model.predict(&rows) <= budget, "q={q} over budget");
            rows.last_mut().unwrap().0 = q + 1;
            assert!(model.predict(&rows) > budget, "q+1={} still fits", q + 1);
        }
        assert_eq!(
            model.largest_chunk(&fixed, 0, 7, 10.0),
            7,
            "capped by max_q"
        );
        assert_eq!(
            model.largest_chunk(&fixed, 0, 7, 0.0),
            1,
            "at least one token"
        );
        assert_eq!(model.largest_chunk(&fixed, 0, 0, 1.0), 0);
    }
}
