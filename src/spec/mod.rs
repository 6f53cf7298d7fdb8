//! Speculative decoding's pure core: drafters that propose tokens with a confidence each,
//! exact verification of drafts against the target model's rows, and the confidence-
//! scheduled planner (DSpark) that sizes each request's verification under a step-time
//! model. No actor, runtime or device code: the engine feeds these logits and histories.
//!
//! - [`NgramDrafter`]: prompt lookup — the continuation of the latest earlier occurrence of
//!   the sequence's last n tokens; confidence calibrated online from observed acceptance.
//! - [`ModelDrafter`]: a draft model or an MTP layer run by the rank worker; the plan carries placeholders,
//!   confidences are the draft's own probabilities (one step late), calibrated.
//! - [`verify`]: greedy, stochastic rejection sampling (the output distribution is the
//!   target's), and the Gumbel-coupled mode whose seeded output does not depend on how many
//!   drafts were verified.
//! - [`plan_verification`]: the global verify budget that maximises expected tokens per
//!   second of step time, and per-request verify lengths.
//! - [`LatencyCurve`], [`CurveStore`]: decode step time by rows, measured once per backend,
//!   device and model and kept on disk; [`VerifyPrice`]: how much dearer verify steps run
//!   in the engine than that curve says, learned from the steps that ran.

mod calibration;
mod distribution;
mod latency;
mod model_drafter;
mod ngram;
mod planner;
mod step_cost;
pub mod verify;
mod verify_price;

pub use calibration::{Calibration, OwnFactor};
pub use distribution::{TargetDistribution, gumbel_pick};
pub use latency::{CurveError, CurveStore, LatencyCurve};
pub use model_drafter::{MODEL_DRAFT, ModelDraftCalibration, ModelDrafter};
pub use ngram::{NgramCalibration, NgramDrafter};
pub use planner::{
    ConfidenceBuffer, CurveCost, SpecRequest, VerifyPlan, plan_verification,
    plan_verification_skipping,
};
pub use step_cost::{LinearCost, StepCost, StepFeatures};
pub use verify_price::VerifyPrice;

/// One proposed token and the drafter's confidence that the target accepts it, given that
/// every earlier draft of the same step was accepted.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Draft {
    pub token: u32,
    pub confidence: f32,
}

/// A source of draft tokens for one sequence.
pub trait Drafter {
    /// Up to `max_drafts` tokens to follow `history` (prompt and generated tokens).
    fn propose(&mut self, history: &[u32], max_drafts: usize) -> Vec<Draft>;
    /// `propose` for a look-ahead past a first proposal, leaving what `observe` attributes
    /// its outcome to as the first proposal left it.
    fn extend(&mut self, history: &[u32], max_drafts: usize) -> Vec<Draft> {
        self.propose(history, max_drafts)
    }
    /// Up to `max_drafts` tokens for a row that continues an in-flight one (zero-overhead
    /// scheduling plans it before that row is done): `history` is what is known, and the
    /// in-flight row verifies `in_flight` drafts and then draws a token nobody knows yet.
    /// The proposal after `history` predicts both: that row keeps the drafts it agrees
    /// with and draws its next token, and the drafts are what follows. The first draft's
    /// confidence carries the chance that the in-flight row yields exactly that (every
    /// predicted token right): otherwise the drafts follow the wrong tokens.
    fn propose_continuing(
        &mut self,
        history: &[u32],
        in_flight: &[u32],
        max_drafts: usize,
    ) -> Vec<Draft> {
        // A proposal stops where the history ends; a loop shorter than the lookahead
        // needed goes on, so look up again after what was proposed. The look-ahead's
        // positions past the first proposal are as deep in a run of accepted drafts as
        // its last one, and get its confidence.
        let needed = in_flight.len() + 1 + max_drafts;
        let mut lookahead = self.propose(history, needed);
        let deepest = lookahead.last().map_or(0.0, |d| d.confidence);
        let mut extended = Vec::new();
        while !lookahead.is_empty() && lookahead.len() < needed {
            if extended.is_empty() {
                extended.extend_from_slice(history);
            }
            let from = extended.len();
            extended.extend(lookahead[from - history.len()..].iter().map(|d| d.token));
            let more = self.extend(&extended, needed - lookahead.len());
            if more.is_empty() {
                break;
            }
            lookahead.extend(more.into_iter().map(|d| Draft {
                confidence: deepest,
                ..d
            }));
        }
        let num_kept = in_flight
            .iter()
            .zip(&lookahead)
            .take_while(|(d, p)| **d == p.token)
            .count();
        if lookahead.len() <= num_kept + 1 {
            return Vec::new();
        }
        let guessed: f32 = lookahead[..=num_kept]
            .iter()
            .map(|d| d.confidence)
            .product();
        let mut drafts = lookahead.split_off(num_kept + 1);
        drafts.truncate(max_drafts);
        drafts[0].confidence *= guessed;
        drafts
    }
    /// What verification made of the last proposal: `num_accepted` of `num_verified`.
    fn observe(&mut self, num_verified: usize, num_accepted: usize);
    /// The probabilities a draft model gave the drafts it filled in for the last proposal.
    fn observe_draft_probs(&mut self, _probs: &[f32]) {}
    /// Whether the last proposal's confidences rest on enough verified proposals to act
    /// on; until then the planner lets its drafts be verified to learn from.
    fn calibrated(&self) -> bool {
        true
    }
}

/// Verified proposals a calibration needs before its confidences may keep drafts from
/// being verified at all.
pub const MIN_CALIBRATION_OBSERVATIONS: u64 = 16;

/// A sequence's drafter, as the engine configures it.
#[derive(Debug, Clone)]
pub enum SeqDrafter {
    Ngram(NgramDrafter),
    Model(ModelDrafter),
}

impl Drafter for SeqDrafter {
    fn propose(&mut self, history: &[u32], max_drafts: usize) -> Vec<Draft> {
        match self {
            SeqDrafter::Ngram(d) => d.propose(history, max_drafts),
            SeqDrafter::Model(d) => d.propose(history, max_drafts),
        }
    }
    fn extend(&mut self, history: &[u32], max_drafts: usize) -> Vec<Draft> {
        match self {
            SeqDrafter::Ngram(d) => d.extend(history, max_drafts),
            SeqDrafter::Model(d) => d.extend(history, max_drafts),
        }
    }
    fn propose_continuing(
        &mut self,
        history: &[u32],
        in_flight: &[u32],
        max_drafts: usize,
    ) -> Vec<Draft> {
        match self {
            SeqDrafter::Ngram(d) => d.propose_continuing(history, in_flight, max_drafts),
            SeqDrafter::Model(d) => d.propose_continuing(history, in_flight, max_drafts),
        }
    }
    fn observe(&mut self, num_verified: usize, num_accepted: usize) {
        match self {
            SeqDrafter::Ngram(d) => d.observe(num_verified, num_accepted),
            SeqDrafter::Model(d) => d.observe(num_verified, num_accepted),
        }
    }
    fn observe_draft_probs(&mut self, probs: &[f32]) {
        match self {
            SeqDrafter::Ngram(d) => d.observe_draft_probs(probs),
            SeqDrafter::Model(d) => d.observe_draft_probs(probs),
        }
    }
    fn calibrated(&self) -> bool {
        match self {
            SeqDrafter::Ngram(d) => d.calibrated(),
            SeqDrafter::Model(d) => d.calibrated(),
        }
    }
}
