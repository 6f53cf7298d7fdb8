//! DeepSeek-V4's rotary frequencies: one per rotated pair of the partial RoPE the kernels
//! apply (`DsV4Kernels::dsv4_rope`).

use super::config::RopeSpec;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::deepseek_v4::rope_rows;

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
