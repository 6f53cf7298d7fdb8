//! Confidence-scheduled verification (DSpark): how many of each request's drafts to verify
//! this step. A draft at position i is worth its survival S(r, i) = Π_{j ≤ i} conf(r, j) —
//! the chance that it and every draft before it are accepted — in expected tokens. Slots
//! (r, i) are ranked by S, ties by position then request (deterministic); the global budget
//! B takes the B best and maximises expected tokens per second of step time:
//!
//! `(N + Σ of the B best S) / step_cost(rows with their verify tokens)`
//!
//! where N counts the requests (each yields at least one token), and verifies nothing
//! unless that beats the plain step's N per second by `MIN_ADVANTAGE`. S never grows along a
//! request's drafts and ties go to the earlier position, so each request's chosen slots
//! form a prefix: its verify length. The step cost comes from the scheduler's fitted
//! cost(q, c) with each request's row at its own context, so a step that also carries
//! prefill chunks is costed as it will run. A request with a missing or invalid confidence
//! verifies all its drafts.

use std::collections::HashMap;

use super::LatencyCurve;
use super::step_cost::{LinearCost, StepCost, StepFeatures};

/// The measured decode curve at the step's token count (graph buckets and all) — or, for a
/// step with verify rows, the measured verify steps' curve where there is one (their
/// sampling, and on a GPU their attention, differ from a decode step's) — plus the fitted model's terms a short
/// decode step does not show: attention over each row's context (c2·Σq·c) and within
/// multi-token rows (c3·(Σq² − Σq)).
pub struct CurveCost<'a> {
    pub curve: &'a LatencyCurve,
    /// The fitted model's coefficients (only its attention terms are read).
    pub model: LinearCost,
    /// How much dearer than the curve a verify step runs in the engine (`VerifyPrice`).
    pub verify_factor: f64,
}

impl StepCost for CurveCost<'_> {
    fn step_secs(&self, f: &StepFeatures) -> f64 {
        let [_, _, c2, c3] = self.model.0;
        let tokens = f.sum_q.round() as usize;
        let decode = self.curve.secs(tokens);
        // Σq² > Σq: some row holds more than one token.
        let verifies = f.sum_q_squared > f.sum_q + 0.5;
        let base = match self.curve.verify_secs(tokens) {
            Some(verify) if verifies => verify.max(decode),
            _ => decode,
        };
        let base = if verifies {
            base * self.verify_factor
        } else {
            base
        };
        base + c2 * f.sum_q_times_c + c3 * (f.sum_q_squared - f.sum_q)
    }
}

