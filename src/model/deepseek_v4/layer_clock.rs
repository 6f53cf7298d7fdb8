//! `TROUPE_LAYER_TIMES=1`: each eager step's blocks timed one by one (the device waited on
//! after each), split into the layers with host experts and the others, and a streamed
//! layer's copies apart from its compute: where a step with host experts spends its time,
//! at the price of the overlap the waits take away. Off by default; a measurement aid.

use std::time::Instant;

use crate::kernels::deepseek_v4::DsV4Kernels;

/// Whether `TROUPE_LAYER_TIMES=1` is set (read once).
pub fn enabled() -> bool {
    static ON: crate::sync::OnceLock<bool> = crate::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("TROUPE_LAYER_TIMES").as_deref() == Ok("1"))
}

/// Waits for every op queued on `b` so far (one float read back from `buf`).
pub fn settle<B: DsV4Kernels>(b: &B, buf: &B::Buf) {
    std::hint::black_box(b.read_floats(buf, 0..1));
}

/// One step's per-block seconds.
pub struct LayerClock {
    started: Instant,
    /// (seconds, whether the layer has host experts), by layer.
    layers: Vec<(f64, bool)>,
}

impl LayerClock {
    /// Starts once the step's earlier ops are done (`settle` first).
    pub fn start() -> Self {
        LayerClock {
            started: Instant::now(),
            layers: Vec::new(),
        }
    }

    /// The block just settled; `host`: it has host experts.
    pub fn lap(&mut self, host: bool) {
        let now = Instant::now();
        self.layers.push(((now - self.started).as_secs_f64(), host));
        self.started = now;
    }

    /// One log line: the host layers' seconds one by one, the others' sum and mean.
    pub fn report(&self, tokens: usize) {
        let host: Vec<String> = self
            .layers
            .iter()
            .enumerate()
            .filter(|(_, (_, h))| *h)
            .map(|(l, (s, _))| format!("{l}: {:.1}", s * 1e3))
            .collect();
        let others: Vec<f64> = self
            .layers
            .iter()
            .filter(|(_, h)| !*h)
            .map(|(s, _)| *s)
            .collect();
        let sum: f64 = others.iter().sum();
        tracing::info!(
            "layer times, {tokens} tokens: host-expert layers (ms) [{}], {} other layers {:.1} ms ({:.2} ms each)",
            host.join(", "),
            others.len(),
            sum * 1e3,
            sum * 1e3 / others.len().max(1) as f64
        );
    }
}
