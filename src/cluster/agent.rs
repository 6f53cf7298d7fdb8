//! The engine's side of a cluster: a node connected to the router's (and, transitively, to
//! the other engines'), and an agent actor that answers the router's `Report` calls with
//! the engine's load and cached prefixes, prefills prompts for a decode engine and keeps
//! the KV blocks a prefill engine sends (`kv_transfer.rs`).

use std::time::Instant;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use ractor_cluster::RactorClusterMessage;
use serde::{Deserialize, Serialize};

use super::ENGINES_GROUP;
use super::kv_transfer::{Block, HandOff, KvTransport, PrefillAsk, encode_chunks, put_blocks};
use crate::engine::EngineHandle;
use crate::engine::EngineRequest;
use crate::sampling::SamplingParams;

/// How long a chunk of KV blocks may take to be acknowledged.
const CHUNK_TIMEOUT_MS: u64 = 30_000;

/// What the router may ask an engine's agent; crosses the network.
#[derive(RactorClusterMessage)]
pub enum AgentMsg {
    /// The engine's `EngineReport`, as JSON.
    #[rpc]
    Report(RpcReplyPort<String>),
    /// A prompt to prefill here, its blocks sent to a decode engine
    /// (`kv_transfer::PrefillAsk` as JSON); answered with the `HandOff` as JSON, or
    /// `{"error": ...}`.
    #[rpc]
    Prefill(String, RpcReplyPort<String>),
    /// A chunk of KV blocks for this engine's prefix store (`kv_transfer::encode_chunks`);
    /// answered with "" once kept, else why not.
    #[rpc]
    PutBlocks(Vec<u8>, RpcReplyPort<String>),
}

/// The process group of one engine's agent alone: how a peer finds it by node name.
pub fn agent_group(node_name: &str) -> String {
    format!("{ENGINES_GROUP}.{node_name}")
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
        ractor::pg::join(agent_group(&state.cfg.node_name), vec![myself.get_cell()]);
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
            AgentMsg::Prefill(ask, reply) => {
                // On a task of its own: the prompt runs with the engine's other requests,
                // and the agent answers reports meanwhile.
                let engine = st.engine.clone();
                tokio::spawn(async move {
                    let done = match serde_json::from_str::<PrefillAsk>(&ask) {
                        Ok(ask) => prefill_and_send(&engine, &ask).await,
                        Err(e) => Err(format!("a prefill ask: {e}")),
                    };
                    let answer = match done {
                        Ok(hand_off) => serde_json::to_value(hand_off).unwrap_or_default(),
                        Err(e) => serde_json::json!({ "error": e }),
                    };
                    let _ = reply.send(answer.to_string());
                });
            }
            AgentMsg::PutBlocks(chunk, reply) => {
                let kept = match st.engine.kv_store() {
                    Some(store) => put_blocks(store, &chunk).map(|_| ()),
                    None => Err("this engine keeps no prefix store (--kv-host-cache-bytes)".into()),
                };
                let _ = reply.send(kept.err().unwrap_or_default());
            }
        }
        Ok(())
    }
}

/// The cluster's TCP transport: chunks as `AgentMsg::PutBlocks` calls on the decode
/// engine's agent, each acknowledged before the next.
pub struct ClusterTcp {
    dest: ActorRef<AgentMsg>,
}

impl ClusterTcp {
    /// The transport to `node`'s agent, once this node is connected to that node.
    pub fn to_node(node: &str) -> Result<Self, String> {
        let cell = ractor::pg::get_members(&agent_group(node))
            .into_iter()
            .next()
            .ok_or_else(|| format!("no engine named {node} in the cluster"))?;
        Ok(ClusterTcp { dest: cell.into() })
    }
}

impl KvTransport for ClusterTcp {
    async fn send(&self, namespace: &str, blocks: &[Block]) -> Result<u64, String> {
        let mut bytes = 0;
        for chunk in encode_chunks(namespace, blocks) {
            bytes += chunk.len() as u64;
            let answer = ractor::call_t!(self.dest, AgentMsg::PutBlocks, CHUNK_TIMEOUT_MS, chunk)
                .map_err(|e| format!("sending KV blocks: {e}"))?;
            if !answer.is_empty() {
                return Err(answer);
            }
        }
        Ok(bytes)
    }
}

/// The prefill engine's side: `ask`'s prompt run here, its blocks sent on.
pub async fn prefill_and_send(engine: &EngineHandle, ask: &PrefillAsk) -> Result<HandOff, String> {
    let started = Instant::now();
    let store = engine
        .kv_store()
        .ok_or("this engine keeps no prefix store (--kv-host-cache-bytes)")?;
    let transport = ClusterTcp::to_node(&ask.decode_node)?;
    let greedy = SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    };
    let request = EngineRequest::new(ask.prompt_ids.clone(), 1, greedy);
    let out = engine
        .generate(request)
        .await
        .map_err(|e| e.to_string())?
        .collect()
        .await;
    if let Some(e) = out.error {
        return Err(format!("prefill: {e}"));
    }
    engine.flush_kv_saves().await.map_err(|e| e.to_string())?;
    // What the store does not hold now it has dropped for room: the decode engine
    // computes those blocks again.
    let blocks = store.export(&ask.prompt_ids, 0);
    let sending = Instant::now();
    let bytes = transport.send(store.namespace(), &blocks).await?;
    Ok(HandOff {
        num_blocks: blocks.len(),
        bytes,
        prefill_secs: started.elapsed().as_secs_f64(),
        transfer_secs: sending.elapsed().as_secs_f64(),
    })
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
        // Connected to the router's node, this node connects to every engine the router
        // knows (and they to it): KV moves between engines directly.
        Some(ractor_cluster::node::NodeConnectionMode::Transitive),
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
