//! Log-probabilities over a whole row: log-sum-exp and the k most likely ids, each one
//! pass over the vocabulary with no allocation beyond the k results.

/// `f32::total_cmp`'s key: ascending signed order of the key is ascending `total_cmp` order.
#[inline(always)]
fn order_key(value: f32) -> i32 {
    let bits = value.to_bits() as i32;
    bits ^ ((((bits >> 31) as u32) >> 1) as i32)
}

/// e^x for x ≤ 0 (x = logit − max), relative error below 3e-7; 0 below −87 (and for NaN). Branch-free
/// (Cephes' expf: x = n·ln 2 + r, a degree-5 polynomial in r, 2^n through the exponent
/// bits) so the log-sum-exp loop vectorizes — libm's exp per element would dominate a
/// greedy row.
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    // Adding 1.5 · 2^23 rounds to an integer, which then sits in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    const ROUND_BITS: i32 = 0x4B40_0000;
    let clamped = if x >= -87.0 { x } else { -87.0 };
    let shifted = clamped * std::f32::consts::LOG2_E + ROUND;
    let n = shifted - ROUND;
    let r = clamped - n * 0.693_359_4 - n * -2.121_944_4e-4;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    let two_to_n = f32::from_bits(((shifted.to_bits() as i32 - ROUND_BITS + 127) << 23) as u32);
    // The product before the select, or the select becomes a branch and nothing vectorizes.
    let e = y * two_to_n;
    if x >= -87.0 { e } else { 0.0 }
}

/// The largest value, NaNs skipped (−∞ for an empty or all-NaN row).
pub(super) fn max_value(values: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let chunks = values.chunks_exact(8);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane = if v > *lane { v } else { *lane };
        }
    }
    lanes
        .iter()
        .chain(rest)
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m })
}

/// ln Σ exp(values), as max + ln Σ exp(v − max) with the sum in f64 over 8 lanes. A row
/// whose max is ±∞ returns that max (no distribution to normalize).
pub fn log_sum_exp(values: &[f32]) -> f32 {
    let max = max_value(values);
    if !max.is_finite() {
        return max;
    }
    let mut lanes = [0f64; 8];
    let chunks = values.chunks_exact(8);
    let rest = chunks.remainder();
    for chunk in chunks {
        // The exps first, in f32 lanes, then the widening adds: both loops vectorize.
        let mut exps = [0f32; 8];
        for (e, &v) in exps.iter_mut().zip(chunk) {
            *e = exp_nonpositive(v - max);
        }
        for (lane, &e) in lanes.iter_mut().zip(&exps) {
            *lane += e as f64;
        }
    }
    let mut sum: f64 = lanes.iter().sum();
    for &v in rest {
        sum += exp_nonpositive(v - max) as f64;
    }
    max + sum.ln() as f32
}

/// The `k` largest `(id, value)` of `values`, descending by `total_cmp`, ties by lower id,
/// into `out` (cleared first). O(n) for the small k of top_logprobs: an id enters only if it
/// beats the current k-th.
pub(super) fn top_k_values(values: &[f32], k: usize, out: &mut Vec<(u32, f32)>) {
    out.clear();
    if k == 0 {
        return;
    }
    let mut threshold = i32::MIN;
    for (i, &v) in values.iter().enumerate() {
        let key = order_key(v);
        let full = out.len() == k;
        // Ids arrive in ascending order, so a value equal to the k-th loses its tie.
        if full && key <= threshold {
            continue;
        }
        let at = out.partition_point(|e| order_key(e.1) >= key);
        if full {
            out.pop();
        }
        out.insert(at, (i as u32, v));
        if out.len() == k {
            threshold = order_key(out[k - 1].1);
        }
    }
}

/// `(log_z, top)`: the log-normalizer of `log_softmax(values)` and its `k` most likely
/// `(id, logprob)`, descending, ties by id.
pub(super) fn log_softmax_top(values: &[f32], k: usize) -> (f32, Vec<(u32, f32)>) {
    let log_z = log_sum_exp(values);
    let mut top = Vec::with_capacity(k);
    top_k_values(values, k, &mut top);
    for e in &mut top {
        e.1 -= log_z;
    }
    (log_z, top)
}

/// A prompt token scored under the model's raw distribution at the position before it:
/// its logprob and the `k` most likely `(id, logprob)` there.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ScoredToken {
    pub logprob: f32,
    /// 1 + how many ids are more likely.
    pub rank: u32,
    pub top: Vec<(u32, f32)>,
}

/// `token` scored under `log_softmax(logits)`. Its logprob and the top ones are the same
/// subtraction, so a token that is the argmax reads exactly equal to the first top entry.
pub fn score_token(logits: &[f32], token: u32, k: usize) -> ScoredToken {
    let (log_z, top) = log_softmax_top(logits, k);
    let value = logits[token as usize];
    ScoredToken {
        logprob: value - log_z,
        rank: 1 + logits.iter().filter(|&&v| v > value).count() as u32,
        top,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_matches_libm() {
        for i in 0..=200_000 {
            let x = -(i as f32) * 87.0 / 200_000.0;
            let want = (x as f64).exp();
            let got = exp_nonpositive(x) as f64;
            assert!(
                ((got - want) / want).abs() < 3e-7,
                "exp({x}) = {got}, want {want}"
            );
        }
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_nonpositive(-100.0), 0.0);
    }

    #[test]
    fn top_k_values_breaks_ties_by_lower_id() {
        let mut out = Vec::new();
        top_k_values(&[1.0, 3.0, 2.0, 3.0, 2.0, 2.0], 3, &mut out);
        assert_eq!(out, vec![(1, 3.0), (3, 3.0), (2, 2.0)]);
        top_k_values(&[0.5; 4], 10, &mut out);
        assert_eq!(
            out.iter().map(|e| e.0).collect::<Vec<_>>(),
            vec![0, 1, 2, 3]
        );
    }
}
