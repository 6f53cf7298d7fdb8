//! Online calibration of draft confidences: per draft position, the acceptance rate seen
//! so far under a Beta prior, so a drafter's confidence is what verification actually
//! accepted at that position (given the drafts before it were accepted).

/// Acceptance counts per draft position.
#[derive(Debug, Clone)]
pub struct Calibration {
    /// Per position: (verified, accepted), the position reached with every earlier draft
    /// accepted.
    counts: Vec<(u64, u64)>,
    /// Beta prior pseudo-counts (accepted, rejected).
    prior: (f64, f64),
}

impl Calibration {
    /// `prior_rate` with the weight of `prior_weight` observations.
    pub fn new(max_positions: usize, prior_rate: f64, prior_weight: f64) -> Self {
        Calibration {
            counts: vec![(0, 0); max_positions],
            prior: (prior_rate * prior_weight, (1.0 - prior_rate) * prior_weight),
        }
    }

    /// The calibrated acceptance probability at draft `position`. Past the positions
    /// counted (a look-ahead for a row that continues one in flight) the last position's:
    /// deep in a run of accepted drafts the rate levels off, where the prior would halve
    /// each further draft's survival.
    pub fn rate(&self, position: usize) -> f32 {
        let last = self.counts.len().saturating_sub(1);
        let (verified, accepted) = self
            .counts
            .get(position.min(last))
            .copied()
            .unwrap_or((0, 0));
        let (a, b) = self.prior;
        ((accepted as f64 + a) / (verified as f64 + a + b)) as f32
    }

    /// How many proposals were verified (their first position reached).
    pub fn num_observed(&self) -> u64 {
        self.counts.first().map_or(0, |c| c.0)
    }

    /// The accepted drafts a proposal verified to `num_verified` was expected to yield:
    /// the rates of the positions it could reach (each reached only past the ones before).
    pub fn expected_accepted(&self, num_verified: usize) -> f64 {
        let mut survival = 1.0;
        (0..num_verified)
            .map(|i| {
                survival *= self.rate(i) as f64;
                survival
            })
            .sum()
    }

    /// Positions `0..num_verified` were verified; the first `num_accepted` were accepted
    /// (the one after them, if verified, was rejected; later ones were never reached).
    pub fn observe(&mut self, num_verified: usize, num_accepted: usize) {
        let reached = num_verified.min(num_accepted + 1).min(self.counts.len());
        for (i, c) in self.counts.iter_mut().take(reached).enumerate() {
            c.0 += 1;
            if i < num_accepted {
                c.1 += 1;
            }
        }
    }
}

/// One sequence's accepted drafts over what the shared calibration expected of its
/// proposals, as a factor on the shared rates: a sequence whose text does not repeat
/// (drafts matched by chance) verifies less, one in a loop more. Sampled text varies most
/// in this: past its end one sequence loops while the next wanders. Older rows fade, so
/// a sequence that falls into a loop is believed within a few rows.
#[derive(Debug, Clone, Copy, Default)]
pub struct OwnFactor {
    accepted: f64,
    expected: f64,
}

/// The factor's prior: this many expected (and accepted) tokens.
const OWN_PRIOR_TOKENS: f64 = 2.0;
/// Weight left to the older rows at each observation.
const OWN_DECAY: f64 = 0.8;

impl OwnFactor {
    pub fn factor(&self) -> f64 {
        (self.accepted + OWN_PRIOR_TOKENS) / (self.expected + OWN_PRIOR_TOKENS)
    }

    /// A row was expected to accept `expected` drafts (`Calibration::expected_accepted`)
    /// and accepted `accepted`.
    pub fn observe(&mut self, expected: f64, accepted: usize) {
        self.accepted = self.accepted * OWN_DECAY + accepted as f64;
        self.expected = self.expected * OWN_DECAY + expected;
    }

    /// `rate` scaled by the factor, kept a probability.
    pub fn apply(&self, rate: f32) -> f32 {
        (rate as f64 * self.factor()).min(1.0) as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_follow_observed_acceptance_from_the_prior() {
        let mut c = Calibration::new(3, 0.5, 2.0);
        assert_eq!(c.rate(0), 0.5);
        // 90 of 100 first drafts accepted, and of those 90, 30 second drafts.
        for i in 0..100 {
            match i {
                0..30 => c.observe(3, 2),
                30..90 => c.observe(3, 1),
                _ => c.observe(3, 0),
            }
        }
        assert!((c.rate(0) - 91.0 / 102.0).abs() < 1e-6, "{}", c.rate(0));
        assert!((c.rate(1) - 31.0 / 92.0).abs() < 1e-6, "{}", c.rate(1));
        // Position 2 was reached 30 times and never accepted.
        assert!((c.rate(2) - 1.0 / 32.0).abs() < 1e-6, "{}", c.rate(2));
        assert_eq!(
            c.rate(7),
            c.rate(2),
            "past the counted positions, the last one's"
        );
        assert_eq!(
            Calibration::new(0, 0.25, 2.0).rate(3),
            0.25,
            "nothing counted"
        );
        // Three positions reachable: r0 + r0·r1 + r0·r1·r2.
        let (r0, r1, r2) = (c.rate(0) as f64, c.rate(1) as f64, c.rate(2) as f64);
        let want = r0 + r0 * r1 + r0 * r1 * r2;
        assert!((c.expected_accepted(3) - want).abs() < 1e-6);
        assert_eq!(c.expected_accepted(0), 0.0);
    }

    #[test]
    fn a_sequences_own_factor_follows_its_recent_acceptance() {
        let fresh = OwnFactor::default();
        assert_eq!(fresh.factor(), 1.0, "a new sequence takes the shared rates");
        let (mut wanders, mut loops) = (fresh, fresh);
        for _ in 0..30 {
            wanders.observe(1.5, 0);
            loops.observe(1.5, 4);
        }
        // Steady state: (a / (1 − decay) + prior) / (e / (1 − decay) + prior).
        let steady = |a: f64| (a / 0.2 + 2.0) / (1.5 / 0.2 + 2.0);
        assert!((wanders.factor() - steady(0.0)).abs() < 1e-2, "{wanders:?}");
        assert!((loops.factor() - steady(4.0)).abs() < 1e-2, "{loops:?}");
        assert_eq!(loops.apply(0.9), 1.0, "a probability still");
        assert!((wanders.apply(0.5) as f64 - 0.5 * steady(0.0)).abs() < 1e-2);
        // A sequence that falls into a loop is believed within a few rows.
        for _ in 0..6 {
            wanders.observe(1.5, 4);
        }
        assert!(wanders.factor() > 1.2, "{wanders:?}");
    }
}
