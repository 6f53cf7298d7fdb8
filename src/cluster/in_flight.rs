//! Requests the router has forwarded and not yet answered in full, by engine: added to
//! each engine's last report, so a burst between two reports spreads over the engines.
//! The same counts, weighted, hold the image patches in flight to each encode engine.

use std::collections::BTreeMap;

use crate::sync::{Mutex, Shared};

#[derive(Default)]
pub struct InFlightCounts {
    by_node: Mutex<BTreeMap<String, usize>>,
}

/// One forwarded request in its engine's count, until dropped (its reply ended).
pub struct InFlight {
    counts: Shared<InFlightCounts>,
    node_name: String,
    weight: usize,
}

impl InFlightCounts {
    /// Counts a request forwarded to `node_name` until the guard is dropped.
    pub fn enter(counts: &Shared<InFlightCounts>, node_name: &str) -> InFlight {
        Self::enter_weighted(counts, node_name, 1)
    }

    /// Counts `weight` (an encode ask's image patches) for `node_name` until the guard
    /// is dropped.
    pub fn enter_weighted(
        counts: &Shared<InFlightCounts>,
        node_name: &str,
        weight: usize,
    ) -> InFlight {
        *counts.lock().entry(node_name.to_string()).or_default() += weight;
        InFlight {
            counts: counts.clone(),
            node_name: node_name.to_string(),
            weight,
        }
    }

    /// Requests in flight to `node_name`.
    pub fn get(&self, node_name: &str) -> usize {
        self.lock().get(node_name).copied().unwrap_or(0)
    }

    /// Every engine's count (an engine with none left is not listed).
    pub fn snapshot(&self) -> BTreeMap<String, usize> {
        self.lock().clone()
    }

    fn lock(&self) -> crate::sync::MutexGuard<'_, BTreeMap<String, usize>> {
        // Counts stay consistent under a panicking holder: each change is one statement.
        self.by_node.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut by_node = self.counts.lock();
        if let Some(n) = by_node.get_mut(&self.node_name) {
            *n = n.saturating_sub(self.weight);
            if *n == 0 {
                by_node.remove(&self.node_name);
            }
        }
    }
}