/// One speculating request as the planner sees it.
#[derive(Debug, Clone)]
pub struct SpecRequest {
    /// Confidence per draft, in draft order; `None` where the drafter gave none.
    pub confidences: Vec<Option<f32>>,
    /// Tokens of context its row attends to.
    pub num_context_tokens: usize,
    /// Its confidences rest on enough observations to act on; else every draft is
    /// verified, as if it had none: the drafter has to learn, and a drafter kept out by
    /// its prior would never learn.
    pub calibrated: bool,
    /// Under ZOS its sequence sits out the step after a verify row (else it is continued
    /// and no step is charged).
    pub sits_out_after: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct VerifyPlan {
    /// Per request: how many of its drafts to verify.
    pub verify_lens: Vec<usize>,
    /// Expected tokens the step yields (each request's 1 plus its verified survivals).
    pub expected_tokens: f64,
    /// The step's predicted seconds.
    pub predicted_secs: f64,
}

/// How much more a step that verifies must promise than the plain step, in tokens per
/// second. The promise is an estimate — confidences calibrated on past drafts, a continuing
/// row's guess of what its verify row keeps — and where every sequence must finish (no
/// request waits for the slot a faster one frees), tokens accepted off the longest
/// sequence's path shorten nothing: copy prompts past their end, whose verify steps
/// promised 10–30 % and ran 10–20 % slower, measured 0.80–0.85× speculation off at 32
/// and 128 requests with a margin of 10 % (0.71× with fixed K).
pub const MIN_ADVANTAGE: f64 = 1.3;

fn valid(c: Option<f32>) -> Option<f64> {
    c.filter(|c| c.is_finite() && (0.0..=1.0).contains(c))
        .map(|c| c as f64)
}

/// Plans one step. `other_rows` holds the step's rows besides the speculating requests'
/// (prefill chunks, plain decode rows), as `(new tokens, cached tokens)`.
pub fn plan_verification(
    requests: &[SpecRequest],
    other_rows: &[(usize, usize)],
    cost: &impl StepCost,
) -> VerifyPlan {
    plan_verification_skipping(requests, other_rows, cost, 0.0)
}

/// `plan_verification` when a verify row costs its request `skip_tokens` expected tokens
/// besides its step time. Under zero-overhead scheduling a sequence whose row verifies
/// drafts sits out the next step (its token count is unknown when that step is planned),
/// where a plain row would have been continued: verifying yields 1 + ΣS tokens over two
/// steps against 2 without, so a request's drafts are dropped unless the survivals chosen
/// for it add up to more than one token (`skip_tokens` = 1).
pub fn plan_verification_skipping(
    requests: &[SpecRequest],
    other_rows: &[(usize, usize)],
    cost: &impl StepCost,
    skip_tokens: f64,
) -> VerifyPlan {
    let mut verify_lens = vec![0usize; requests.len()];
    let mut features = StepFeatures::of_rows(other_rows);
    // (survival, position, request) for every draft the planner may choose.
    let mut slots: Vec<(f64, usize, usize)> = Vec::new();
    for (r, req) in requests.iter().enumerate() {
        let confidences: Option<Vec<f64>> = req.confidences.iter().map(|&c| valid(c)).collect();
        match confidences.filter(|_| req.calibrated) {
            Some(confidences) => {
                let mut survival = 1.0;
                for (i, c) in confidences.into_iter().enumerate() {
                    survival *= c;
                    slots.push((survival, i, r));
                }
            }
            None => verify_lens[r] = req.confidences.len(),
        }
        features.add_row(1 + verify_lens[r], req.num_context_tokens);
    }
    slots.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));

    let base_tokens = requests.len() as f64;
    let charge = |r: usize| {
        if requests[r].sits_out_after {
            skip_tokens
        } else {
            0.0
        }
    };
    let plain_value = base_tokens / cost.step_secs(&features);
    let mut best = (plain_value * MIN_ADVANTAGE, 0usize);
    let mut gained = 0.0;
    let mut counts = verify_lens.clone();
    for (b, &(survival, _, r)) in slots.iter().enumerate() {
        if counts[r] == 0 {
            // Its first draft puts the request's row out of the next step.
            gained -= charge(r);
        }
        // Request r's row grows from q to q + 1 tokens at its context c.
        let (q, c) = (
            (1 + counts[r]) as f64,
            requests[r].num_context_tokens as f64,
        );
        features.sum_q += 1.0;
        features.sum_q_times_c += c;
        features.sum_q_squared += 2.0 * q + 1.0;
        counts[r] += 1;
        gained += survival;
        let value = (base_tokens + gained) / cost.step_secs(&features);
        if value > best.0 {
            best = (value, b + 1);
        }
    }
    let mut gained_by = vec![0.0f64; requests.len()];
    let mut chosen_lens = vec![0usize; requests.len()];
    for &(survival, _, r) in &slots[..best.1] {
        chosen_lens[r] += 1;
        gained_by[r] += survival;
    }
    let mut expected_tokens = base_tokens;
    for r in 0..requests.len() {
        // A request whose chosen drafts are not worth its skipped step verifies none.
        if chosen_lens[r] > 0 && gained_by[r] > charge(r) {
            verify_lens[r] += chosen_lens[r];
            expected_tokens += gained_by[r];
        }
    }
    let mut chosen = StepFeatures::of_rows(other_rows);
    for (req, &len) in requests.iter().zip(&verify_lens) {
        chosen.add_row(1 + len, req.num_context_tokens);
    }
    VerifyPlan {
        verify_lens,
        expected_tokens,
        predicted_secs: cost.step_secs(&chosen),
    }
}

