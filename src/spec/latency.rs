//! The decode latency curve: seconds a decode step takes by its number of rows, measured
//! once per backend, device and model shape (at each graph bucket on a GPU) and kept on
//! disk, so the verify planner prices K more tokens per request from what this hardware
//! did rather than from a fit that has only seen plain decode steps.
//!
//! Files live under `<dir>/<key>.json`, the key a SHA-256 of the backend, the device and
//! the model's config: new hardware, a new driver or another model measures afresh. A
//! missing, unreadable or malformed file is measured again and rewritten.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// Seconds per decode step at measured row counts, rows ascending.
/// Why a latency curve could not be made or read back.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum CurveError {
    #[error("a latency curve needs at least one point")]
    NoPoints,
    #[error("bad latency point: {rows} rows, {secs} s")]
    BadPoint { rows: usize, secs: f64 },
    #[error("latency points repeat a row count")]
    RepeatedRows,
    #[error("stored latency curve: {0}")]
    Stored(String),
}

#[derive(Debug, Clone, PartialEq)]
pub struct LatencyCurve {
    points: Vec<(usize, f64)>,
    /// Steps whose rows each verify a draft, by tokens: their sampling (and on a GPU their
    /// attention) differ from a decode step's, which the decode points do not show.
    verify: Option<Box<LatencyCurve>>,
}

impl LatencyCurve {
    /// Points must have distinct row counts ≥ 1 and finite positive seconds.
    pub fn new(mut points: Vec<(usize, f64)>) -> Result<Self, CurveError> {
        points.sort_by_key(|p| p.0);
        if points.is_empty() {
            return Err(CurveError::NoPoints);
        }
        if let Some(p) = points
            .iter()
            .find(|p| p.0 == 0 || !p.1.is_finite() || p.1 <= 0.0)
        {
            return Err(CurveError::BadPoint {
                rows: p.0,
                secs: p.1,
            });
        }
        if points.windows(2).any(|w| w[0].0 == w[1].0) {
            return Err(CurveError::RepeatedRows);
        }
        Ok(LatencyCurve {
            points,
            verify: None,
        })
    }

    /// This curve, with `verify` the seconds of steps whose rows verify drafts.
    pub fn with_verify(mut self, verify: LatencyCurve) -> Self {
        self.verify = Some(Box::new(verify));
        self
    }

    /// Seconds of a step of `tokens` tokens whose rows verify drafts, where measured.
    pub fn verify_secs(&self, tokens: usize) -> Option<f64> {
        self.verify.as_ref().map(|v| v.secs(tokens))
    }

    /// Runs `step(rows)` `repeats` times at each row count and keeps the median seconds.
    pub fn measure(
        row_counts: &[usize],
        repeats: usize,
        mut step: impl FnMut(usize) -> f64,
    ) -> Result<Self, CurveError> {
        let points = row_counts
            .iter()
            .map(|&rows| {
                let mut secs: Vec<f64> = (0..repeats.max(1)).map(|_| step(rows)).collect();
                secs.sort_by(f64::total_cmp);
                (rows, secs[secs.len() / 2])
            })
            .collect();
        Self::new(points)
    }

    /// Row counts measured.
    pub fn num_points(&self) -> usize {
        self.points.len()
    }

    /// The measured (rows, seconds), rows ascending.
    pub fn points(&self) -> &[(usize, f64)] {
        &self.points
    }

    /// Seconds at `rows`: linear between measured points, the first point's below them,
    /// and the last segment's slope (never negative) beyond them.
    pub fn secs(&self, rows: usize) -> f64 {
        let p = &self.points;
        if rows <= p[0].0 {
            return p[0].1;
        }
        let i = p.partition_point(|q| q.0 < rows);
        let (a, b) = if i < p.len() {
            if p[i].0 == rows {
                return p[i].1;
            }
            (p[i - 1], p[i])
        } else if p.len() >= 2 {
            (p[p.len() - 2], p[p.len() - 1])
        } else {
            return p[0].1;
        };
        let slope = ((b.1 - a.1) / (b.0 - a.0) as f64).max(0.0);
        let base = if i < p.len() { a } else { b };
        base.1 + slope * (rows - base.0) as f64
    }

    fn to_json(&self) -> String {
        let verify = self.verify.as_ref().map(|v| &v.points);
        serde_json::json!({ "points": self.points, "verify_points": verify }).to_string()
    }

    fn from_json(text: &str) -> Result<Self, CurveError> {
        let stored = |e: serde_json::Error| CurveError::Stored(e.to_string());
        let value: serde_json::Value = serde_json::from_str(text).map_err(stored)?;
        let points: Vec<(usize, f64)> =
            serde_json::from_value(value["points"].clone()).map_err(stored)?;
        let verify: Option<Vec<(usize, f64)>> =
            serde_json::from_value(value["verify_points"].clone()).map_err(stored)?;
        let curve = Self::new(points)?;
        Ok(match verify {
            Some(v) => curve.with_verify(Self::new(v)?),
            None => curve,
        })
    }
}

/// Where measured curves are kept.
pub struct CurveStore {
    dir: PathBuf,
}

