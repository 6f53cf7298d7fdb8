//! The scheduler's side of a draft model (`--spec draft`) or an MTP layer (`--spec mtp`,
//! which drafts the same way). The drafting model itself runs in the rank worker, right
//! before the target's forward pass, so the planned row carries
//! placeholders ([`MODEL_DRAFT`]) that the worker replaces with the draft's greedy tokens.
//! What the scheduler needs here is a confidence per position to size verification by:
//! the draft model's own probabilities of its tokens, known one step late (they come back
//! with the step's samples), scaled per position by how often drafts of that probability
//! were actually accepted.

use crate::sync::{Arc, Mutex};

use super::{Draft, Drafter};

/// The token a planned row carries where the rank worker's draft model fills in a draft.
pub const MODEL_DRAFT: u32 = 0;

/// Per draft position: (Σ draft probability, Σ accepted) over verified drafts, and how many
/// proposals were verified. Shared by the drafters of one engine: calibration is a
/// property of the two models.
pub type ModelDraftCalibration = Arc<Mutex<(Vec<(f64, f64)>, u64)>>;

/// Pseudo-observations that start every position at calibration factor 1.
const PRIOR_WEIGHT: f64 = 4.0;
/// Probability assumed before a sequence's first drafts came back.
const PRIOR_PROB: f32 = 0.5;

#[derive(Debug, Clone)]
pub struct ModelDrafter {
    calibration: ModelDraftCalibration,
    /// The draft model's probabilities of its last drafts, by position (one step old).
    last_probs: Vec<f32>,
}

impl ModelDrafter {
    pub fn calibration(max_drafts: usize) -> ModelDraftCalibration {
        Arc::new(Mutex::new((
            vec![(PRIOR_WEIGHT, PRIOR_WEIGHT); max_drafts],
            0,
        )))
    }

    pub fn new(calibration: ModelDraftCalibration) -> Self {
        ModelDrafter {
            calibration,
            last_probs: Vec::new(),
        }
    }
}

impl Drafter for ModelDrafter {
    fn propose(&mut self, _history: &[u32], max_drafts: usize) -> Vec<Draft> {
        let calibration = self.calibration.lock().unwrap_or_else(|e| e.into_inner());
        (0..max_drafts)
            .map(|i| {
                let prob = self.last_probs.get(i).copied().unwrap_or(PRIOR_PROB);
                let factor = calibration
                    .0
                    .get(i)
                    .map_or(1.0, |&(predicted, accepted)| accepted / predicted);
                Draft {
                    token: MODEL_DRAFT,
                    confidence: (prob as f64 * factor).clamp(0.0, 1.0) as f32,
                }
            })
            .collect()
    }

    /// The rank drafts from the continued token itself, once it knows it: nothing to
    /// guess.
    fn propose_continuing(
        &mut self,
        history: &[u32],
        _in_flight: &[u32],
        max_drafts: usize,
    ) -> Vec<Draft> {
        self.propose(history, max_drafts)
    }

    fn observe(&mut self, num_verified: usize, num_accepted: usize) {
        let mut calibration = self.calibration.lock().unwrap_or_else(|e| e.into_inner());
        if num_verified > 0 {
            calibration.1 += 1;
        }
        // Positions reached: every one up to the first rejection.
        let reached = num_verified.min(num_accepted + 1);
        for (i, c) in calibration.0.iter_mut().take(reached).enumerate() {
            c.0 += self.last_probs.get(i).copied().unwrap_or(PRIOR_PROB) as f64;
            if i < num_accepted {
                c.1 += 1.0;
            }
        }
    }

    fn observe_draft_probs(&mut self, probs: &[f32]) {
        self.last_probs.clear();
        self.last_probs.extend_from_slice(probs);
    }

    fn calibrated(&self) -> bool {
        self.calibration.lock().unwrap_or_else(|e| e.into_inner()).1
            >= super::MIN_CALIBRATION_OBSERVATIONS
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn confidence_is_the_draft_probability_scaled_by_observed_acceptance() {
        let mut d = ModelDrafter::new(ModelDrafter::calibration(3));
        let first = d.propose(&[], 3);
        assert!(first.iter().all(|x| x.token == MODEL_DRAFT));
        assert!(
            first.iter().all(|x| x.confidence == PRIOR_PROB),
            "{first:?}"
        );
        // The draft says 0.9 at position 0 and 0.8 at 1, but position 0 is accepted
        // every time and position 1 never: confidence follows what happened.
        for _ in 0..200 {
            d.observe_draft_probs(&[0.9, 0.8]);
            d.observe(2, 1);
        }
        d.observe_draft_probs(&[0.9, 0.8]);
        let learned = d.propose(&[], 3);
        assert!(learned[0].confidence > 0.95, "{learned:?}");
        assert!(learned[1].confidence < 0.05, "{learned:?}");
        // Position 2 was never verified: the prior probability, factor 1.
        assert_eq!(learned[2].confidence, PRIOR_PROB);
        // A lower draft probability lowers the confidence at a calibrated position.
        d.observe_draft_probs(&[0.3]);
        assert!(d.propose(&[], 1)[0].confidence < 0.4);
    }
}
