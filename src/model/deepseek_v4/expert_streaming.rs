//! Whether a step computes a layer's host-resident experts on the CPU or copies their
//! packed weights to the device and computes them there (`--stream-experts`). llama.cpp
//! copies a host layer's weights for batches of 32 rows and more; here the choice is the
//! cheaper of two times fitted from what this machine measured: the CPU's (no faster than
//! the host's read bandwidth for the experts it touches, nor than the best time a product
//! it has shown) and the copy's (the bytes over the upload bandwidth measured at load).
//! A prefill's thousands of rows on a layer's every expert copy; decode's few compute on
//! the CPU, which reads each touched expert once either way and skips the bus.

use std::fmt;
use std::str::FromStr;

/// `--stream-experts`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StreamExperts {
    /// By the measured times (`StreamCost`).
    #[default]
    Auto,
    /// Every step with host experts copies them (tests; the copy's own figures).
    Always,
    /// The CPU computes every host expert (the CPU part's own figures).
    Never,
}

impl FromStr for StreamExperts {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(StreamExperts::Auto),
            "always" => Ok(StreamExperts::Always),
            "never" => Ok(StreamExperts::Never),
            other => Err(format!(
                "--stream-experts {other}: expected auto, always or never"
            )),
        }
    }
}

impl fmt::Display for StreamExperts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StreamExperts::Auto => "auto",
            StreamExperts::Always => "always",
            StreamExperts::Never => "never",
        })
    }
}

/// The two times a layer's host part can take, from measured rates.
#[derive(Clone, Debug)]
pub struct StreamCost {
    pub mode: StreamExperts,
    /// A read of the host experts' memory, measured at load: the CPU's bound.
    pub host_read_bytes_per_s: f64,
    /// Copies of host experts to the device, measured at load.
    pub upload_bytes_per_s: f64,
    /// The fewest seconds a (token, expert) product has taken the CPU in a step so far.
    pub host_secs_per_product: Option<f64>,
}

impl StreamCost {
    pub fn new(mode: StreamExperts, host_read_bytes_per_s: f64, upload_bytes_per_s: f64) -> Self {
        StreamCost {
            mode,
            host_read_bytes_per_s,
            upload_bytes_per_s,
            host_secs_per_product: None,
        }
    }

    /// The CPU's time for `products` pairs over experts of `bytes`: its bandwidth bound
    /// or its compute bound, whichever is longer (the compute bound unknown until a step
    /// has shown it: the first such step computes on the CPU and measures).
    pub fn host_secs(&self, products: usize, bytes: usize) -> f64 {
        let read = bytes as f64 / self.host_read_bytes_per_s;
        let compute = self.host_secs_per_product.unwrap_or(0.0) * products as f64;
        read.max(compute)
    }

    /// The copy's time for experts of `bytes` (the device's products on them are
    /// far shorter and overlap the next copy).
    pub fn stream_secs(&self, bytes: usize) -> f64 {
        bytes as f64 / self.upload_bytes_per_s
    }

    /// Whether a layer's `products` pairs over touched experts of `bytes` go to the device.
    pub fn streams(&self, products: usize, bytes: usize) -> bool {
        match self.mode {
            StreamExperts::Always => products > 0,
            StreamExperts::Never => false,
            StreamExperts::Auto => {
                products > 0 && self.stream_secs(bytes) < self.host_secs(products, bytes)
            }
        }
    }

    /// `streams` for a step of `pairs` pairs spread evenly over `experts` experts of
    /// `expert_bytes` each (the router is trained to balance them): the choice a step
    /// is expected to make before its routing is known, as a recorded step must.
    pub fn streams_spread(&self, pairs: usize, experts: usize, expert_bytes: usize) -> bool {
        if experts == 0 {
            return false;
        }
        let n = experts as f64;
        let touched = n * (1.0 - (1.0 - 1.0 / n).powf(pairs as f64));
        self.streams(pairs, (touched.ceil() as usize).max(1) * expert_bytes)
    }

