//! The engine's side of a cluster: a node connected to the router's (and, transitively, to
//! the other engines'), and an agent actor that answers the router's `Report` calls with
//! the engine's load and cached prefixes, prefills prompts for a decode engine and keeps
//! the KV blocks a prefill engine sends (`kv_transfer.rs`); encodes images for its peers
//! and keeps the image rows an encode engine sends (`image_transfer.rs`).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::UnboundedSender;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use serde::{Deserialize, Serialize};

mod tasks;

use super::ENGINES_GROUP;
pub use super::agent_msg::{AgentMsg, agent_group};
use super::image_transfer::{EncodeDone, decode_rows, prompt_with_images};
use super::kv_links::{CHUNK_TIMEOUT_MS, KvLinks};
use super::kv_transfer::{HandOff, PrefillAsk, Prefix};
use super::migrate::{Continuation, DrainAsk, MovedOutput};
use crate::engine::{Detached, EngineHandle, EngineRequest, RequestOutput};
use crate::sampling::SamplingParams;
use crate::step::with_virtual_ids;
use crate::sync::Shared;

/// How long a draining engine waits for a peer's report (a busy peer answers late).
const PEER_REPORT_TIMEOUT_MS: u64 = 5_000;
/// How long a prefill engine waits to see the decode engine the router named.
const PEER_JOIN_WAIT: Duration = Duration::from_secs(5);

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
    /// Prompt tokens queued or admitted and not yet computed.
    pub num_queued_prefill_tokens: usize,
    pub num_kv_tokens: usize,
    pub kv_capacity_tokens: usize,
    pub block_size: usize,
    /// Chain hashes of its prefix cache's blocks (`route::prompt_block_hashes`).
    pub cached_blocks: Vec<u64>,
    /// It keeps a prefix store (a prefill engine's KV can be handed to it).
    pub takes_kv: bool,
    /// It is shutting down: nothing new goes to it.
    pub draining: bool,
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
    /// KV to peers on this host through shared memory (`--kv-transport auto`).
    pub kv_shared_memory: bool,
}

/// The router's node is named `router@HOST`.
pub const ROUTER_NODE_PREFIX: &str = "router@";

/// How long an engine waits for the router's node to accept its connection.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

pub struct EngineAgent;

