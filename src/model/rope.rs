//! Rotary position tables: inverse frequencies (with Llama 3 / linear scaling or GGUF
//! frequency factors) expanded to `[max_pos, head_dim]` rows of cos halves then sin halves.

use std::f64::consts::PI;

use super::config::{ModelConfig, RopeScaling};

pub fn inv_freqs(cfg: &ModelConfig, freq_factors: Option<&[f32]>) -> Vec<f64> {
    let hd = cfg.head_dim;
    let mut freqs: Vec<f64> = (0..hd / 2)
        .map(|i| {
            // transformers computes the exponent in f32; match it so positions agree to the ulp.
            let exponent = (2 * i) as f32 / hd as f32;
            1.0 / cfg.rope_theta.powf(exponent as f64)
        })
        .collect();
    match cfg.rope_scaling {
        RopeScaling::None => {}
        RopeScaling::Linear { factor } => freqs.iter_mut().for_each(|f| *f /= factor),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings: old_ctx,
        } => {
            let low_freq_wavelen = old_ctx / low_freq_factor;
            let high_freq_wavelen = old_ctx / high_freq_factor;
            for f in freqs.iter_mut() {
                let wavelen = 2.0 * PI / *f;
                if wavelen < high_freq_wavelen {
                    continue;
                }
                if wavelen > low_freq_wavelen {
                    *f /= factor;
                } else {
                    let smooth = (old_ctx / wavelen - low_freq_factor)
                        / (high_freq_factor - low_freq_factor);
                    *f = (1.0 - smooth) * *f / factor + smooth * *f;
                }
            }
        }
    }
    if let Some(factors) = freq_factors {
        for (f, &d) in freqs.iter_mut().zip(factors) {
            *f /= d as f64;
        }
    }
    freqs
}

pub fn cos_sin_table(inv_freqs: &[f64], max_pos: usize) -> Vec<f32> {
    let half = inv_freqs.len();
    let mut table = vec![0f32; max_pos * 2 * half];
    for pos in 0..max_pos {
        let row = &mut table[pos * 2 * half..(pos + 1) * 2 * half];
        for (i, &f) in inv_freqs.iter().enumerate() {
            // The angle in f32, as transformers forms it, before cos/sin.
            let angle = (pos as f32 * f as f32) as f64;
            row[i] = angle.cos() as f32;
            row[half + i] = angle.sin() as f32;
        }
    }
    table
}
