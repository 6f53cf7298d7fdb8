//! The router's view of the cluster: every agent in `ENGINES_GROUP` asked for its report
//! each period. An engine that leaves the group (its node disconnected) is gone from the
//! view at the next poll; one that stops answering keeps its last report for
//! `LIVENESS`, then is gone too.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use ractor::{ActorId, ActorRef};

use super::ENGINES_GROUP;
use super::agent::{AgentMsg, EngineReport};
use crate::route::{EngineLoad, Role};
use crate::sync::{Mutex, Shared};

/// How often the router asks every engine for its report; an engine that stops answering
/// is out of the view within about one period.
pub const POLL_PERIOD: Duration = Duration::from_millis(250);

/// How long an engine in the group that does not answer (busy, or its process stopped
/// without its node noticing yet) stays in the view on its last report.
pub const LIVENESS: Duration = Duration::from_millis(1500);

/// One engine in the view: its agent, its last report, when that came.
type Known = (ActorId, EngineReport, Instant);

#[derive(Default)]
pub struct Registry {
    engines: Mutex<Vec<Known>>,
}

impl Registry {
    /// The engines in the view, by node name.
    pub fn reports(&self) -> Vec<EngineReport> {
        let engines = self.engines.lock().expect("registry lock");
        engines.iter().map(|(_, r, _)| r.clone()).collect()
    }

    /// Drops `node_name` from the view until it answers again (a forward to it failed).
    pub fn forget(&self, node_name: &str) {
        self.engines
            .lock()
            .expect("registry lock")
            .retain(|(_, e, _)| e.node_name != node_name);
    }

    /// The view after a poll: the agents that answered, and those still in the group
    /// (`in_group`) that did not but answered within `LIVENESS`.
    pub fn replace(&self, answered: Vec<(ActorId, EngineReport)>, in_group: &[ActorId]) {
        let now = Instant::now();
        let mut engines = self.engines.lock().expect("registry lock");
        let mut next: Vec<Known> = answered.into_iter().map(|(id, r)| (id, r, now)).collect();
        for (id, report, seen) in engines.drain(..) {
            let answered = next.iter().any(|(other, _, _)| *other == id);
            if !answered && in_group.contains(&id) && now - seen < LIVENESS {
                next.push((id, report, seen));
            }
        }
        next.sort_by(|a, b| a.1.node_name.cmp(&b.1.node_name));
        *engines = next;
    }
}

/// `report` as the routing rules read it.
pub fn load_of(report: &EngineReport) -> EngineLoad {
    EngineLoad {
        role: match report.role.as_str() {
            "prefill" => Role::Prefill,
            "decode" => Role::Decode,
            "encode" => Role::Encode,
            _ => Role::Both,
        },
        alive: !report.draining,
        num_running: report.num_running,
        num_waiting: report.num_waiting,
        num_queued_prefill_tokens: report.num_queued_prefill_tokens,
        num_kv_tokens: report.num_kv_tokens,
        kv_capacity_tokens: report.kv_capacity_tokens,
        block_size: report.block_size,
        cached_blocks: report
            .cached_blocks
            .iter()
            .copied()
            .collect::<HashSet<u64>>(),
        takes_kv: report.takes_kv,
    }
}

/// Polls the group forever (a task on the router's runtime).
pub async fn poll(registry: Shared<Registry>) {
    let timeout_ms = POLL_PERIOD.as_millis() as u64;
    loop {
        let members = ractor::pg::get_members(&ENGINES_GROUP.to_string());
        let in_group: Vec<ActorId> = members.iter().map(|m| m.get_id()).collect();
        let asks = members.into_iter().map(|cell| async move {
            let id = cell.get_id();
            let agent: ActorRef<AgentMsg> = cell.into();
            let json = ractor::call_t!(agent, AgentMsg::Report, timeout_ms).ok()?;
            Some((id, serde_json::from_str::<EngineReport>(&json).ok()?))
        });
        let answered: Vec<(ActorId, EngineReport)> = futures_util::future::join_all(asks)
            .await
            .into_iter()
            .flatten()
            .collect();
        registry.replace(answered, &in_group);
        tokio::time::sleep(POLL_PERIOD).await;
    }
}
