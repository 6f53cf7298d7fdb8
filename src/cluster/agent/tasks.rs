//! What the engine's agent answers off its own task (a prompt prefilled, blocks stored,
//! a moved request continued) or reads from its engine (a report): the agent keeps
//! answering the router's reports meanwhile.

use ractor::{ActorRef, RpcReplyPort};

use super::super::kv_links::KvLinks;
use super::super::kv_transfer::put_blocks;
use super::super::migrate::{Continuation, MovedOutput};
use super::{AgentMsg, AgentState, EngineReport, PrefillAsk, agent_group, prefill_and_send};
use crate::engine::EngineHandle;
use crate::sync::Shared;

impl AgentState {
    /// This engine's load, cache and role for the router, as JSON; `None` when the engine
    /// did not answer.
    pub(super) async fn report(&self) -> Option<String> {
        let (Ok(status), Ok(cached_blocks)) = (
            self.engine.status().await,
            self.engine.cached_block_hashes().await,
        ) else {
            return None;
        };
        let block_size = self.cfg.block_size;
        let report = EngineReport {
            node_name: self.cfg.node_name.clone(),
            http_url: self.cfg.http_url.clone(),
            role: self.cfg.role.clone(),
            num_running: status.num_running,
            num_waiting: status.num_waiting,
            num_queued_prefill_tokens: status.num_queued_prefill_tokens,
            num_kv_tokens: (status.num_total_blocks - status.num_free_blocks) * block_size,
            kv_capacity_tokens: status.num_total_blocks * block_size,
            block_size,
            cached_blocks,
            takes_kv: self.engine.kv_store().is_some(),
            draining: self.draining,
        };
        serde_json::to_string(&report).ok()
    }
}

/// A prompt prefilled here and its KV sent to the decode engine it names: the hand-off,
/// or the error, as JSON. The prompt runs with the engine's other requests.
pub(super) async fn answer_prefill(
    engine: EngineHandle,
    links: Shared<KvLinks>,
    ask: String,
    reply: RpcReplyPort<String>,
) {
    let done = match serde_json::from_str::<PrefillAsk>(&ask) {
        Ok(ask) => prefill_and_send(&engine, &links, &ask).await,
        Err(e) => Err(format!("a prefill ask: {e}")),
    };
    let answer = match done {
        Ok(hand_off) => serde_json::to_value(hand_off).unwrap_or_default(),
        Err(e) => serde_json::json!({ "error": e }),
    };
    let _ = reply.send(answer.to_string());
}

/// A chunk of blocks into this engine's prefix store: an empty answer, or the error.
pub(super) fn answer_put_blocks(engine: &EngineHandle, chunk: &[u8], reply: RpcReplyPort<String>) {
    let kept = match engine.kv_store() {
        Some(store) => put_blocks(store, chunk).map(|_| ()),
        None => Err("this engine keeps no prefix store (--kv-host-cache-bytes)".to_string()),
    };
    let _ = reply.send(kept.err().unwrap_or_default());
}

/// A chunk of blocks in a peer's shared memory into this engine's prefix store: an empty
/// answer, or the error (the peer then sends over TCP).
pub(super) fn answer_put_shm_blocks(
    engine: &EngineHandle,
    links: &KvLinks,
    json: &str,
    reply: RpcReplyPort<String>,
) {
    let kept = match engine.kv_store() {
        Some(store) => links.put_shm(store, json).map(|_| ()),
        None => Err("this engine keeps no prefix store (--kv-host-cache-bytes)".to_string()),
    };
    let _ = reply.send(kept.err().unwrap_or_default());
}

/// A request moved here: admitted, then each of its outputs sent back to its origin's
/// agent as it comes (the origin gone, the request is dropped: that aborts it).
pub(super) async fn continue_moved(
    engine: EngineHandle,
    json: String,
    reply: RpcReplyPort<String>,
) {
    let cont: Continuation = match serde_json::from_str(&json) {
        Ok(c) => c,
        Err(e) => {
            let _ = reply.send(format!("a moved request: {e}"));
            return;
        }
    };
    let Some(origin) = ractor::pg::get_members(&agent_group(&cont.origin)).pop() else {
        let _ = reply.send(format!("no engine named {} in the cluster", cont.origin));
        return;
    };
    let origin: ActorRef<AgentMsg> = origin.into();
    let mut stream = match engine.generate(cont.request()).await {
        Ok(stream) => stream,
        Err(e) => {
            let _ = reply.send(e.to_string());
            return;
        }
    };
    let _ = reply.send(String::new());
    while let Some(out) = stream.next().await {
        let moved = MovedOutput::of(cont.move_id, out);
        let last = moved.is_final();
        let json = serde_json::to_string(&moved).unwrap_or_default();
        if origin.cast(AgentMsg::Outputs(json)).is_err() || last {
            break;
        }
    }
}
