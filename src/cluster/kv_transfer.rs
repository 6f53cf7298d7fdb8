//! Prefill/decode disaggregation's KV hand-off. A prefill engine runs a prompt (one token,
//! greedy: the decode engine samples every token itself), waits for its full blocks to
//! reach its prefix store, and sends them to the decode engine's agent in chunks, which
//! keeps them in its own store; the request then goes to the decode engine, whose
//! admission finds the blocks there and computes only the prompt's last partial block.
//! A model with per-sequence state (DeepSeek-V4) sends the state saved at the last
//! block's end with them, so the decode engine resumes there without a replay.
//! The engines keep running other steps while blocks move. Transfer is behind
//! `KvTransport` (`kv_links.rs`: shared memory on one host, the cluster's TCP connection
//! between hosts). Here: the asks and answers, the chunks' format, the receiving side.

use serde::{Deserialize, Serialize};

use crate::store::{BlockKey, KvStore};
use crate::sync::Shared;

/// A chunk's payload at most: a frame of the cluster's transport holds 16 MiB.
const CHUNK_BYTES: usize = 8 << 20;
/// The largest block a chunk carries (alone): it must fit a frame with its key.
pub const MAX_BLOCK_BYTES: usize = 15 << 20;
/// Tags a chunk of blocks, with its format's version.
const MAGIC: &[u8; 4] = b"TKV2";

/// What the router asks a prefill engine: run `prompt_ids` (a chat's with one placeholder
/// per image of `images`), send its blocks to `decode_node`.
#[derive(Debug, Serialize, Deserialize)]
pub struct PrefillAsk {
    pub prompt_ids: Vec<u32>,
    pub decode_node: String,
    /// Each image's file, base64, and the MIME type it was declared with.
    #[serde(default)]
    pub images: Vec<(String, Option<String>)>,
}

/// One block as it moves: its key and its bytes as the rank's cache stores them.
pub type Block = (BlockKey, Shared<[u8]>);
/// A per-sequence state as it moves: the hash of the block it ends, and its bytes.
pub type State = (u64, Shared<[u8]>);

/// What a prompt's hand-off moves: its blocks, the state at the last one's end if the
/// store kept one.
#[derive(Default, Clone)]
pub struct Prefix {
    pub blocks: Vec<Block>,
    pub states: Vec<State>,
}

impl Prefix {
    /// `tokens`' blocks in `store` from the first, and the state kept with the last (left
    /// out, the decode engine replaying instead, where it is too large for a frame).
    pub fn export(store: &KvStore, tokens: &[u32]) -> Self {
        let blocks = store.export(tokens, 0);
        let state = blocks
            .last()
            .and_then(|(key, _)| Some((key.hash, store.export_state(key.hash)?)));
        let states = state
            .filter(|(_, s)| {
                let fits = s.len() <= MAX_BLOCK_BYTES;
                if !fits {
                    tracing::warn!(
                        "a state of {} bytes: past the transport's frame, not sent",
                        s.len()
                    );
                }
                fits
            })
            .into_iter()
            .collect();
        Prefix { blocks, states }
    }
}

/// A chunk of blocks and states, decoded.
pub struct Chunk {
    /// The sender's store namespace (`store::namespace`).
    pub namespace: String,
    pub blocks: Vec<Block>,
    pub states: Vec<State>,
}

/// What a hand-off moved.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub struct HandOff {
    pub num_blocks: usize,
    pub bytes: u64,
    /// From the prompt's submission to the last chunk acknowledged.
    pub prefill_secs: f64,
    /// Sending alone.
    pub transfer_secs: f64,
    /// How the blocks went: `shm` (shared memory, the peer on this host) or `tcp`.
    #[serde(default)]
    pub transport: String,
}

/// Where an engine's blocks go: shared memory to a peer on the same host, TCP between
/// hosts (`kv_links.rs`); a transport between GPUs (CUDA IPC, NCCL, RDMA) would move the
/// same blocks without the host copy.
pub trait KvTransport {
    /// Bytes sent, once the receiver holds every block.
    fn send(
        &self,
        namespace: &str,
        prefix: &Prefix,
    ) -> impl std::future::Future<Output = Result<u64, String>> + Send;
}