/// Under zero-overhead scheduling step N+1 is planned before step N's drafts are verified,
/// so the confidences that size it are those published a step earlier: writers fill the
/// back buffer, `swap` at the step boundary makes it the one readers see.
#[derive(Debug, Default)]
pub struct ConfidenceBuffer {
    front: HashMap<u64, Vec<Option<f32>>>,
    back: HashMap<u64, Vec<Option<f32>>>,
}

impl ConfidenceBuffer {
    /// Records `seq_id`'s newest draft confidences, visible after the next `swap`.
    pub fn publish(&mut self, seq_id: u64, confidences: Vec<Option<f32>>) {
        self.back.insert(seq_id, confidences);
    }

    /// The confidences published before the last `swap`; `None` if there were none
    /// (the planner then verifies every draft).
    pub fn get(&self, seq_id: u64) -> Option<&[Option<f32>]> {
        self.front.get(&seq_id).map(Vec::as_slice)
    }

    pub fn swap(&mut self) {
        std::mem::swap(&mut self.front, &mut self.back);
        self.back.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// c0 + c1·Σq + c2·Σq·c + c3·Σq²: a fixed 10 ms plus 0.1 ms per token.
    fn cost() -> LinearCost {
        LinearCost([0.010, 0.0001, 0.0, 0.0])
    }

    fn req(confidences: &[f32]) -> SpecRequest {
        SpecRequest {
            confidences: confidences.iter().map(|&c| Some(c)).collect(),
            num_context_tokens: 100,
            calibrated: true,
            sits_out_after: true,
        }
    }

    /// Expected tokens per second for given verify lengths, by brute force.
    fn value(requests: &[SpecRequest], lens: &[usize], cost: &LinearCost) -> f64 {
        let mut tokens = requests.len() as f64;
        let mut rows = Vec::new();
        for (r, &len) in requests.iter().zip(lens) {
            let mut s = 1.0;
            for c in &r.confidences[..len] {
                s *= c.unwrap() as f64;
                tokens += s;
            }
            rows.push((1 + len, r.num_context_tokens));
        }
        tokens / cost.predict(&rows)
    }

    #[test]
    fn a_verify_row_that_costs_the_next_step_must_be_worth_more_than_a_token() {
        let requests = [req(&[0.99, 0.98, 0.97]), req(&[0.6, 0.3]), req(&[0.95])];
        let free = plan_verification(&requests, &[], &cost());
        assert!(free.verify_lens.iter().all(|&l| l > 0), "{free:?}");
        // Survivals: 0.99 + 0.97 + 0.94 > 1 keeps its drafts; 0.6 + 0.18 and 0.95 do not.
        let zos = plan_verification_skipping(&requests, &[], &cost(), 1.0);
        assert_eq!(zos.verify_lens, vec![free.verify_lens[0], 0, 0], "{zos:?}");
        assert!(zos.expected_tokens < free.expected_tokens);
        assert!(zos.predicted_secs < free.predicted_secs);
        // A drafter still learning has every draft verified.
        let mut learning = requests.to_vec();
        learning.iter_mut().for_each(|r| r.calibrated = false);
        let explore = plan_verification_skipping(&learning, &[], &cost(), 1.0);
        assert_eq!(explore.verify_lens, vec![3, 2, 1]);
        // Nor is a request whose sequence is continued after its verify row.
        let mut continued = requests.to_vec();
        continued.iter_mut().for_each(|r| r.sits_out_after = false);
        let next = plan_verification_skipping(&continued, &[], &cost(), 1.0);
        assert_eq!(next.verify_lens, free.verify_lens);
    }

    #[test]
    fn the_budget_maximises_tokens_per_second_over_every_prefix_choice() {
        let requests = [
            req(&[0.9, 0.9, 0.8, 0.5, 0.2]),
            req(&[0.3, 0.9, 0.9, 0.9, 0.9]),
            req(&[0.99, 0.99, 0.99, 0.99, 0.99]),
        ];
        let cost = LinearCost([0.002, 0.0005, 0.0, 0.0]);
        let plan = plan_verification(&requests, &[], &cost);
        let got = value(&requests, &plan.verify_lens, &cost);
        // Every combination of verify lengths (6³) does no better.
        for a in 0..=5 {
            for b in 0..=5 {
                for c in 0..=5 {
                    let v = value(&requests, &[a, b, c], &cost);
                    assert!(v <= got + 1e-9, "{:?} beats {:?}", [a, b, c], plan);
                }
            }
        }
        assert!(plan.verify_lens.iter().any(|&l| l > 0), "{plan:?}");
        assert!((plan.expected_tokens / plan.predicted_secs - got).abs() < 1e-6);
    }

    #[test]
    fn a_verify_step_that_promises_little_over_a_plain_one_is_not_run() {
        // 8 rows, a draft of 0.15 each, a step of 9.2 ms plus 0.1 ms a token: the best
        // choice promises (8 + 1.2) / 10.8 ms, 6 % over 8 / 10 ms — within the estimate's
        // error — so nothing is verified.
        let requests: Vec<SpecRequest> = (0..8).map(|_| req(&[0.15])).collect();
        let cost = LinearCost([0.0092, 0.0001, 0.0, 0.0]);
        let plain = 8.0 / cost.predict(&[(1, 100); 8]);
        let all = value(&requests, &[1; 8], &cost);
        assert!(
            all > plain && all < plain * MIN_ADVANTAGE,
            "{all} vs {plain}"
        );
        assert_eq!(
            plan_verification(&requests, &[], &cost).verify_lens,
            vec![0; 8]
        );
        // Drafts worth 0.9 each promise 60 % more: verified.
        let sure: Vec<SpecRequest> = (0..8).map(|_| req(&[0.9])).collect();
        assert_eq!(plan_verification(&sure, &[], &cost).verify_lens, vec![1; 8]);
    }

    #[test]
    fn confident_drafts_are_verified_and_doubtful_ones_are_not() {
        let requests = [req(&[0.95, 0.95, 0.95, 0.95]), req(&[0.02, 0.9, 0.9, 0.9])];
        let plan = plan_verification(&requests, &[], &cost());
        assert_eq!(plan.verify_lens, vec![4, 0]);
        // Fixed-K would verify 8 tokens; the plan verifies 4 and expects to lose only the
        // second request's 0.02 + 0.018 + ….
        assert!(plan.expected_tokens > 2.0 + 3.0);
    }

    #[test]
    fn an_expensive_step_verifies_less() {
        let requests = [req(&[0.6, 0.6, 0.6, 0.6, 0.6])];
        let cheap = plan_verification(&requests, &[], &cost());
        // Each extra token costs as much as the whole fixed overhead.
        let dear = plan_verification(&requests, &[], &LinearCost([0.001, 0.001, 0.0, 0.0]));
        assert!(
            dear.verify_lens[0] < cheap.verify_lens[0],
            "{dear:?} {cheap:?}"
        );
    }

    #[test]
    fn missing_or_invalid_confidence_verifies_everything() {
        let mut broken = req(&[0.01, 0.01, 0.01]);
        broken.confidences[1] = None;
        let mut nan = req(&[0.01, 0.01]);
        nan.confidences[0] = Some(f32::NAN);
        let plan = plan_verification(
            &[broken, nan, req(&[1.5]), req(&[0.001])],
            &[(512, 0)],
            &cost(),
        );
        assert_eq!(plan.verify_lens, vec![3, 2, 1, 0]);
    }

    #[test]
    fn ties_are_broken_by_position_then_request() {
        let requests = [req(&[0.5, 0.5]), req(&[0.5, 0.5])];
        // A cost where exactly three verify tokens pay off is hard to pin; instead check
        // that equal inputs give equal lengths and that the plan is a pure function.
        let a = plan_verification(&requests, &[], &cost());
        let b = plan_verification(&requests, &[], &cost());
        assert_eq!(a, b);
        assert!(a.verify_lens[0] >= a.verify_lens[1]);
        assert!(a.verify_lens[0] - a.verify_lens[1] <= 1);
    }

    #[test]
    fn a_measured_bucket_jump_caps_the_budget() {
        // Flat to 16 tokens (one graph bucket), then twice as slow.
        let curve =
            LatencyCurve::new(vec![(1, 0.010), (16, 0.010), (17, 0.020), (32, 0.021)]).unwrap();
        let model = LinearCost([0.0, 0.0, 0.0, 0.0]);
        let cost = CurveCost {
            curve: &curve,
            model,
            verify_factor: 1.0,
        };
        let requests: Vec<SpecRequest> = (0..4).map(|_| req(&[0.7; 5])).collect();
        let plan = plan_verification(&requests, &[], &cost);
        let total: usize = plan.verify_lens.iter().sum::<usize>() + requests.len();
        assert_eq!(total, 16, "{plan:?}");
        assert_eq!(plan.verify_lens, vec![3, 3, 3, 3]);
    }

    #[test]
    fn drafts_are_verified_only_when_they_pay_for_a_dearer_step() {
        // Decode steps replay graphs (10 ms flat); a step with verify rows takes 25 ms.
        let curve = LatencyCurve::new(vec![(1, 0.010), (64, 0.010)])
            .unwrap()
            .with_verify(LatencyCurve::new(vec![(2, 0.025), (128, 0.025)]).unwrap());
        let cost = CurveCost {
            curve: &curve,
            model: LinearCost([0.0; 4]),
            verify_factor: 1.0,
        };
        // 8 rows whose drafts are worth 0.99 tokens each: 15.9 tokens in 25 ms < 8 in 10.
        let poor: Vec<SpecRequest> = (0..8).map(|_| req(&[0.6, 0.5, 0.3])).collect();
        assert_eq!(plan_verification(&poor, &[], &cost).verify_lens, vec![0; 8]);
        // Worth 3.5 each: 36 tokens in 25 ms beat 8 in 10.
        let good: Vec<SpecRequest> = (0..8).map(|_| req(&[0.99, 0.95, 0.9, 0.85])).collect();
        assert_eq!(plan_verification(&good, &[], &cost).verify_lens, vec![4; 8]);
        // Without the verify curve the same poor drafts look free.
        let decode_only = LatencyCurve::new(vec![(1, 0.010), (64, 0.010)]).unwrap();
        let flat = CurveCost {
            curve: &decode_only,
            model: LinearCost([0.0; 4]),
            verify_factor: 1.0,
        };
        assert_eq!(plan_verification(&poor, &[], &flat).verify_lens, vec![3; 8]);
        // Where verify steps were seen to run 4× dearer than the curve says, even drafts
        // worth 2.9 tokens a row are not: 31 tokens in 40 ms < 8 in 10.
        let good: Vec<SpecRequest> = (0..8).map(|_| req(&[0.99, 0.98, 0.97])).collect();
        assert_eq!(plan_verification(&good, &[], &flat).verify_lens, vec![3; 8]);
        let dear = CurveCost {
            verify_factor: 4.0,
            ..flat
        };
        assert_eq!(plan_verification(&good, &[], &dear).verify_lens, vec![0; 8]);
    }

    #[test]
    fn confidences_are_one_step_old() {
        let mut buf = ConfidenceBuffer::default();
        buf.publish(7, vec![Some(0.9)]);
        assert_eq!(buf.get(7), None, "not visible before the step boundary");
        buf.swap();
        assert_eq!(buf.get(7), Some(&[Some(0.9)][..]));
        buf.publish(7, vec![Some(0.1)]);
        assert_eq!(buf.get(7), Some(&[Some(0.9)][..]));
        buf.swap();
        assert_eq!(buf.get(7), Some(&[Some(0.1)][..]));
        buf.swap();
        assert_eq!(buf.get(7), None, "nothing published for a step");
    }
}