pub struct AgentState {
    engine: EngineHandle,
    cfg: JoinConfig,
    /// Requests moved to a peer, by move id: their request id, seed and caller's channel.
    moves: HashMap<u64, (u64, u64, UnboundedSender<RequestOutput>)>,
    next_move: u64,
    /// Set by `DrainTo`: prefills and moved requests are refused, reports say so.
    draining: bool,
    /// The transports KV blocks take to and from peers.
    links: Shared<KvLinks>,
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
        myself: ActorRef<AgentMsg>,
        msg: AgentMsg,
        st: &mut AgentState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            AgentMsg::DrainTo(json, reply) => {
                st.draining = true;
                let answer = match serde_json::from_str::<DrainAsk>(&json) {
                    Ok(ask) => st.drain(&myself, ask).await,
                    Err(e) => format!("a drain ask: {e}"),
                };
                let _ = reply.send(answer);
            }
            AgentMsg::CancelMoves => {
                for (_, (request_id, _, tx)) in st.moves.drain() {
                    let _ = tx.send(RequestOutput {
                        request_id,
                        error: Some(
                            "the server is shutting down and the request, moved to a peer, \
                             did not finish within --shutdown-timeout"
                                .into(),
                        ),
                        ..RequestOutput::default()
                    });
                }
            }
            AgentMsg::Continue(json, reply) => {
                if st.draining {
                    let _ = reply.send("this engine is draining".into());
                    return Ok(());
                }
                let engine = st.engine.clone();
                tokio::spawn(tasks::continue_moved(engine, json, reply));
            }
            AgentMsg::Outputs(json) => {
                let Ok(moved) = serde_json::from_str::<MovedOutput>(&json) else {
                    return Ok(());
                };
                let last = moved.is_final();
                if let Some((request_id, seed, tx)) = st.moves.get(&moved.move_id) {
                    let _ = tx.send(moved.clone().into_output(*request_id, *seed));
                }
                if last {
                    st.moves.remove(&moved.move_id);
                }
            }
            AgentMsg::Report(reply) => {
                // An error here is an unanswered report (the router drops the engine from
                // its view until it answers again), never the agent's end: a stopped
                // agent leaves the group for good.
                if let Some(json) = st.report().await {
                    let _ = reply.send(json);
                }
            }
            AgentMsg::Prefill(_, reply) if st.draining => {
                let answer = serde_json::json!({ "error": "this engine is draining" });
                let _ = reply.send(answer.to_string());
            }
            AgentMsg::Prefill(ask, reply) => {
                let (engine, links) = (st.engine.clone(), st.links.clone());
                tokio::spawn(tasks::answer_prefill(engine, links, ask, reply));
            }
            AgentMsg::EncodeImages(_, reply) => {
                let done = EncodeDone {
                    num_images: 0,
                    num_patches: 0,
                    error: Some("only an encode engine (--role encode) encodes for peers".into()),
                };
                let _ = reply.send(serde_json::to_string(&done).expect("serializes"));
            }
            AgentMsg::PutImageRows(payload, reply) => {
                let answer = decode_rows(&payload).and_then(|(hash, rows)| {
                    let images = st
                        .engine
                        .images()
                        .ok_or("this engine's model takes no images")?;
                    images.put_rows(hash, rows)
                });
                let _ = reply.send(answer.err().unwrap_or_default());
            }
            AgentMsg::PutBlocks(chunk, reply) => {
                // Decoding and copying megabytes: off the agent, whose reports must not wait.
                let engine = st.engine.clone();
                tokio::task::spawn_blocking(move || {
                    tasks::answer_put_blocks(&engine, &chunk, reply)
                });
            }
            AgentMsg::PutShmBlocks(json, reply) => {
                let (engine, links) = (st.engine.clone(), st.links.clone());
                tokio::task::spawn_blocking(move || {
                    tasks::answer_put_shm_blocks(&engine, &links, &json, reply)
                });
            }
        }
        Ok(())
    }
}

/// The prefill engine's side: `ask`'s prompt run here, its blocks sent on.
pub async fn prefill_and_send(
    engine: &EngineHandle,
    links: &KvLinks,
    ask: &PrefillAsk,
) -> Result<HandOff, String> {
    let started = Instant::now();
    let store = engine
        .kv_store()
        .ok_or("this engine keeps no prefix store (--kv-host-cache-bytes)")?;
    let greedy = SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    };
    let (prompt_ids, images) =
        prompt_with_images(engine, ask.prompt_ids.clone(), &ask.images).await?;
    // Blocks are named as the engines name them: an image's placeholders by its content.
    let tokens = with_virtual_ids(&prompt_ids, &images);
    let mut request = EngineRequest::new(prompt_ids, 1, greedy);
    request.images = images;
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
    let prefix = Prefix::export(store, &tokens);
    let peer = links
        .to_node_within(&ask.decode_node, PEER_JOIN_WAIT)
        .await?;
    let sending = Instant::now();
    let sent = peer.send(store.namespace(), &prefix).await?;
    Ok(HandOff {
        num_blocks: prefix.blocks.len(),
        bytes: sent.bytes,
        transport: sent.transport.to_string(),
        prefill_secs: started.elapsed().as_secs_f64(),
        transfer_secs: sending.elapsed().as_secs_f64(),
    })
}

