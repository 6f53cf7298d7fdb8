//! Prompt-lookup drafting: no extra weights. The sequence's last n tokens (n from `max_n`
//! down to `min_n`) are looked up among its earlier tokens, prompt and generated alike;
//! the tokens that followed the latest earlier occurrence are the drafts. A longer match
//! predicts better, so confidences are calibrated per match length and draft position,
//! and scaled by how the sequence's own drafts fared against that (`OwnFactor`).

use crate::sync::{Arc, Mutex};

use super::{Calibration, Draft, Drafter, OwnFactor};

/// Per match length `n` (index n − min_n): acceptance by draft position. Shared by the
/// drafters of one engine: how often the model follows a match is a property of the model
/// and the drafter, so every sequence starts from what the others observed.
pub type NgramCalibration = Arc<Mutex<Vec<Calibration>>>;

#[derive(Debug, Clone)]
pub struct NgramDrafter {
    min_n: usize,
    max_n: usize,
    calibration: NgramCalibration,
    /// The match length of the last proposal, for `observe`.
    last_n: Option<usize>,
    /// This sequence's drafts against the shared rates.
    own: OwnFactor,
}

/// Before any observation, a draft is taken to be accepted at this rate, with the weight of
/// this many observations.
const PRIOR_RATE: f64 = 0.5;
const PRIOR_WEIGHT: f64 = 4.0;

impl NgramDrafter {
    pub fn new(min_n: usize, max_n: usize, max_drafts: usize) -> Self {
        Self::with_calibration(min_n, max_n, Self::calibration(min_n, max_n, max_drafts))
    }

    /// A fresh calibration for drafters of these match lengths, to share.
    pub fn calibration(min_n: usize, max_n: usize, max_drafts: usize) -> NgramCalibration {
        Arc::new(Mutex::new(
            (min_n..=max_n)
                .map(|_| Calibration::new(max_drafts, PRIOR_RATE, PRIOR_WEIGHT))
                .collect(),
        ))
    }

    /// A drafter reading and feeding a shared `calibration` (from `calibration` with the
    /// same match lengths).
    pub fn with_calibration(min_n: usize, max_n: usize, calibration: NgramCalibration) -> Self {
        assert!(1 <= min_n && min_n <= max_n, "need 1 ≤ min_n ≤ max_n");
        NgramDrafter {
            min_n,
            max_n,
            calibration,
            last_n: None,
            own: OwnFactor::default(),
        }
    }

    /// Where the continuation of the latest earlier occurrence of the last `n` tokens
    /// starts, if there is one with at least one token after it.
    fn find(history: &[u32], n: usize) -> Option<usize> {
        let len = history.len();
        if len <= n {
            return None;
        }
        let pattern = &history[len - n..];
        // Latest first: recent text predicts the next tokens best.
        (0..len - n)
            .rev()
            .find(|&start| &history[start..start + n] == pattern)
            .map(|start| start + n)
    }
}

impl NgramDrafter {
    /// The proposal and the match length it came from.
    fn lookup(&self, history: &[u32], max_drafts: usize) -> Option<(usize, Vec<Draft>)> {
        (self.min_n..=self.max_n).rev().find_map(|n| {
            let from = Self::find(history, n)?;
            let to = (from + max_drafts).min(history.len());
            let calibration = self.calibration.lock().unwrap_or_else(|e| e.into_inner());
            let calibration = &calibration[n - self.min_n];
            let drafts = history[from..to]
                .iter()
                .enumerate()
                .map(|(i, &token)| Draft {
                    token,
                    confidence: self.own.apply(calibration.rate(i)),
                })
                .collect();
            Some((n, drafts))
        })
    }
}

impl Drafter for NgramDrafter {
    fn propose(&mut self, history: &[u32], max_drafts: usize) -> Vec<Draft> {
        let found = self.lookup(history, max_drafts);
        self.last_n = found.as_ref().map(|(n, _)| *n);
        found.map(|(_, drafts)| drafts).unwrap_or_default()
    }

    fn extend(&mut self, history: &[u32], max_drafts: usize) -> Vec<Draft> {
        self.lookup(history, max_drafts)
            .map(|(_, drafts)| drafts)
            .unwrap_or_default()
    }

    fn observe(&mut self, num_verified: usize, num_accepted: usize) {
        if let Some(n) = self.last_n.take() {
            let mut calibration = self.calibration.lock().unwrap_or_else(|e| e.into_inner());
            let shared = &mut calibration[n - self.min_n];
            self.own
                .observe(shared.expected_accepted(num_verified), num_accepted);
            shared.observe(num_verified, num_accepted);
        }
    }

