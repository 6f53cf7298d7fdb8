//! What a step with verify rows really costs in this engine, next to what the measured
//! curve says. The curve times one forward pass and its picks; a whole engine step also
//! pays the host's work per token (the sampler's verification, histories, metadata), which
//! grows with the verified tokens and can make speculation a loss where the curve says it
//! pays (a wide batch on a fast GPU). The ratio of each step's observed period to its
//! predicted seconds is kept for plain and for verify steps, by batch size; a verify step
//! is priced at the curve times their quotient, so confidence scheduling verifies less,
//! down to nothing, where verifying does not pay.

/// Observations before a bucket's quotient is used (until then it is 1).
const MIN_OBSERVATIONS: u32 = 8;
/// Weight of the newest observation in the running mean of log ratios (a plain mean over
/// the first ones).
const SMOOTHING: f64 = 0.1;
/// After this many plain steps of a bucket in a row, each further one moves its verify
/// steps' mean `FORGET` of the way towards the plain steps': where the price kept
/// verification out, no verify step updates it, and what priced it out (a slow step, a
/// load that has passed) must not keep it out for good.
const QUIET_STEPS: u32 = 16;
const FORGET: f64 = 0.02;
/// The quotient is kept within these bounds: a stray period (a host hiccup, a GC of the
/// prefix cache) must not price verification out for good.
const MIN_FACTOR: f64 = 0.5;
const MAX_FACTOR: f64 = 8.0;
/// Batch-size buckets: powers of two up to 2^11 rows.
const NUM_BUCKETS: usize = 12;

#[derive(Debug, Clone, Copy, Default)]
struct LogRatio {
    mean: f64,
    count: u32,
}

impl LogRatio {
    fn observe(&mut self, ratio: f64) {
        self.count = self.count.saturating_add(1);
        let weight = (1.0 / self.count as f64).max(SMOOTHING);
        self.mean += weight * (ratio.ln() - self.mean);
    }
}

/// Per batch-size bucket: observed over predicted seconds of plain and of verify steps.
#[derive(Debug, Clone, Default)]
pub struct VerifyPrice {
    plain: [LogRatio; NUM_BUCKETS],
    verify: [LogRatio; NUM_BUCKETS],
    /// Plain steps since the bucket's last verify step.
    quiet: [u32; NUM_BUCKETS],
}

fn bucket(num_rows: usize) -> usize {
    (usize::BITS - num_rows.max(1).leading_zeros() - 1).min(NUM_BUCKETS as u32 - 1) as usize
}

impl VerifyPrice {
    /// A decode step of `num_rows` rows (`verifies`: some verify drafts) took
    /// `observed_secs` where the curve predicted `predicted_secs`.
    pub fn observe(
        &mut self,
        num_rows: usize,
        verifies: bool,
        predicted_secs: f64,
        observed_secs: f64,
    ) {
        if !(predicted_secs > 0.0 && observed_secs > 0.0 && observed_secs.is_finite()) {
            return;
        }
        let b = bucket(num_rows);
        let ratio = observed_secs / predicted_secs;
        if verifies {
            self.verify[b].observe(ratio);
            self.quiet[b] = 0;
        } else {
            self.plain[b].observe(ratio);
            self.quiet[b] = self.quiet[b].saturating_add(1);
            if self.quiet[b] > QUIET_STEPS {
                let (plain, verify) = (self.plain[b].mean, &mut self.verify[b]);
                verify.mean += FORGET * (plain - verify.mean);
            }
        }
    }

    /// How much dearer than the curve says a verify step of `num_rows` rows runs,
    /// relative to a plain step of as many rows. Where every step of that size verified
    /// (a wide batch always has some draft), plain steps of the nearest size stand in,
    /// and without any, the curve itself (a ratio of 1).
    pub fn factor(&self, num_rows: usize) -> f64 {
        let b = bucket(num_rows);
        let verify = self.verify[b];
        if verify.count < MIN_OBSERVATIONS {
            return 1.0;
        }
        let seen = |i: usize| Some(self.plain[i]).filter(|p| p.count >= MIN_OBSERVATIONS);
        let plain = (0..NUM_BUCKETS)
            .flat_map(|d| [b.checked_sub(d), Some(b + d)])
            .flatten()
            .filter(|&i| i < NUM_BUCKETS)
            .find_map(seen)
            .map_or(0.0, |p| p.mean);
        (verify.mean - plain).exp().clamp(MIN_FACTOR, MAX_FACTOR)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verify_steps_are_priced_by_how_they_ran_against_plain_steps_of_their_batch() {
        let mut p = VerifyPrice::default();
        for i in 0..7 {
            let jitter = 1.0 + 0.01 * i as f64;
            p.observe(128, false, 1e-3, 3e-3 * jitter);
            p.observe(128, true, 2e-3, 12e-3 * jitter);
        }
        assert_eq!(p.factor(128), 1.0, "too few observations to act on");
        for _ in 0..40 {
            p.observe(128, false, 1e-3, 3e-3);
            p.observe(128, true, 2e-3, 12e-3);
        }
        // Plain steps run 3× the curve, verify steps 6×: verify steps cost twice more.
        assert!((p.factor(128) - 2.0).abs() < 0.02, "{}", p.factor(128));
        assert!((p.factor(200) - p.factor(128)).abs() < 1e-12, "one bucket");
        assert_eq!(p.factor(1), 1.0, "another batch size learns on its own");
        // A batch size whose steps all verified: plain steps of the nearest size stand in.
        for _ in 0..40 {
            p.observe(512, true, 1e-3, 9e-3);
        }
        assert!((p.factor(512) - 3.0).abs() < 0.02, "{}", p.factor(512));
        let mut alone = VerifyPrice::default();
        for _ in 0..40 {
            alone.observe(64, true, 1e-3, 2.5e-3);
        }
        assert!(
            (alone.factor(64) - 2.5).abs() < 1e-9,
            "against the curve itself"
        );
        // A bucket where verification ran as the curve says keeps the curve's price.
        for _ in 0..20 {
            p.observe(1, false, 1e-3, 2e-3);
            p.observe(1, true, 2e-3, 4e-3);
        }
        assert!((p.factor(1) - 1.0).abs() < 1e-9, "{}", p.factor(1));
        // Nonsense timings are not observed; the quotient stays bounded.
        p.observe(4, true, 0.0, 1.0);
        p.observe(4, true, 1.0, f64::NAN);
        for _ in 0..20 {
            p.observe(4, false, 1.0, 1.0);
            p.observe(4, true, 1.0, 1e3);
        }
        assert_eq!(p.factor(4), MAX_FACTOR);
        // Plain steps alone (verification priced out) bring the price back towards the
        // curve's, so verification is tried again.
        for _ in 0..300 {
            p.observe(4, false, 1.0, 1.0);
        }
        assert!(p.factor(4) < 1.05, "{}", p.factor(4));
    }
}