impl AgentState {
    /// With a target: the peer found first, then the engine's movable requests taken out
    /// and moved to it in the background; what is moving, or why nothing is (the requests
    /// then finish here). The moves still unfinished when `ask`'s time is up are ended.
    async fn drain(&mut self, myself: &ActorRef<AgentMsg>, ask: DrainAsk) -> String {
        let Some(target) = ask.target else {
            return "nothing to move (no --drain-to)".into();
        };
        let peer = match pick_peer(myself, &target, &self.cfg.node_name).await {
            Ok(peer) => peer,
            Err(e) => return format!("nothing moved: {e}"),
        };
        let detached = match self.engine.detach_movable().await {
            Ok(d) => d,
            Err(e) => return format!("nothing moved: {e}"),
        };
        let mut moving = Vec::with_capacity(detached.len());
        for d in detached {
            self.next_move += 1;
            let seed = d.request.seed.unwrap_or_default();
            self.moves
                .insert(self.next_move, (d.request_id, seed, d.stream.clone()));
            moving.push((self.next_move, d));
        }
        // What stays (several completions, grammars, penalties on the output) finishes
        // here; said, so a drain that left movable requests behind shows.
        let staying = match self.engine.status().await {
            Ok(s) => (s.num_running + s.num_waiting).to_string(),
            Err(_) => "an unknown number of".into(),
        };
        let answer = format!(
            "{} requests moving to {peer}, {staying} staying to finish here",
            moving.len()
        );
        let (engine, origin) = (self.engine.clone(), self.cfg.node_name.clone());
        let links = self.links.clone();
        tokio::spawn(async move { move_all(&engine, &links, &peer, &origin, moving).await });
        let (me, after) = (
            myself.clone(),
            Duration::from_secs_f64(ask.cancel_after_secs),
        );
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            let _ = me.cast(AgentMsg::CancelMoves);
        });
        answer
    }
}

/// An error output for `d`'s caller: its move failed.
fn moved_error(d: &Detached, why: &str) -> RequestOutput {
    RequestOutput {
        request_id: d.request_id,
        error: Some(format!(
            "the engine is shutting down and the request could not move to a peer: {why}"
        )),
        ..RequestOutput::default()
    }
}

/// The engine `target` names, or for `auto` the other engine that decodes with the
/// fewest requests.
async fn pick_peer(myself: &ActorRef<AgentMsg>, target: &str, me: &str) -> Result<String, String> {
    if target != "auto" {
        if target == me || ractor::pg::get_members(&agent_group(target)).is_empty() {
            return Err(format!(
                "--drain-to {target}: no other engine of that name in the cluster"
            ));
        }
        return Ok(target.to_string());
    }
    let mut best: Option<(usize, String)> = None;
    for cell in ractor::pg::get_members(&ENGINES_GROUP.to_string()) {
        if cell.get_id() == myself.get_id() {
            continue;
        }
        let agent: ActorRef<AgentMsg> = cell.into();
        let Ok(json) = ractor::call_t!(agent, AgentMsg::Report, PEER_REPORT_TIMEOUT_MS) else {
            continue;
        };
        let Ok(r) = serde_json::from_str::<EngineReport>(&json) else {
            continue;
        };
        let load = r.num_running + r.num_waiting;
        if r.role != "prefill" && !r.draining && best.as_ref().is_none_or(|(l, _)| load < *l) {
            best = Some((load, r.node_name));
        }
    }
    best.map(|(_, name)| name)
        .ok_or_else(|| "no other engine that decodes is in the cluster".into())
}

/// Each moving request's blocks to `peer`'s store, then the request itself; a request
/// whose move fails ends with an error its caller sees.
async fn move_all(
    engine: &EngineHandle,
    links: &KvLinks,
    peer: &str,
    origin: &str,
    moving: Vec<(u64, Detached)>,
) {
    let _ = engine.flush_kv_saves().await;
    let transport = links.to_node(peer);
    for (move_id, d) in moving {
        let cont = Continuation::of(&d, origin, move_id);
        let moved = async {
            let transport = transport.as_ref().map_err(String::clone)?;
            if let Some(store) = engine.kv_store() {
                let prefix = Prefix::export(store, &cont.prompt_ids);
                // A peer without a store computes the blocks again.
                if let Err(e) = transport.send(store.namespace(), &prefix).await {
                    tracing::warn!("moving KV blocks to {peer}: {e}");
                }
            }
            let json = serde_json::to_string(&cont).map_err(|e| e.to_string())?;
            let answer = ractor::call_t!(
                transport.agent(),
                AgentMsg::Continue,
                CHUNK_TIMEOUT_MS,
                json
            )
            .map_err(|e| e.to_string())?;
            if answer.is_empty() {
                Ok(())
            } else {
                Err(answer)
            }
        };
        if let Err(e) = moved.await {
            // Finished here after all: the engine runs until the drain ends.
            tracing::warn!(
                "moving request {} to {peer}: {e}; it continues here",
                d.request_id
            );
            tokio::spawn(continue_here(engine.clone(), cont, d));
        }
    }
}

