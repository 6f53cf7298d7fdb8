//! The engine's side of a cluster: a node connected to the router's, and an agent actor
//! that answers the router's `Report` calls with the engine's load and cached prefixes.

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use ractor_cluster::RactorClusterMessage;
use serde::{Deserialize, Serialize};

use super::ENGINES_GROUP;
use crate::engine::EngineHandle;

/// What the router may ask an engine's agent; crosses the network.
#[derive(RactorClusterMessage)]
pub enum AgentMsg {
    /// The engine's `EngineReport`, as JSON.
    #[rpc]
    Report(RpcReplyPort<String>),
}

/// One engine's state as the router sees it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct EngineReport {
    pub node_name: String,
    /// Where its HTTP APIs answer (`http://host:port`).
    pub http_url: String,
    /// `both`, `prefill` or `decode`.
    pub role: String,
    pub num_running: usize,
    pub num_waiting: usize,
    pub num_kv_tokens: usize,
    pub kv_capacity_tokens: usize,
    pub block_size: usize,
    /// Chain hashes of its prefix cache's blocks (`route::prompt_block_hashes`).
    pub cached_blocks: Vec<u64>,
}

/// How an engine joins a cluster (`troupe serve --cluster ADDR`).
#[derive(Debug, Clone)]
pub struct JoinConfig {
    /// The router's cluster address, `host:port`.
    pub router: String,
    pub node_name: String,
    pub cookie: String,
    pub http_url: String,
    pub role: String,
    pub block_size: usize,
    /// The address this node listens on (the engine's HTTP host).
    pub listen_ip: std::net::IpAddr,
}

/// How long an engine waits for the router's node to accept its connection.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

pub struct EngineAgent;

pub struct AgentState {
    engine: EngineHandle,
    cfg: JoinConfig,
}

impl Actor for EngineAgent {
    type Msg = AgentMsg;
    type State = AgentState;
    type Arguments = AgentState;

    async fn pre_start(
        &self,
        myself: ActorRef<AgentMsg>,
        state: AgentState,
    ) -> Result<AgentState, ActorProcessingErr> {
        ractor::pg::join(ENGINES_GROUP.to_string(), vec![myself.get_cell()]);
        Ok(state)
    }

    async fn handle(
        &self,
        _myself: ActorRef<AgentMsg>,
        msg: AgentMsg,
        st: &mut AgentState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            AgentMsg::Report(reply) => {
                // An error here is an unanswered report (the router drops the engine from
                // its view until it answers again), never the agent's end: a stopped
                // agent leaves the group for good.
                let (Ok(status), Ok(cached_blocks)) = (
                    st.engine.status().await,
                    st.engine.cached_block_hashes().await,
                ) else {
                    return Ok(());
                };
                let block_size = st.cfg.block_size;
                let report = EngineReport {
                    node_name: st.cfg.node_name.clone(),
                    http_url: st.cfg.http_url.clone(),
                    role: st.cfg.role.clone(),
                    num_running: status.num_running,
                    num_waiting: status.num_waiting,
                    num_kv_tokens: (status.num_total_blocks - status.num_free_blocks) * block_size,
                    kv_capacity_tokens: status.num_total_blocks * block_size,
                    block_size,
                    cached_blocks,
                };
                if let Ok(json) = serde_json::to_string(&report) {
                    let _ = reply.send(json);
                }
            }
        }
        Ok(())
    }
}

/// Starts this process's node, connects it to the router's and starts the agent for
/// `engine`. The node and the agent live as long as the runtime they were spawned on.
pub async fn join(engine: EngineHandle, cfg: JoinConfig) -> Result<(), String> {
    let server = ractor_cluster::NodeServer::new(
        0,
        cfg.cookie.clone(),
        cfg.node_name.clone(),
        cfg.listen_ip.to_string(),
        None,
        None,
    )
    .with_listen_addr(cfg.listen_ip);
    let (node, _) = Actor::spawn(None, server, ())
        .await
        .map_err(|e| format!("cannot start the cluster node: {e}"))?;
    let unreachable =
        |e: String| format!("cannot reach the router's cluster at {}: {e}", cfg.router);
    tokio::time::timeout(
        CONNECT_TIMEOUT,
        ractor_cluster::client_connect(&node, cfg.router.as_str()),
    )
    .await
    .map_err(|_| unreachable(format!("no answer within {CONNECT_TIMEOUT:?}")))?
    .map_err(|e| unreachable(e.to_string()))?;
    Actor::spawn(None, EngineAgent, AgentState { engine, cfg })
        .await
        .map_err(|e| format!("cannot start the cluster agent: {e}"))?;
    Ok(())
}
