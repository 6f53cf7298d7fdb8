//! The f32 host arithmetic the DeepSeek-V4 reference pass is built from: a linear layer
//! on the `gemm` crate, RMS norms, DeepSeek's interleaved partial RoPE, scoring functions.

use super::config::{RopeSpec, Scoring};

/// A row-major `[rows, cols]` weight applied as `x · Wᵀ`.
#[derive(Debug, Clone)]
pub struct Linear {
    pub rows: usize,
    pub cols: usize,
    pub w: Vec<f32>,
}

impl Linear {
    /// `x` is `[m, cols]`; returns `[m, rows]`.
    pub fn apply(&self, x: &[f32]) -> Vec<f32> {
        let m = x.len() / self.cols;
        debug_assert_eq!(m * self.cols, x.len());
        let mut out = vec![0.0f32; m * self.rows];
        matmul_t(x, m, &self.w, self.rows, self.cols, &mut out);
        out
    }
}

/// `out[i, j] = Σ_t x[i, t] · w[j, t]`.
pub fn matmul_t(x: &[f32], m: usize, w: &[f32], n: usize, k: usize, out: &mut [f32]) {
    assert!(x.len() >= m * k && w.len() >= n * k && out.len() >= m * n);
    if m == 0 || n == 0 {
        return;
    }
    // Small products (the tiny test models, one expert's few rows, decode steps) stay on
    // this thread: splitting them costs more than it saves.
    let threads = if m >= 16 && m * n * k >= 1 << 18 {
        rayon::current_num_threads()
    } else {
        1
    };
    // SAFETY: x is [m, k], w is [n, k], out is [m, n] with row stride n; the asserts above
    // bound every index.
    unsafe { crate::kernels::cpu::matmul::gemm_f32(x, m, w, n, k, n, out.as_mut_ptr(), threads) }
}

/// RMS norm of each `dim`-wide row in place, times `weight` when given.
pub fn rms_norm(x: &mut [f32], dim: usize, weight: Option<&[f32]>, eps: f32) {
    for row in x.chunks_exact_mut(dim) {
        let mean_sq = row.iter().map(|v| v * v).sum::<f32>() / dim as f32;
        let inv = 1.0 / (mean_sq + eps).sqrt();
        match weight {
            Some(w) => row.iter_mut().zip(w).for_each(|(v, w)| *v = w * (*v * inv)),
            None => row.iter_mut().for_each(|v| *v *= inv),
        }
    }
}

/// Inverse frequencies of one rotary pair each, YaRN-blended where configured (the
/// magnitude factor is never applied: DeepSeek-V4 leaves cos/sin unscaled).
pub fn inv_freqs(spec: &RopeSpec, rope_dim: usize) -> Vec<f32> {
    let half = rope_dim / 2;
    let base: Vec<f32> = (0..half)
        .map(|i| 1.0 / (spec.theta as f32).powf((2 * i) as f32 / rope_dim as f32))
        .collect();
    let Some(y) = &spec.yarn else {
        return base;
    };
    let correction = |rotations: f64| {
        rope_dim as f64
            * (y.original_max_position_embeddings / (rotations * 2.0 * std::f64::consts::PI)).ln()
            / (2.0 * spec.theta.ln())
    };
    let low = correction(y.beta_fast).floor().max(0.0);
    let mut high = correction(y.beta_slow).ceil().min(rope_dim as f64 - 1.0);
    if low == high {
        high += 0.001;
    }
    base.iter()
        .enumerate()
        .map(|(i, &extrapolated)| {
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0) as f32;
            let keep = 1.0 - ramp;
            let interpolated = extrapolated / y.factor as f32;
            interpolated * (1.0 - keep) + extrapolated * keep
        })
        .collect()
}

/// Rotates the trailing `2 · inv_freqs.len()` channels of each `dim`-wide row of `x`, in
/// consecutive pairs, at `position` (one position for all rows); `sign = -1` undoes it.
pub fn rope_rows(x: &mut [f32], dim: usize, inv_freqs: &[f32], position: usize, sign: f32) {
    let rope_dim = 2 * inv_freqs.len();
    let (cos, sin): (Vec<f32>, Vec<f32>) = inv_freqs
        .iter()
        .map(|f| {
            let angle = position as f32 * f;
            (angle.cos(), sign * angle.sin())
        })
        .unzip();
    for row in x.chunks_exact_mut(dim) {
        let tail = &mut row[dim - rope_dim..];
        for (i, pair) in tail.chunks_exact_mut(2).enumerate() {
            let (a, b) = (pair[0], pair[1]);
            pair[0] = a * cos[i] - b * sin[i];
            pair[1] = b * cos[i] + a * sin[i];
        }
    }
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// Router scores of one token's expert logits, in place.
pub fn score(logits: &mut [f32], scoring: Scoring) {
    match scoring {
        // torch's softplus returns x itself above 20.
        Scoring::SqrtSoftplus => logits.iter_mut().for_each(|x| {
            let sp = if *x > 20.0 { *x } else { x.exp().ln_1p() };
            *x = sp.sqrt();
        }),
        Scoring::Sigmoid => logits.iter_mut().for_each(|x| *x = sigmoid(*x)),
        Scoring::Softmax => softmax(logits),
    }
}

pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    x.iter_mut().for_each(|v| *v /= sum);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_then_inverse_is_identity_and_leaves_the_head_alone() {
        let freqs = inv_freqs(
            &RopeSpec {
                theta: 10000.0,
                yarn: None,
            },
            4,
        );
        let orig: Vec<f32> = (0..12).map(|i| i as f32 * 0.3 - 1.0).collect();
        let mut x = orig.clone();
        rope_rows(&mut x, 6, &freqs, 7, 1.0);
        assert_eq!(x[..2], orig[..2], "the leading channels carry no position");
        assert_ne!(x[2..6], orig[2..6]);
        rope_rows(&mut x, 6, &freqs, 7, -1.0);
        for (a, b) in x.iter().zip(&orig) {
            assert!((a - b).abs() < 1e-5);
        }
    }
}