/// A request whose move failed, continued on this engine as a peer would have.
async fn continue_here(engine: EngineHandle, cont: Continuation, d: Detached) {
    let seed = d.request.seed.unwrap_or_default();
    let mut stream = match engine.generate(cont.request()).await {
        Ok(stream) => stream,
        Err(e) => {
            let _ = d.stream.send(moved_error(&d, &e.to_string()));
            return;
        }
    };
    while let Some(out) = stream.next().await {
        let out = MovedOutput::of(cont.move_id, out).into_output(d.request_id, seed);
        let last = out.is_final();
        if d.stream.send(out).is_err() || last {
            break;
        }
    }
}

/// Starts this process's node, connects it to the router's and starts the agent for
/// `engine` (returned). The node and the agent live as long as the runtime they were spawned on.
pub async fn join(engine: EngineHandle, cfg: JoinConfig) -> Result<ActorRef<AgentMsg>, String> {
    connect(&cfg).await?;
    let links = Shared::new(KvLinks::new(&cfg.cookie, cfg.kv_shared_memory));
    let state = AgentState {
        engine,
        cfg,
        links,
        moves: HashMap::new(),
        next_move: 0,
        draining: false,
    };
    let (agent, _) = Actor::spawn(None, EngineAgent, state)
        .await
        .map_err(|e| format!("cannot start the cluster agent: {e}"))?;
    Ok(agent)
}

/// Starts this process's node and connects it to the router's, and keeps it connected.
pub(super) async fn connect(cfg: &JoinConfig) -> Result<(), String> {
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
    tokio::spawn(stay_connected(node, cfg.router.clone()));
    Ok(())
}

/// How often an engine checks that its node is still connected to the router's.
const RECONNECT_PERIOD: std::time::Duration = std::time::Duration::from_secs(1);

/// Connects the node to the router's again whenever their session is gone (the router
/// restarted): the new router sees the engine, its load and its cached prefixes within
/// about a second, and the engine's state was never lost.
async fn stay_connected(node: ActorRef<ractor_cluster::NodeServerMessage>, router: String) {
    let mut warned = false;
    loop {
        tokio::time::sleep(RECONNECT_PERIOD).await;
        if node.get_status() == ractor::ActorStatus::Stopped {
            return;
        }
        let Ok(sessions) =
            ractor::call_t!(node, ractor_cluster::NodeServerMessage::GetSessions, 1000)
        else {
            continue;
        };
        let connected = sessions.values().any(|s| {
            s.peer_name
                .as_ref()
                .is_some_and(|p| p.name.starts_with(ROUTER_NODE_PREFIX))
        });
        if !connected {
            let again = ractor_cluster::client_connect(&node, router.as_str());
            match tokio::time::timeout(CONNECT_TIMEOUT, again).await {
                Ok(Ok(())) => warned = false,
                Ok(Err(e)) if !warned => {
                    tracing::warn!("connecting to the router's cluster at {router} again: {e}");
                    warned = true;
                }
                _ => {}
            }
        }
    }
}

/// On SIGTERM, for an engine in a cluster: the agent told to drain (with `--drain-to`,
/// to move the requests a peer can continue; those still unfinished after `cancel_after`
/// end with an error).
pub async fn drain(agent: ActorRef<AgentMsg>, target: Option<String>, cancel_after: Duration) {
    let ask = DrainAsk {
        target,
        cancel_after_secs: cancel_after.as_secs_f64(),
    };
    let ask = serde_json::to_string(&ask).unwrap_or_default();
    match ractor::call_t!(agent, AgentMsg::DrainTo, 60_000, ask) {
        Ok(moved) => crate::notice::notice(&format!("draining: {moved}")),
        Err(e) => crate::notice::notice(&format!("draining: {e}")),
    }
}
