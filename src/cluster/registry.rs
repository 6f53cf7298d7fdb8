//! The router's view of the cluster: every agent in `ENGINES_GROUP` asked for its report
//! each period; an engine that leaves the group (its node disconnected) or does not answer
//! within the period is gone from the view at the next poll.

use std::collections::HashSet;
use std::time::Duration;

use ractor::ActorRef;

use super::ENGINES_GROUP;
use super::agent::{AgentMsg, EngineReport};
use crate::route::{EngineLoad, Role};
use crate::sync::{Mutex, Shared};

/// How often the router asks every engine for its report; an engine that stops answering
/// is out of the view within about one period.
pub const POLL_PERIOD: Duration = Duration::from_millis(250);

#[derive(Default)]
pub struct Registry {
    engines: Mutex<Vec<EngineReport>>,
}

impl Registry {
    /// The engines that answered the last poll.
    pub fn reports(&self) -> Vec<EngineReport> {
        self.engines.lock().expect("registry lock").clone()
    }

    /// Drops `node_name` from the view until it answers again (a forward to it failed).
    pub fn forget(&self, node_name: &str) {
        self.engines
            .lock()
            .expect("registry lock")
            .retain(|e| e.node_name != node_name);
    }

    /// The view after a poll.
    pub fn replace(&self, reports: Vec<EngineReport>) {
        *self.engines.lock().expect("registry lock") = reports;
    }
}

/// `report` as the routing rules read it.
pub fn load_of(report: &EngineReport) -> EngineLoad {
    EngineLoad {
        role: match report.role.as_str() {
            "prefill" => Role::Prefill,
            "decode" => Role::Decode,
            _ => Role::Both,
        },
        alive: true,
        num_running: report.num_running,
        num_waiting: report.num_waiting,
        num_queued_prefill_tokens: 0,
        num_kv_tokens: report.num_kv_tokens,
        kv_capacity_tokens: report.kv_capacity_tokens,
        block_size: report.block_size,
        cached_blocks: report
            .cached_blocks
            .iter()
            .copied()
            .collect::<HashSet<u64>>(),
    }
}

/// Polls the group forever (a task on the router's runtime).
pub async fn poll(registry: Shared<Registry>) {
    let timeout_ms = POLL_PERIOD.as_millis() as u64;
    loop {
        let members = ractor::pg::get_members(&ENGINES_GROUP.to_string());
        let asks = members.into_iter().map(|cell| async move {
            let agent: ActorRef<AgentMsg> = cell.into();
            let json = ractor::call_t!(agent, AgentMsg::Report, timeout_ms).ok()?;
            serde_json::from_str::<EngineReport>(&json).ok()
        });
        let mut reports: Vec<EngineReport> = futures_util::future::join_all(asks)
            .await
            .into_iter()
            .flatten()
            .collect();
        reports.sort_by(|a, b| a.node_name.cmp(&b.node_name));
        registry.replace(reports);
        tokio::time::sleep(POLL_PERIOD).await;
    }
}
