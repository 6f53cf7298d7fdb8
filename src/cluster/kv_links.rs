//! How an engine's KV blocks reach a peer engine (a prefill engine's hand-off, a
//! draining engine's moved requests): through shared memory when the peer runs on this
//! host (`shm_transport.rs`), else, or when that fails, over the cluster's TCP
//! connection. The control messages (where a chunk lies, kept or why not) go over the
//! cluster's connection either way; only the bytes take the other path.

use ractor::ActorRef;

use super::agent_msg::{AgentMsg, agent_group};
use super::kv_transfer::{KvTransport, MAX_BLOCK_BYTES, Prefix, chunk_plan};
use super::shm_transport::{Region, SLOT_BYTES, SLOTS, ShmChunk, host_id, put_shm_blocks};
use crate::store::KvStore;
use crate::sync::{Shared, SlotPool};

/// How long a chunk of KV blocks may take to be acknowledged.
pub const CHUNK_TIMEOUT_MS: u64 = 30_000;
/// Shared-memory regions kept for later hand-offs at most (each ≥ 32 MiB of the host's
/// memory); hand-offs past that many at once make regions they then drop.
const MAX_POOLED_REGIONS: usize = 4;

/// What a transport moved, and which transport it was (`shm` or `tcp`).
#[derive(Debug, Clone, Copy)]
pub struct Sent {
    pub bytes: u64,
    pub transport: &'static str,
}

/// An engine's transports: its cluster's cookie, its host, and the shared-memory regions
/// it sends through (one per hand-off in flight, kept for the next).
pub struct KvLinks {
    shared_memory: bool,
    cookie: String,
    host: String,
    regions: SlotPool<Region>,
}

impl KvLinks {
    /// `shared_memory`: try shared memory with peers on this host (`--kv-transport auto`).
    pub fn new(cookie: &str, shared_memory: bool) -> Self {
        KvLinks {
            shared_memory,
            cookie: cookie.to_string(),
            host: host_id(),
            regions: SlotPool::default(),
        }
    }

    /// The way to `node`'s agent, once this node is connected to that node.
    pub fn to_node(&self, node: &str) -> Result<PeerLink<'_>, String> {
        let cell = ractor::pg::get_members(&agent_group(node))
            .into_iter()
            .next()
            .ok_or_else(|| format!("no engine named {node} in the cluster"))?;
        Ok(PeerLink {
            links: self,
            node: node.to_string(),
            dest: cell.into(),
        })
    }

    /// `to_node`, waiting up to `limit` for the peer to appear: a node learns of another
    /// through the router's, a moment after the router does, so a hand-off the router
    /// sends just after an engine joined may find it here a little later.
    pub async fn to_node_within(
        &self,
        node: &str,
        limit: std::time::Duration,
    ) -> Result<PeerLink<'_>, String> {
        let started = std::time::Instant::now();
        loop {
            match self.to_node(node) {
                Err(_) if started.elapsed() < limit => {
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
                found => return found,
            }
        }
    }

    /// The receiving side of a shared-memory chunk (`ShmChunk` as JSON) into `store`.
    pub fn put_shm(&self, store: &KvStore, json: &str) -> Result<usize, String> {
        let at: ShmChunk =
            serde_json::from_str(json).map_err(|e| format!("a shared-memory chunk: {e}"))?;
        put_shm_blocks(store, &self.cookie, &self.host, &at)
    }
}

/// One peer's agent, and the transports to it.
pub struct PeerLink<'a> {
    links: &'a KvLinks,
    node: String,
    dest: ActorRef<AgentMsg>,
}

impl PeerLink<'_> {
    /// The peer's agent (for the control messages that follow the blocks).
    pub fn agent(&self) -> &ActorRef<AgentMsg> {
        &self.dest
    }

    /// `prefix` into the peer's store: through shared memory if it may and can, else over
    /// TCP (the blocks shared memory already moved are sent again: keeping one twice is
    /// harmless).
    pub async fn send(&self, namespace: &str, prefix: &Prefix) -> Result<Sent, String> {
        if self.links.shared_memory {
            let shm = ShmTransport {
                links: self.links,
                dest: &self.dest,
            };
            match shm.send(namespace, prefix).await {
                Ok(bytes) => {
                    return Ok(Sent {
                        bytes,
                        transport: "shm",
                    });
                }
                Err(e) if e.contains("another host") => {}
                Err(e) => tracing::warn!(
                    "KV blocks to {} through shared memory: {e}; over TCP instead",
                    self.node
                ),
            }
        }
        let tcp = ClusterTcp { dest: &self.dest };
        let bytes = tcp.send(namespace, prefix).await?;
        Ok(Sent {
            bytes,
            transport: "tcp",
        })
    }
}

/// The cluster's TCP transport: chunks as `AgentMsg::PutBlocks` calls on the peer's
/// agent; the next chunk is encoded while the last is in flight, and announced once the
/// last is acknowledged (states reach the peer after their blocks).
pub struct ClusterTcp<'a> {
    pub dest: &'a ActorRef<AgentMsg>,
}

