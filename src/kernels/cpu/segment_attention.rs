//! Attention without a mask inside segments of rows (an image encoder's windows), and the
//! erf GELU, on the host.

use rayon::prelude::*;

use super::matmul::gemm_f32;

/// Row `r` of `q`, `k`, `v` (`[rows, heads · head_dim]`) attends to the rows of its segment
/// (`bounds`: row offsets from 0 up to the rows), scaled by `1 / sqrt(head_dim)`.
pub fn segment_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    bounds: &[usize],
    heads: usize,
    hd: usize,
    out: &mut [f32],
) {
    let h = heads * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    let head_rows = |x: &[f32], lo: usize, hi: usize, head: usize| -> Vec<f32> {
        (lo..hi)
            .flat_map(|t| &x[t * h + head * hd..][..hd])
            .copied()
            .collect()
    };
    let segments: Vec<(usize, usize)> = bounds.windows(2).map(|w| (w[0], w[1])).collect();
    let results: Vec<(usize, Vec<f32>)> = segments
        .par_iter()
        .flat_map_iter(|&(lo, hi)| (0..heads).map(move |head| (lo, hi, head)))
        .map(|(lo, hi, head)| {
            let len = hi - lo;
            let (qs, ks) = (head_rows(q, lo, hi, head), head_rows(k, lo, hi, head));
            // V transposed: the second GEMM's weight rows are V's columns.
            let mut vt = vec![0f32; hd * len];
            for j in 0..len {
                for (d, &x) in v[(lo + j) * h + head * hd..][..hd].iter().enumerate() {
                    vt[d * len + j] = x;
                }
            }
            // Scores and the weighted values as GEMMs on this thread (the pool is busy
            // with the other segments and heads).
            let mut scores = vec![0f32; len * len];
            // SAFETY: `scores` holds len × len, `qs` and `ks` len × hd each.
            unsafe { gemm_f32(&qs, len, &ks, len, hd, len, scores.as_mut_ptr(), 1) };
            for row in scores.chunks_exact_mut(len) {
                let max = row.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s * scale));
                let mut total = 0f32;
                row.iter_mut().for_each(|s| {
                    *s = (*s * scale - max).exp();
                    total += *s;
                });
                row.iter_mut().for_each(|s| *s /= total);
            }
            let mut block = vec![0f32; len * hd];
            // SAFETY: `block` holds len × hd, `scores` len × len, `vt` hd × len.
            unsafe { gemm_f32(&scores, len, &vt, hd, len, hd, block.as_mut_ptr(), 1) };
            (lo * h + head * hd, block)
        })
        .collect();
    for (start, block) in results {
        for (i, row) in block.chunks_exact(hd).enumerate() {
            out[start + i * h..][..hd].copy_from_slice(row);
        }
    }
}

/// GELU as `nn.GELU()` computes it: with the error function, not the tanh fit.
pub fn gelu(x: &mut [f32]) {
    x.par_iter_mut().with_min_len(1 << 12).for_each(|v| {
        let x = f64::from(*v);
        *v = (0.5 * x * (1.0 + libm::erf(x / std::f64::consts::SQRT_2))) as f32;
    });
}