    /// The CPU took `secs` for `products` pairs.
    pub fn observe_host(&mut self, products: usize, secs: f64) {
        if products == 0 || secs.is_nan() || secs <= 0.0 {
            return;
        }
        let rate = secs / products as f64;
        self.host_secs_per_product = Some(self.host_secs_per_product.map_or(rate, |r| r.min(rate)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXPERT: usize = 13 << 20;

    /// An H100 machine's figures (issue 60's run): 115 GB/s host reads, 25 GB/s copies,
    /// 40 µs a product on 16 cores once compute-bound.
    fn measured() -> StreamCost {
        let mut c = StreamCost::new(StreamExperts::Auto, 115e9, 25e9);
        c.observe_host(24_576, 1.0);
        c
    }

    #[test]
    fn decode_computes_on_the_host_and_a_prefill_streams() {
        let c = measured();
        // Batch 1: 6 pairs on 6 experts.
        assert!(!c.streams(6, 6 * EXPERT));
        // Batch 32: ~190 pairs on ~135 experts; the CPU reads them faster than the bus.
        assert!(!c.streams(192, 135 * EXPERT));
        // 4 096 rows on all 256 experts.
        assert!(c.streams(24_576, 256 * EXPERT));
    }

    #[test]
    fn recorded_decode_steps_expect_the_host_and_prefills_the_bus() {
        let c = measured();
        // Expected touched experts for an even spread: every decode batch a graph takes
        // (up to 256 rows) keeps to the CPU, a 4 096-row prefill streams.
        for rows in [1usize, 8, 32, 64, 256] {
            assert!(!c.streams_spread(rows * 6, 256, EXPERT), "{rows} rows");
        }
        assert!(c.streams_spread(4096 * 6, 256, EXPERT));
        // The spread's touched count is between the pairs' worst and best case: more
        // rows never stream less.
        let first = (1..=4096)
            .find(|rows| c.streams_spread(rows * 6, 256, EXPERT))
            .unwrap();
        assert!((first..first + 64).all(|rows| c.streams_spread(rows * 6, 256, EXPERT)));
        let mut never = measured();
        never.mode = StreamExperts::Never;
        assert!(!never.streams_spread(4096 * 6, 256, EXPERT));
        never.mode = StreamExperts::Always;
        assert!(never.streams_spread(6, 256, EXPERT));
        assert!(!c.streams_spread(6, 0, EXPERT), "a layer with no experts");
    }

    #[test]
    fn the_crossover_follows_the_measured_rates() {
        let mut c = measured();
        let rows_to_stream = |c: &StreamCost| {
            (1..=4096)
                .find(|rows| c.streams(rows * 6, 256.min(rows * 6) * EXPERT))
                .expect("a prefill streams")
        };
        let before = rows_to_stream(&c);
        // A faster bus streams smaller steps.
        c.upload_bytes_per_s *= 2.0;
        let faster_bus = rows_to_stream(&c);
        assert!(faster_bus < before, "{faster_bus} vs {before}");
        // A faster CPU keeps larger ones.
        c.upload_bytes_per_s /= 2.0;
        c.observe_host(24_576, 0.25);
        assert!(rows_to_stream(&c) > before);
    }

    #[test]
    fn until_the_cpu_has_shown_its_compute_rate_it_is_held_to_its_bandwidth() {
        let c = StreamCost::new(StreamExperts::Auto, 115e9, 25e9);
        // The bus is slower than host reads: the first step measures the CPU.
        assert!(!c.streams(24_576, 256 * EXPERT));
        let mut c = c;
        c.observe_host(6, 0.0);
        assert_eq!(
            c.host_secs_per_product, None,
            "a zero time is no measurement"
        );
        c.observe_host(6, 1e-3);
        c.observe_host(24_576, 1.0);
        c.observe_host(6, 1e-3);
        assert_eq!(
            c.host_secs_per_product,
            Some(1.0 / 24_576.0),
            "the best rate stays"
        );
    }

    #[test]
    fn the_flag_overrides_the_model_and_is_read_by_name() {
        for (s, mode) in [
            ("auto", StreamExperts::Auto),
            ("always", StreamExperts::Always),
            ("never", StreamExperts::Never),
        ] {
            assert_eq!(s.parse::<StreamExperts>().unwrap(), mode);
            assert_eq!(mode.to_string(), s);
        }
        let err = "sometimes".parse::<StreamExperts>().unwrap_err();
        assert!(err.contains("--stream-experts sometimes"), "{err}");
        let mut c = measured();
        c.mode = StreamExperts::Always;
        assert!(c.streams(6, 6 * EXPERT));
        assert!(!c.streams(0, 0), "nothing to copy for a layer no row chose");
        c.mode = StreamExperts::Never;
        assert!(!c.streams(24_576, 256 * EXPERT));
    }
}