    fn calibrated(&self) -> bool {
        self.last_n.is_none_or(|n| {
            let calibration = self.calibration.lock().unwrap_or_else(|e| e.into_inner());
            calibration[n - self.min_n].num_observed() >= super::MIN_CALIBRATION_OBSERVATIONS
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(drafts: &[Draft]) -> Vec<u32> {
        drafts.iter().map(|d| d.token).collect()
    }

    #[test]
    fn proposes_what_followed_the_latest_longest_match() {
        let mut d = NgramDrafter::new(1, 3, 4);
        // "5 6 7" occurred twice; the latest occurrence is followed by 8 9 10.
        let history = [5, 6, 7, 1, 2, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7];
        assert_eq!(tokens(&d.propose(&history, 4)), vec![8, 9, 10, 11]);
        assert_eq!(tokens(&d.propose(&history, 2)), vec![8, 9]);
        // The continuation stops at the end of the history.
        assert_eq!(tokens(&d.propose(&[3, 4, 3], 5)), vec![4, 3]);
        assert!(d.propose(&[1, 2, 3], 4).is_empty(), "no earlier occurrence");
        assert!(d.propose(&[], 4).is_empty());
    }

    #[test]
    fn a_continuing_row_drafts_after_what_the_row_before_it_will_keep_and_draw() {
        let mut d = NgramDrafter::new(1, 3, 4);
        let history = [1, 2, 3, 1, 2, 3, 1, 2];
        // The row in flight verifies 3 1, which the loop agrees with: it keeps them and
        // draws 2; the drafts go on with the loop past the end of the history.
        assert_eq!(
            tokens(&d.propose_continuing(&history, &[3, 1], 4)),
            vec![3, 1, 2, 3]
        );
        // Drafts the loop disagrees with are taken as rejected: it draws 3 instead.
        assert_eq!(
            tokens(&d.propose_continuing(&history, &[9, 9], 3)),
            vec![1, 2, 3]
        );
        assert!(
            d.propose_continuing(&[5, 6, 7], &[], 2).is_empty(),
            "nothing to look up"
        );
    }

    #[test]
    fn a_continuing_row_is_only_as_sure_as_the_guess_of_what_precedes_it() {
        let calibration = NgramDrafter::calibration(1, 3, 4);
        let mut d = NgramDrafter::with_calibration(1, 3, calibration.clone());
        let history = [1, 2, 3, 1, 2, 3, 1, 2];
        for i in 0..40 {
            // The loop's three tokens: all accepted, or (one time in four) none.
            d.propose(&history, 4);
            d.observe(3, if i % 4 == 0 { 0 } else { 3 });
        }
        let rate = |i: usize| calibration.lock().unwrap()[2].rate(i);
        // A new sequence's drafter (its own factor still 1) reads the shared rates.
        let mut d = NgramDrafter::with_calibration(1, 3, calibration.clone());
        let drafts = d.propose_continuing(&history, &[3, 1], 4);
        assert_eq!(tokens(&drafts), vec![3, 1, 2, 3]);
        // The row in flight yields 3 1 (kept) and 2 (drawn) only with every one right.
        let guessed = rate(0) * rate(1) * rate(2);
        assert!(
            (drafts[0].confidence - guessed * rate(2)).abs() < 1e-6,
            "{drafts:?}"
        );
        // The look-ahead past the first proposal (three tokens, the loop) is as deep in
        // a run of accepted drafts as its last one, not back at the prior.
        assert!(
            drafts[1..].iter().all(|x| x.confidence == rate(2)),
            "{drafts:?}"
        );
        assert!(rate(2) > 0.9 && rate(0) < 0.8, "{} {}", rate(0), rate(2));
    }

    #[test]
    fn a_lookahead_past_the_first_proposal_leaves_its_match_length_to_observe() {
        let calibration = NgramDrafter::calibration(1, 2, 3);
        let mut d = NgramDrafter::with_calibration(1, 2, calibration.clone());
        assert!(!d.propose(&[4, 8, 1, 4, 8], 3).is_empty(), "a match of 2");
        assert!(!d.extend(&[9, 1, 5, 1], 3).is_empty(), "a match of 1 only");
        d.observe(2, 2);
        let counts: Vec<u64> = calibration
            .lock()
            .unwrap()
            .iter()
            .map(Calibration::num_observed)
            .collect();
        assert_eq!(counts, vec![0, 1], "the first proposal's length learns");
    }

    #[test]
    fn confidence_learns_per_match_length_and_position() {
        let mut d = NgramDrafter::new(2, 2, 3);
        let history = [1, 2, 3, 4, 5, 1, 2];
        let first = d.propose(&history, 3);
        assert_eq!(tokens(&first), vec![3, 4, 5]);
        assert!(first.iter().all(|x| x.confidence == 0.5));
        for _ in 0..50 {
            d.propose(&history, 3);
            d.observe(3, 1); // the first draft always right, the second always wrong
        }
        let learned = d.propose(&history, 3);
        // Its own drafts fared as the shared rates expect: its factor stays near 1.
        assert!((d.own.factor() - 1.0).abs() < 0.1, "{:?}", d.own);
        let learned: Vec<f32> = learned
            .iter()
            .map(|x| (x.confidence as f64 / d.own.factor()) as f32)
            .collect();
        assert!(learned[0] > 0.9, "{learned:?}");
        assert!(learned[1] < 0.1, "{learned:?}");
        assert!(
            (learned[2] - 0.5).abs() < 1e-6,
            "position 2 was never reached: {learned:?}"
        );
    }

    #[test]
    fn sequences_sharing_a_calibration_keep_their_own_record() {
        let calibration = NgramDrafter::calibration(2, 2, 3);
        let history = [1, 2, 3, 4, 5, 1, 2];
        let mut looping = NgramDrafter::with_calibration(2, 2, calibration.clone());
        let mut wandering = NgramDrafter::with_calibration(2, 2, calibration.clone());
        for _ in 0..20 {
            looping.propose(&history, 3);
            looping.observe(3, 3);
            wandering.propose(&history, 3);
            wandering.observe(3, 0);
        }
        let shared = calibration.lock().unwrap()[0].rate(0);
        let (l, w) = (looping.propose(&history, 3), wandering.propose(&history, 3));
        // Half the first drafts were accepted: the shared rate says one in two.
        assert!((shared - 0.5).abs() < 0.05, "{shared}");
        assert!(l[0].confidence > 0.8, "{l:?}");
        assert!(w[0].confidence < 0.35, "{w:?}");
        let fresh = NgramDrafter::with_calibration(2, 2, calibration.clone()).propose(&history, 3);
        assert_eq!(
            fresh[0].confidence, shared,
            "a new sequence starts from the shared rate"
        );
    }
}