impl CurveStore {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        CurveStore { dir: dir.into() }
    }

    /// The key of a curve: what it was measured on and for.
    pub fn key(backend: &str, device: &str, model_config: &str) -> String {
        let mut h = Sha256::new();
        for part in [backend, device, model_config] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part.as_bytes());
        }
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    fn path(&self, key: &str) -> PathBuf {
        self.dir.join(format!("{key}.json"))
    }

    pub fn load(&self, key: &str) -> Option<LatencyCurve> {
        let text = std::fs::read_to_string(self.path(key)).ok()?;
        LatencyCurve::from_json(&text).ok()
    }

    /// Written whole then renamed, so a reader never sees half a file.
    pub fn save(&self, key: &str, curve: &LatencyCurve) -> std::io::Result<()> {
        std::fs::create_dir_all(&self.dir)?;
        let tmp = self.dir.join(format!(".{key}.{}.tmp", std::process::id()));
        std::fs::write(&tmp, curve.to_json())?;
        std::fs::rename(&tmp, self.path(key))
    }

    /// The stored curve, or `measure`'s, stored for next time (a store that cannot be
    /// written only costs the next start a measurement).
    pub fn load_or_measure(
        &self,
        key: &str,
        measure: impl FnOnce() -> Result<LatencyCurve, CurveError>,
    ) -> Result<LatencyCurve, CurveError> {
        if let Some(curve) = self.load(key) {
            return Ok(curve);
        }
        let curve = measure()?;
        if let Err(e) = self.save(key, &curve) {
            tracing::warn!(dir = %self.dir.display(), "latency curve not stored: {e}");
        }
        Ok(curve)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interpolates_between_points_and_extends_the_last_slope() {
        let c = LatencyCurve::new(vec![(8, 0.012), (1, 0.010), (16, 0.016)]).unwrap();
        assert_eq!(c.secs(1), 0.010);
        assert_eq!(c.secs(0), 0.010, "below the first point");
        assert!((c.secs(4) - (0.010 + 3.0 * 0.002 / 7.0)).abs() < 1e-12);
        assert_eq!(c.secs(8), 0.012);
        assert!((c.secs(12) - 0.014).abs() < 1e-12);
        assert!((c.secs(32) - 0.024).abs() < 1e-12, "{}", c.secs(32));
        // A curve that dips is never extrapolated downwards.
        let dip = LatencyCurve::new(vec![(1, 0.02), (2, 0.01)]).unwrap();
        assert_eq!(dip.secs(100), 0.01);
    }

    #[test]
    fn bad_points_are_refused_with_the_reason() {
        assert!(
            LatencyCurve::new(vec![])
                .unwrap_err()
                .to_string()
                .contains("at least one")
        );
        assert!(
            LatencyCurve::new(vec![(0, 0.1)])
                .unwrap_err()
                .to_string()
                .contains("0 rows")
        );
        assert!(
            LatencyCurve::new(vec![(1, f64::NAN)])
                .unwrap_err()
                .to_string()
                .contains("NaN")
        );
        assert!(
            LatencyCurve::new(vec![(2, 0.1), (2, 0.2)])
                .unwrap_err()
                .to_string()
                .contains("repeat")
        );
    }

    #[test]
    fn measured_once_per_key_then_read_back() {
        let dir = std::env::temp_dir().join(format!("troupe-latency-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let store = CurveStore::new(&dir);
        let key = CurveStore::key("cuda", "H200 driver 13.0", "{\"hidden_size\":1024}");
        assert_ne!(
            key,
            CurveStore::key("cuda", "H100 driver 13.0", "{\"hidden_size\":1024}")
        );
        assert_ne!(
            key,
            CurveStore::key("cpu", "H200 driver 13.0", "{\"hidden_size\":1024}")
        );
        let runs = std::cell::Cell::new(0);
        let measure = || {
            LatencyCurve::measure(&[1, 2, 4], 3, |rows| {
                runs.set(runs.get() + 1);
                0.001 * rows as f64 + if runs.get() % 3 == 0 { 0.5 } else { 0.0 }
            })
        };
        let first = store.load_or_measure(&key, measure).unwrap();
        assert_eq!(runs.get(), 9);
        assert_eq!(first.verify_secs(4), None, "no verify steps measured");
        assert_eq!(first.secs(2), 0.002, "the median drops the outlier");
        let again = store.load_or_measure(&key, measure).unwrap();
        assert_eq!(again, first);
        assert_eq!(runs.get(), 9, "read from disk, not measured again");
        // A corrupt file is measured afresh and rewritten.
        std::fs::write(store.dir().join(format!("{key}.json")), "{not json").unwrap();
        store.load_or_measure(&key, measure).unwrap();
        assert_eq!(runs.get(), 18);
        assert!(store.load(&key).is_some());
        // The verify steps' curve goes to disk and back with it.
        let both = LatencyCurve::new(vec![(1, 0.001)])
            .unwrap()
            .with_verify(LatencyCurve::new(vec![(2, 0.004), (8, 0.007)]).unwrap());
        store.save("both", &both).unwrap();
        let read = store.load("both").unwrap();
        assert_eq!(read, both);
        assert_eq!(read.verify_secs(2), Some(0.004));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
