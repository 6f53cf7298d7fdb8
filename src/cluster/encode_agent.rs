//! An encode engine's side of a cluster (`serve --role encode`, E/P/D): a node with an
//! agent that answers the router's reports (images in flight, no KV) and its asks to
//! encode a request's images and send the rows to the engines that prefill it. The
//! process holds the vision tower alone (`ImageEngine`): whatever else an engine's agent
//! is asked (a prefill, KV blocks, a moved request) is refused by name.

use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::task::JoinSet;

use super::ENGINES_GROUP;
use super::agent::{AgentMsg, EngineReport, JoinConfig, agent_group, connect};
use super::image_transfer::{EncodeAsk, EncodeDone, RowsPeer, encode_for_peers};
use super::migrate::DrainAsk;
use crate::engine::ImageEngine;

/// What an encode engine answers to asks meant for an engine with a language model.
const NOT_HERE: &str = "this is an encode engine (--role encode): it only encodes images";

/// How long a peer may take to keep an image's rows.
const PUT_ROWS_TIMEOUT_MS: u64 = 30_000;

pub struct EncodeAgent;

pub struct EncodeAgentState {
    images: ImageEngine,
    cfg: JoinConfig,
    /// Encode asks being answered, each on its own task.
    in_flight: JoinSet<()>,
    /// Set by `DrainTo`: reports say so, and the router sends nothing new.
    draining: bool,
}

impl EncodeAgentState {
    fn report(&mut self) -> Option<String> {
        while self.in_flight.try_join_next().is_some() {}
        let report = EngineReport {
            node_name: self.cfg.node_name.clone(),
            http_url: self.cfg.http_url.clone(),
            role: self.cfg.role.clone(),
            num_running: self.in_flight.len(),
            num_waiting: 0,
            num_queued_prefill_tokens: 0,
            num_kv_tokens: 0,
            kv_capacity_tokens: 0,
            block_size: self.cfg.block_size,
            cached_blocks: Vec::new(),
            takes_kv: false,
            draining: self.draining,
        };
        serde_json::to_string(&report).ok()
    }
}

impl Actor for EncodeAgent {
    type Msg = AgentMsg;
    type State = EncodeAgentState;
    type Arguments = EncodeAgentState;

    async fn pre_start(
        &self,
        myself: ActorRef<AgentMsg>,
        state: EncodeAgentState,
    ) -> Result<EncodeAgentState, ActorProcessingErr> {
        ractor::pg::join(ENGINES_GROUP.to_string(), vec![myself.get_cell()]);
        ractor::pg::join(agent_group(&state.cfg.node_name), vec![myself.get_cell()]);
        Ok(state)
    }

    async fn handle(
        &self,
        _myself: ActorRef<AgentMsg>,
        msg: AgentMsg,
        st: &mut EncodeAgentState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            AgentMsg::Report(reply) => {
                if let Some(json) = st.report() {
                    let _ = reply.send(json);
                }
            }
            AgentMsg::EncodeImages(json, reply) => {
                let images = st.images.clone();
                st.in_flight.spawn(answer_encode(images, json, reply));
            }
            AgentMsg::DrainTo(json, reply) => {
                st.draining = true;
                // The asks in flight finish (their rows reach the prefilling engines)
                // within the drain's time; the agent goes on answering reports meanwhile.
                let mut in_flight = std::mem::take(&mut st.in_flight);
                let limit = serde_json::from_str::<DrainAsk>(&json).map_or(Duration::ZERO, |a| {
                    Duration::from_secs_f64(a.cancel_after_secs)
                });
                tokio::spawn(async move {
                    let asks = in_flight.len();
                    let all = async { while in_flight.join_next().await.is_some() {} };
                    let answer = match tokio::time::timeout(limit, all).await {
                        Ok(()) => format!("{asks} encode asks in flight finished"),
                        Err(_) => format!("encode asks still in flight after {limit:?} dropped"),
                    };
                    let _ = reply.send(answer);
                });
            }
            AgentMsg::Prefill(_, reply) => {
                let _ = reply.send(serde_json::json!({ "error": NOT_HERE }).to_string());
            }
            AgentMsg::PutBlocks(_, reply)
            | AgentMsg::Continue(_, reply)
            | AgentMsg::PutImageRows(_, reply)
            | AgentMsg::PutShmBlocks(_, reply) => {
                let _ = reply.send(NOT_HERE.into());
            }
            // It moves no requests: nothing comes back, nothing to cancel.
            AgentMsg::Outputs(_) | AgentMsg::CancelMoves => {}
        }
        Ok(())
    }
}

/// Starts this process's node, connects it to the router's and starts the encode agent
/// for `images` (returned).
pub async fn join(images: ImageEngine, cfg: JoinConfig) -> Result<ActorRef<AgentMsg>, String> {
    connect(&cfg).await?;
    let state = EncodeAgentState {
        images,
        cfg,
        in_flight: JoinSet::new(),
        draining: false,
    };
    let (agent, _) = Actor::spawn(None, EncodeAgent, state)
        .await
        .map_err(|e| format!("cannot start the cluster agent: {e}"))?;
    Ok(agent)
}

/// A peer engine's agent, as an encode engine sends it image rows.
struct AgentPeer(ActorRef<AgentMsg>);

impl RowsPeer for AgentPeer {
    async fn put(&self, payload: Vec<u8>) -> Result<(), String> {
        let answer = ractor::call_t!(self.0, AgentMsg::PutImageRows, PUT_ROWS_TIMEOUT_MS, payload)
            .map_err(|e| format!("sending image rows: {e}"))?;
        match answer.is_empty() {
            true => Ok(()),
            false => Err(answer),
        }
    }
}

/// The answer to `EncodeImages`: the ask's images encoded, their rows sent on to the
/// engines it names.
async fn answer_encode(images: ImageEngine, json: String, reply: RpcReplyPort<String>) {
    let failed = |e: String| EncodeDone {
        num_images: 0,
        num_patches: 0,
        error: Some(e),
    };
    let done = match serde_json::from_str::<EncodeAsk>(&json) {
        Err(e) => failed(format!("an encode ask: {e}")),
        Ok(ask) => {
            let peers: Result<Vec<AgentPeer>, String> = ask
                .deliver_to
                .iter()
                .map(|node| {
                    ractor::pg::get_members(&agent_group(node))
                        .into_iter()
                        .next()
                        .map(|cell| AgentPeer(cell.into()))
                        .ok_or_else(|| format!("no engine named {node} in the cluster"))
                })
                .collect();
            match peers {
                Ok(peers) => encode_for_peers(&images, &ask, &peers).await,
                Err(e) => failed(e),
            }
        }
    };
    let _ = reply.send(serde_json::to_string(&done).expect("serializes"));
}