impl KvTransport for ClusterTcp<'_> {
    async fn send(&self, namespace: &str, prefix: &Prefix) -> Result<u64, String> {
        // A frame past the receiver's limit would end the whole session between the nodes.
        let blocks = prefix.blocks.iter().map(|(key, p)| (key.hash, p));
        let mut entries = blocks.chain(prefix.states.iter().map(|(hash, p)| (*hash, p)));
        if let Some((hash, p)) = entries.find(|(_, p)| p.len() > MAX_BLOCK_BYTES) {
            return Err(format!(
                "KV block {hash:016x} (or its state) has {} bytes; the cluster's transport takes at most {MAX_BLOCK_BYTES}",
                p.len()
            ));
        }
        // Encoding on a blocking thread: the async workers stay free to carry the last
        // chunk's call meanwhile.
        let (shared, namespace) = (Shared::new(prefix.clone()), Shared::<str>::from(namespace));
        let mut pending = None;
        let mut bytes = 0;
        for part in chunk_plan(prefix) {
            let (prefix, namespace) = (shared.clone(), namespace.clone());
            let encoding = tokio::task::spawn_blocking(move || {
                let mut chunk = Vec::with_capacity(part.encoded_len(&namespace, &prefix));
                part.write(&namespace, &prefix, &mut chunk)
                    .map(|()| chunk)
                    .map_err(|e| e.to_string())
            });
            acknowledged(pending.take()).await?;
            let chunk = encoding.await.map_err(|e| e.to_string())??;
            bytes += chunk.len() as u64;
            pending = Some(call(self.dest, AgentMsg::PutBlocks, chunk));
        }
        acknowledged(pending).await?;
        Ok(bytes)
    }
}

/// A chunk's call on the peer's agent, under way on its own task.
type Call = tokio::task::JoinHandle<Result<(), String>>;

fn call<T: Send + 'static>(
    dest: &ActorRef<AgentMsg>,
    msg: fn(T, ractor::RpcReplyPort<String>) -> AgentMsg,
    payload: T,
) -> Call {
    let dest = dest.clone();
    tokio::spawn(async move {
        let answer = ractor::call_t!(dest, msg, CHUNK_TIMEOUT_MS, payload)
            .map_err(|e| format!("sending KV blocks: {e}"))?;
        if answer.is_empty() {
            Ok(())
        } else {
            Err(answer)
        }
    })
}

/// The call's answer, once it came (none under way: nothing to wait for).
async fn acknowledged(call: Option<Call>) -> Result<(), String> {
    match call {
        Some(call) => call.await.unwrap_or_else(|e| Err(e.to_string())),
        None => Ok(()),
    }
}

/// Shared memory: each chunk written into a region's slot, its place sent as an
/// `AgentMsg::PutShmBlocks` call; the next chunk is written while the peer reads the last.
pub struct ShmTransport<'a> {
    pub links: &'a KvLinks,
    pub dest: &'a ActorRef<AgentMsg>,
}

impl KvTransport for ShmTransport<'_> {
    async fn send(&self, namespace: &str, prefix: &Prefix) -> Result<u64, String> {
        let parts = chunk_plan(prefix);
        let need = parts
            .iter()
            .map(|p| p.encoded_len(namespace, prefix))
            .max()
            .unwrap_or(0);
        let region = self.links.regions.take().filter(|r| r.slot_bytes >= need);
        let mut region = match region {
            Some(region) => region,
            None => Region::create(&self.links.cookie, need.max(SLOT_BYTES))
                .map_err(|e| format!("a shared-memory region: {e}"))?,
        };
        // Writing on a blocking thread: the async workers stay free to carry the last
        // chunk's call meanwhile (a task spawned from a busy worker waits for it).
        let (shared, namespace) = (Shared::new(prefix.clone()), Shared::<str>::from(namespace));
        let mut pending = None;
        let mut bytes = 0;
        for (i, part) in parts.into_iter().enumerate() {
            let (prefix, namespace) = (shared.clone(), namespace.clone());
            let host = self.links.host.clone();
            let writing = tokio::task::spawn_blocking(move || {
                let written = region.write(i % SLOTS, &namespace, &prefix, &part, &host);
                (region, written)
            });
            // The chunk before is acknowledged before this one is announced: states
            // reach the peer after their blocks, and a slot is written again only once
            // read.
            let before = acknowledged(pending.take()).await;
            let (back, written) = writing.await.map_err(|e| e.to_string())?;
            region = back;
            let at = written.and_then(|at| before.map(|()| at))?;
            bytes += at.len;
            let json = serde_json::to_string(&at).map_err(|e| e.to_string())?;
            pending = Some(call(self.dest, AgentMsg::PutShmBlocks, json));
        }
        acknowledged(pending).await?;
        // Only a region whose chunks were all acknowledged goes back: after an error the
        // peer may still be reading a slot.
        if self.links.regions.num_free() < MAX_POOLED_REGIONS {
            self.links.regions.put(region);
        }
        Ok(bytes)
    }
}

#[cfg(test)]
mod tests;
