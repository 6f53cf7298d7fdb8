//! The transports against a peer agent that keeps what it is sent in a real store (the
//! agent below the seam: these tests are about the sender's choice and its failures).

use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef};

use super::*;
use crate::cluster::kv_transfer::put_blocks;
use crate::cluster::shm_transport::tests::store_and_prefix;
use crate::sync::Shared;

#[derive(Clone, Copy, PartialEq)]
enum Behaviour {
    Takes,
    RefusesSharedMemory,
    DiesAfterFirstChunk,
}

struct Peer;

struct PeerState {
    name: String,
    store: Shared<KvStore>,
    links: KvLinks,
    behaviour: Behaviour,
    shm_chunks: usize,
}

impl Actor for Peer {
    type Msg = AgentMsg;
    type State = PeerState;
    type Arguments = PeerState;

    async fn pre_start(
        &self,
        myself: ActorRef<AgentMsg>,
        st: PeerState,
    ) -> Result<PeerState, ActorProcessingErr> {
        ractor::pg::join(agent_group(&st.name), vec![myself.get_cell()]);
        Ok(st)
    }

    async fn handle(
        &self,
        myself: ActorRef<AgentMsg>,
        msg: AgentMsg,
        st: &mut PeerState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            AgentMsg::PutShmBlocks(json, reply) => {
                st.shm_chunks += 1;
                match st.behaviour {
                    Behaviour::RefusesSharedMemory => {
                        let _ = reply.send("no shared memory here".into());
                    }
                    Behaviour::DiesAfterFirstChunk if st.shm_chunks > 1 => {
                        drop(reply);
                        myself.stop(None);
                    }
                    _ => {
                        let kept = st.links.put_shm(&st.store, &json);
                        let _ = reply.send(kept.err().unwrap_or_default());
                    }
                }
            }
            AgentMsg::PutBlocks(chunk, reply) => {
                let kept = put_blocks(&st.store, &chunk);
                let _ = reply.send(kept.err().unwrap_or_default());
            }
            _ => {}
        }
        Ok(())
    }
}

/// A peer named `name` acting as `behaviour`, its store, and the prefix to send it: 20
/// blocks of 1 MiB (three chunks).
async fn peer(
    name: &str,
    behaviour: Behaviour,
) -> (ActorRef<AgentMsg>, Shared<KvStore>, Vec<u32>, Prefix) {
    let (store, tokens, prefix) = store_and_prefix(name.len() as u64, 20, 1 << 20);
    let store = Shared::new(store);
    let st = PeerState {
        name: name.into(),
        store: store.clone(),
        links: KvLinks::new("secret", true),
        behaviour,
        shm_chunks: 0,
    };
    let (actor, _) = Actor::spawn(None, Peer, st).await.unwrap();
    (actor, store, tokens, prefix)
}

fn holds_all(store: &KvStore, tokens: &[u32], prefix: &Prefix) {
    let back = store.export(tokens, 0);
    assert_eq!(back.len(), prefix.blocks.len());
    for ((k, p), (want_k, want_p)) in back.iter().zip(&prefix.blocks) {
        assert_eq!(k, want_k);
        assert_eq!(&p[..], &want_p[..]);
    }
}

const BOUND: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_on_this_host_takes_kv_through_shared_memory_and_the_region_is_kept() {
    let (_peer, store, tokens, prefix) = peer("peer-takes", Behaviour::Takes).await;
    let links = KvLinks::new("secret", true);
    for _ in 0..2 {
        let link = links.to_node("peer-takes").unwrap();
        let sent = tokio::time::timeout(BOUND, link.send("ns", &prefix))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(sent.transport, "shm");
        assert!(sent.bytes > 20 << 20, "{sent:?}");
        holds_all(&store, &tokens, &prefix);
        // The one region, back for the next hand-off.
        assert_eq!(links.regions.num_free(), 1);
    }
    // Told to keep to TCP, it does.
    let tcp_only = KvLinks::new("secret", false);
    let link = tcp_only.to_node("peer-takes").unwrap();
    let sent = tokio::time::timeout(BOUND, link.send("ns", &prefix))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(sent.transport, "tcp");
    assert_eq!(tcp_only.regions.num_free(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_refuses_shared_memory_gets_the_blocks_over_tcp() {
    let (_peer, store, tokens, prefix) = peer("peer-refuses", Behaviour::RefusesSharedMemory).await;
    let links = KvLinks::new("secret", true);
    let link = links.to_node("peer-refuses").unwrap();
    let sent = tokio::time::timeout(BOUND, link.send("ns", &prefix))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(sent.transport, "tcp");
    holds_all(&store, &tokens, &prefix);
    // The refused region is not reused: the peer may have been reading it.
    assert_eq!(links.regions.num_free(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_of_another_cookie_refuses_the_region_and_takes_tcp() {
    let (_peer, store, tokens, prefix) = peer("peer-cookie", Behaviour::Takes).await;
    let foreign = KvLinks::new("not the cluster's", true);
    let link = foreign.to_node("peer-cookie").unwrap();
    let sent = tokio::time::timeout(BOUND, link.send("ns", &prefix))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(sent.transport, "tcp");
    holds_all(&store, &tokens, &prefix);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_dies_mid_transfer_fails_the_send_promptly() {
    let (peer, _store, _tokens, prefix) = peer("peer-dies", Behaviour::DiesAfterFirstChunk).await;
    let links = KvLinks::new("secret", true);
    let link = links.to_node("peer-dies").unwrap();
    let sent = tokio::time::timeout(BOUND, link.send("ns", &prefix))
        .await
        .expect("a dead peer must fail the send, not hang it");
    assert!(sent.is_err(), "{sent:?}");
    assert_eq!(links.regions.num_free(), 0);
    assert_eq!(peer.get_status(), ractor::ActorStatus::Stopped);
}
