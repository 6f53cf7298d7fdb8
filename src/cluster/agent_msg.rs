//! The messages an engine's agent takes (`agent.rs`, `encode_agent.rs`), and the group
//! its peers find it by: what the router and the transports (`kv_links.rs`) send it.

use ractor::RpcReplyPort;
use ractor_cluster::RactorClusterMessage;

use super::ENGINES_GROUP;

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
    /// The engine is draining (SIGTERM; `migrate::DrainAsk` as JSON): nothing new is taken
    /// from the cluster, and with `--drain-to` every request a peer can continue moves to
    /// it. Answered with what is moving.
    #[rpc]
    DrainTo(String, RpcReplyPort<String>),
    /// The drain's time is up: every moved request still unfinished ends with an error.
    CancelMoves,
    /// Continue a request another engine moved here (`migrate::Continuation` as JSON);
    /// answered with "" once admitted, else why not.
    #[rpc]
    Continue(String, RpcReplyPort<String>),
    /// An output of a request this engine moved to a peer (`migrate::MovedOutput` as
    /// JSON), for its caller.
    Outputs(String),
    /// A request's images to encode here and send to the engines that prefill it
    /// (`image_transfer::EncodeAsk` as JSON); answered with its `EncodeDone` as JSON.
    #[rpc]
    EncodeImages(String, RpcReplyPort<String>),
    /// One image's rows an encode engine sent (`image_transfer::encode_rows`); answered
    /// with "" once kept, else why not.
    #[rpc]
    PutImageRows(Vec<u8>, RpcReplyPort<String>),
    /// A chunk of KV blocks in a peer's shared-memory region on this host
    /// (`shm_transport::ShmChunk` as JSON); answered with "" once kept, else why not.
    #[rpc]
    PutShmBlocks(String, RpcReplyPort<String>),
}

/// The process group of one engine's agent alone: how a peer finds it by node name.
pub fn agent_group(node_name: &str) -> String {
    format!("{ENGINES_GROUP}.{node_name}")
}