/// The decode engine's side: a chunk's blocks into `store`, or why not.
pub fn put_blocks(store: &KvStore, chunk: &[u8]) -> Result<usize, String> {
    let Chunk {
        namespace,
        blocks,
        states,
    } = decode_chunk(chunk)?;
    if namespace != store.namespace() {
        return Err(format!(
            "KV blocks of namespace {namespace}, this engine's is {} (another model or cache setting)",
            store.namespace()
        ));
    }
    let n = blocks.len();
    for (key, payload) in blocks {
        store.import(key, payload)?;
    }
    // A state only spares the decode engine a replay: one it cannot keep (a store with
    // no host tier) leaves the hand-off whole.
    for (hash, payload) in states {
        if let Err(e) = store.import_state(hash, payload) {
            tracing::warn!("KV hand-off: {e}; the request replays its window instead");
        }
    }
    Ok(n)
}

/// `prefix` as chunks of at most about `CHUNK_BYTES` each (a block or state is never
/// split; states after every block, so the receiver holds a state's block first).
pub fn encode_chunks(namespace: &str, prefix: &Prefix) -> Vec<Vec<u8>> {
    chunk_plan(prefix)
        .into_iter()
        .map(|part| {
            let mut out = Vec::with_capacity(part.encoded_len(namespace, prefix));
            part.write(namespace, prefix, &mut out)
                .expect("a Vec takes every write");
            out
        })
        .collect()
}

/// One chunk's share of a prefix: its blocks, then its states (indices into the prefix).
#[derive(Debug, Clone)]
pub struct ChunkPart {
    blocks: std::ops::Range<usize>,
    states: std::ops::Range<usize>,
}

/// How `prefix` splits into chunks of at most about `CHUNK_BYTES` of payload.
pub fn chunk_plan(prefix: &Prefix) -> Vec<ChunkPart> {
    let (num_blocks, num_states) = (prefix.blocks.len(), prefix.states.len());
    let sizes = prefix.blocks.iter().map(|(_, p)| p.len());
    let sizes: Vec<usize> = sizes
        .chain(prefix.states.iter().map(|(_, p)| p.len()))
        .collect();
    let mut parts = Vec::new();
    let mut first = 0;
    while first < sizes.len() {
        let mut size = 0;
        let n = sizes[first..]
            .iter()
            .take_while(|&&len| {
                size += len;
                size <= CHUNK_BYTES || size == len
            })
            .count()
            .max(1);
        let end = first + n;
        parts.push(ChunkPart {
            blocks: first.min(num_blocks)..end.min(num_blocks),
            states: first.saturating_sub(num_blocks).min(num_states)
                ..end.saturating_sub(num_blocks).min(num_states),
        });
        first = end;
    }
    parts
}

impl ChunkPart {
    /// The chunk's length as `write` lays it out.
    pub fn encoded_len(&self, namespace: &str, prefix: &Prefix) -> usize {
        let blocks = prefix.blocks[self.blocks.clone()].iter();
        let blocks: usize = blocks
            .map(|(k, p)| 8 * 3 + 4 + 4 * k.tokens.len() + 4 + p.len())
            .sum();
        let states: usize = prefix.states[self.states.clone()]
            .iter()
            .map(|(_, p)| 8 + 4 + p.len())
            .sum();
        MAGIC.len() + 4 + namespace.len() + 4 + blocks + 4 + states
    }

    /// The chunk written to `out` (a `Vec`, or a slice of shared memory `encoded_len`
    /// long: an error past its end).
    pub fn write(
        &self,
        namespace: &str,
        prefix: &Prefix,
        out: &mut impl std::io::Write,
    ) -> std::io::Result<()> {
        let mut emit = |bytes: &[u8]| out.write_all(bytes);
        let now_blocks = &prefix.blocks[self.blocks.clone()];
        let now_states = &prefix.states[self.states.clone()];
        emit(MAGIC)?;
        emit(&(namespace.len() as u32).to_le_bytes())?;
        emit(namespace.as_bytes())?;
        emit(&(now_blocks.len() as u32).to_le_bytes())?;
        for (key, payload) in now_blocks {
            for word in [key.hash, key.parent_hash, key.cache_salt] {
                emit(&word.to_le_bytes())?;
            }
            emit(&(key.tokens.len() as u32).to_le_bytes())?;
            for t in key.tokens.iter() {
                emit(&t.to_le_bytes())?;
            }
            emit(&(payload.len() as u32).to_le_bytes())?;
            emit(payload)?;
        }
        emit(&(now_states.len() as u32).to_le_bytes())?;
        for (hash, payload) in now_states {
            emit(&hash.to_le_bytes())?;
            emit(&(payload.len() as u32).to_le_bytes())?;
            emit(payload)?;
        }
        Ok(())
    }
}

