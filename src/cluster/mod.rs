//! Several engines as one service: engines join the router's cluster as `ractor_cluster`
//! nodes and report their load through an agent actor in the `ENGINES_GROUP` process
//! group (`agent.rs`); the router keeps the reports (`registry.rs`), picks an engine for
//! each request by `route`'s rules and forwards the request to it over HTTP (`router.rs`).

pub mod agent;
mod agent_msg;
pub mod encode_agent;
mod hand_off;
pub mod image_transfer;
pub mod in_flight;
pub mod kv_links;
pub mod kv_transfer;
pub mod migrate;
pub mod registry;
mod request_view;
pub mod router;
pub mod router_metrics;
mod router_state;
pub mod shm_transport;

/// The process group every engine's agent joins.
pub const ENGINES_GROUP: &str = "troupe.engines";

/// The cookie nodes authenticate each other with, unless `--cluster-cookie` names one.
pub const DEFAULT_COOKIE: &str = "troupe";
