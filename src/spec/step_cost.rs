//! What a step costs, as the verification planner prices it: the step's features and
//! the `StepCost` the scheduler's fitted model (in `sched`) and the measured decode curve
//! implement. It lives here so that the scheduler depends on speculation, not both ways.

/// Sums of a step's per-row features (the constant term is implicit).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepFeatures {
    pub sum_q: f64,
    pub sum_q_times_c: f64,
    pub sum_q_squared: f64,
}

impl StepFeatures {
    pub fn of_rows(rows: &[(usize, usize)]) -> Self {
        let mut f = Self::default();
        for &(q, c) in rows {
            f.add_row(q, c);
        }
        f
    }

    pub fn add_row(&mut self, num_new_tokens: usize, num_cached_tokens: usize) {
        let (q, c) = (num_new_tokens as f64, num_cached_tokens as f64);
        self.sum_q += q;
        self.sum_q_times_c += q * c;
        self.sum_q_squared += q * q;
    }

    pub fn as_array(&self) -> [f64; 4] {
        [1.0, self.sum_q, self.sum_q_times_c, self.sum_q_squared]
    }
}

impl std::ops::Add for StepFeatures {
    type Output = Self;
    fn add(self, other: Self) -> Self {
        Self {
            sum_q: self.sum_q + other.sum_q,
            sum_q_times_c: self.sum_q_times_c + other.sum_q_times_c,
            sum_q_squared: self.sum_q_squared + other.sum_q_squared,
        }
    }
}

/// What the planner prices a step with.
pub trait StepCost {
    fn step_secs(&self, features: &StepFeatures) -> f64;
}

/// Fixed coefficients `[c0, c1, c2, c3]`: `c0 + c1·Σq + c2·Σq·c + c3·Σq²` seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinearCost(pub [f64; 4]);

impl LinearCost {
    /// The seconds of a step of `(q, c)` rows.
    pub fn predict(&self, rows: &[(usize, usize)]) -> f64 {
        self.step_secs(&StepFeatures::of_rows(rows))
    }
}

impl StepCost for LinearCost {
    fn step_secs(&self, features: &StepFeatures) -> f64 {
        let x = features.as_array();
        (0..4).map(|k| self.0[k] * x[k]).sum()
    }
}