/// A chunk of `encode_chunks` back into its namespace and blocks; a short or malformed
/// chunk is an error, never a panic.
pub fn decode_chunk(chunk: &[u8]) -> Result<Chunk, String> {
    let mut r = Reader(chunk);
    if r.take(4)? != MAGIC {
        return Err("not a chunk of KV blocks (bad magic)".into());
    }
    let len = r.u32()? as usize;
    let namespace = String::from_utf8(r.take(len)?.to_vec())
        .map_err(|_| "a chunk's namespace is not UTF-8".to_string())?;
    let count = r.u32()? as usize;
    let mut blocks = Vec::with_capacity(count.min(4096));
    for _ in 0..count {
        let (hash, parent_hash, cache_salt) = (r.u64()?, r.u64()?, r.u64()?);
        let num_tokens = r.u32()? as usize;
        let tokens = r
            .take(
                num_tokens
                    .checked_mul(4)
                    .ok_or("a chunk's length overflows")?,
            )?
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect();
        let len = r.u32()? as usize;
        // The one copy out of the chunk (shared memory, or the frame TCP delivered).
        let payload: Shared<[u8]> = r.take(len)?.into();
        let key = BlockKey {
            hash,
            parent_hash,
            cache_salt,
            tokens,
        };
        blocks.push((key, payload));
    }
    let count = r.u32()? as usize;
    let mut states = Vec::with_capacity(count.min(4096));
    for _ in 0..count {
        let hash = r.u64()?;
        let len = r.u32()? as usize;
        states.push((hash, r.take(len)?.into()));
    }
    if !r.0.is_empty() {
        return Err(format!("{} bytes past a chunk's last block", r.0.len()));
    }
    Ok(Chunk {
        namespace,
        blocks,
        states,
    })
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err("a chunk of KV blocks ends early".into());
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }

    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(i: u64, len: usize) -> Block {
        let key = BlockKey {
            hash: i * 7 + 1,
            parent_hash: i,
            cache_salt: 3,
            tokens: (0..16).map(|t| t + i as u32).collect(),
        };
        (key, (0..len).map(|b| (b as u64 * 31 + i) as u8).collect())
    }

    #[test]
    fn chunks_round_trip_under_the_frame_limit_and_never_split_a_block() {
        let mut rng = 0x9e37_79b9_u64;
        for _ in 0..20 {
            rng = crate::sampling::splitmix64(rng);
            let n = (rng % 40) as usize;
            let len = 1 + (rng >> 8) as usize % (3 << 20);
            let blocks: Vec<_> = (0..n as u64).map(|i| block(i, len)).collect();
            let num_states = (rng >> 40) as usize % 3;
            let states: Vec<State> = (0..num_states as u64)
                .map(|i| (i * 13 + 5, block(i + 100, len).1))
                .collect();
            let prefix = Prefix { blocks, states };
            let chunks = encode_chunks("ns", &prefix);
            // Shared memory writes a chunk into a slot of exactly its planned length.
            let plan = chunk_plan(&prefix);
            assert_eq!(plan.len(), chunks.len());
            for (part, c) in plan.iter().zip(&chunks) {
                assert_eq!(part.encoded_len("ns", &prefix), c.len());
            }
            let (mut back, mut back_states) = (Vec::new(), Vec::new());
            for c in &chunks {
                assert!(c.len() <= CHUNK_BYTES + len + 4096, "{} bytes", c.len());
                let chunk = decode_chunk(c).unwrap();
                assert_eq!(chunk.namespace, "ns");
                assert!(
                    chunk.blocks.is_empty() || back_states.is_empty(),
                    "a state before a block"
                );
                back.extend(chunk.blocks);
                back_states.extend(chunk.states);
            }
            assert_eq!((back.len(), back_states.len()), (n, num_states));
            for ((k, p), (want_k, want_p)) in back.iter().zip(&prefix.blocks) {
                assert_eq!(k, want_k);
                assert_eq!(&p[..], &want_p[..]);
            }
            for ((h, p), (want_h, want_p)) in back_states.iter().zip(&prefix.states) {
                assert_eq!((h, &p[..]), (want_h, &want_p[..]));
            }
        }
    }

    /// A store of 64-byte blocks of 16 tokens, a prompt of five whole blocks and three
    /// tokens, and its blocks' keys and payloads.
    fn store_and_blocks() -> (KvStore, Vec<u32>, Vec<Block>) {
        use crate::sched::{ROOT_HASH, block_hash};
        use crate::store::KvStoreConfig;
        let (block_size, block_bytes) = (16, 64);
        let cfg = KvStoreConfig {
            host_bytes: 1 << 20,
            ..KvStoreConfig::default()
        };
        let store = KvStore::open(&cfg, "ns", block_size, block_bytes)
            .unwrap()
            .with_state_bytes(32);
        let mut rng = 5u64;
        let tokens: Vec<u32> = (0..16 * 5 + 3)
            .map(|_| {
                rng = crate::sampling::splitmix64(rng);
                (rng % 30_000) as u32
            })
            .collect();
        let mut parent = ROOT_HASH;
        let blocks: Vec<Block> = tokens
            .chunks_exact(block_size)
            .map(|t| {
                let hash = block_hash(parent, t, 0);
                let key = BlockKey {
                    hash,
                    parent_hash: parent,
                    cache_salt: 0,
                    tokens: t.into(),
                };
                parent = hash;
                (key, vec![hash as u8; block_bytes].into())
            })
            .collect();
        (store, tokens, blocks)
    }

    fn whole(blocks: &[Block]) -> Prefix {
        Prefix {
            blocks: blocks.to_vec(),
            states: Vec::new(),
        }
    }

    #[test]
    fn a_store_takes_a_peers_blocks_only_when_they_are_what_they_claim() {
        let (store, tokens, blocks) = store_and_blocks();
        // A block of another length, or whose key does not hash to it, is refused.
        let (key, _) = blocks[0].clone();
        assert!(store.import(key.clone(), vec![0; 63].into()).is_err());
        let mut forged = key.clone();
        forged.tokens[3] ^= 1;
        assert!(store.import(forged, vec![0; 64].into()).is_err());
        // A chunk of another namespace is refused whole.
        let foreign = encode_chunks("other", &whole(&blocks));
        assert!(put_blocks(&store, &foreign[0]).is_err());
        assert!(store.export(&tokens, 0).is_empty());
        // The three first blocks: the prompt's prefix up to the first it lacks.
        for chunk in encode_chunks("ns", &whole(&blocks[..3])) {
            put_blocks(&store, &chunk).unwrap();
        }
        let got = store.export(&tokens, 0);
        assert_eq!(got.len(), 3);
        for ((k, p), (want_k, want_p)) in got.iter().zip(&blocks) {
            assert_eq!(k, want_k);
            assert_eq!(p, want_p);
        }
        assert_eq!(store.num_blocks_of(&tokens), 5);
    }

    #[test]
    fn a_state_goes_with_a_block_the_store_holds_and_travels_with_its_prefix() {
        let (store, tokens, blocks) = store_and_blocks();
        for chunk in encode_chunks("ns", &whole(&blocks[..3])) {
            put_blocks(&store, &chunk).unwrap();
        }
        // A state goes with a block the store holds, at a state's length; the prefix's
        // export carries its last block's.
        let (hash_of, state) = (|i: usize| blocks[i].0.hash, vec![7u8; 32]);
        assert!(
            store
                .import_state(hash_of(3), state.clone().into())
                .is_err()
        );
        assert!(store.import_state(hash_of(2), vec![7; 31].into()).is_err());
        assert!(Prefix::export(&store, &tokens).states.is_empty());
        let with_state = Prefix {
            blocks: Vec::new(),
            states: vec![
                (hash_of(1), vec![1; 32].into()),
                (hash_of(2), state.clone().into()),
            ],
        };
        for chunk in encode_chunks("ns", &with_state) {
            put_blocks(&store, &chunk).unwrap();
        }
        let prefix = Prefix::export(&store, &tokens);
        assert_eq!(prefix.blocks.len(), 3);
        assert_eq!(prefix.states.len(), 1);
        assert_eq!(
            (prefix.states[0].0, &prefix.states[0].1[..]),
            (hash_of(2), &state[..])
        );
        let staged = store.stage(&tokens, 0, 0);
        let states: Vec<Option<u8>> = staged
            .blocks
            .iter()
            .map(|b| b.state.as_ref().map(|s| s[0]))
            .collect();
        assert_eq!(states, [None, Some(1), Some(7)]);
    }

    #[test]
    fn a_cut_or_foreign_chunk_is_an_error() {
        let prefix = Prefix {
            blocks: vec![block(1, 100)],
            states: vec![(9, vec![1; 40].into())],
        };
        let chunk = encode_chunks("ns", &prefix).remove(0);
        for cut in [0, 3, 10, chunk.len() - 1] {
            assert!(decode_chunk(&chunk[..cut]).is_err(), "cut at {cut}");
        }
        let mut longer = chunk.clone();
        longer.push(0);
        assert!(decode_chunk(&longer).is_err());
        assert!(decode_chunk(b"XXXX\0\0\0\0\0\0\0\0").is_err());
    }
}
