//! The readback thread: waits for each launched step's picks, in launch order, and hands
//! them on (the leader's: to the sampler), so the rank worker is free to launch the next
//! step meanwhile; it times the steps as they overlap on the device.

use std::time::Instant;

use super::fault::FaultPlan;
use crate::kernels::{DeviceMark, Pending};
use crate::step::StepLogits;

/// A step read back: its logits and its window on the device.
pub struct ReadStep {
    pub logits: StepLogits,
    /// When it began (the previous step's end, or its launch if the device idled).
    pub started: Instant,
    /// The worker's idle time before this step (waiting for work or for ZOS tokens).
    pub idle_secs: f64,
    /// The device's idle time before this step on its own timeline (CUDA events).
    pub device_idle_secs: Option<f64>,
}

/// A launched step on its way to the sampler.
pub struct Readback {
    pub step_id: u64,
    pub logits: Pending<StepLogits>,
    pub span: Option<(DeviceMark, DeviceMark)>,
    /// When the worker began launching it.
    pub launched: Instant,
    /// Where it goes once read back; `None`: nowhere (a follower rank, a void step).
    pub deliver: Option<Box<dyn FnOnce(ReadStep) + Send>>,
}

/// When a step began on the device, and how long the device idled before it. Steps
/// overlap: one launched while the step before it still ran began when that one's picks
/// landed; one launched later began at its launch, the device idle in between.
fn step_window(launched: Instant, previous_done: Option<Instant>) -> (Instant, f64) {
    match previous_done {
        None => (launched, 0.0),
        Some(done) => (
            done.max(launched),
            launched.saturating_duration_since(done).as_secs_f64(),
        ),
    }
}

/// Waits for each launched step's picks, in launch order, and delivers them. Ends when
/// the worker drops its sender, or after a failed readback, reported through `failed`.
pub fn spawn_readback(
    rank: usize,
    failed: impl FnOnce(String) + Send + 'static,
    faults: FaultPlan,
) -> std::io::Result<crate::sync::channel::Sender<Readback>> {
    let (tx, rx) = crate::sync::channel::unbounded::<Readback>();
    std::thread::Builder::new()
        .name(format!("troupe-readback-{rank}"))
        .spawn(move || {
            // When the previous step's picks landed, and its last work on the device.
            let mut last_done: Option<Instant> = None;
            let mut last_end: Option<DeviceMark> = None;
            for r in rx {
                let waited = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    if faults.take_readback_failure() {
                        panic!("waiting for a step's picks failed (injected fault)");
                    }
                    (r.logits)()
                }));
                let logits = match waited {
                    Ok(logits) => logits,
                    Err(panic) => {
                        let reason = panic
                            .downcast_ref::<&str>()
                            .map(|s| s.to_string())
                            .or_else(|| panic.downcast_ref::<String>().cloned())
                            .unwrap_or_else(|| "a readback panicked".into());
                        failed(format!("rank {rank}: step {}: {reason}", r.step_id));
                        return;
                    }
                };
                let (started, idle_secs) = step_window(r.launched, last_done);
                last_done = Some(Instant::now());
                // Both events are reached: this step's picks landed after its last work.
                let device_idle_secs = match (&last_end, &r.span) {
                    (Some(end), Some((start, _))) => end.secs_until(start),
                    _ => None,
                };
                if let Some((_, end)) = r.span {
                    last_end = Some(end);
                }
                tracing::debug!(
                    rank,
                    step = r.step_id,
                    deliver = r.deliver.is_some(),
                    "step read back"
                );
                if let Some(deliver) = r.deliver {
                    deliver(ReadStep {
                        logits,
                        started,
                        idle_secs,
                        device_idle_secs,
                    });
                }
            }
        })?;
    Ok(tx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn overlapping_steps_are_timed_from_the_previous_steps_end() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        // Launched at 10 while the step before ran until 25: it began at 25, no idle.
        assert_eq!(step_window(ms(10), Some(ms(25))), (ms(25), 0.0));
        // Launched at 40 after the step before ended at 25: 15 ms idle.
        let (start, idle) = step_window(ms(40), Some(ms(25)));
        assert_eq!(start, ms(40));
        assert!((idle - 0.015).abs() < 1e-9, "{idle}");
        assert_eq!(step_window(ms(5), None), (ms(5), 0.0));
    }
}
