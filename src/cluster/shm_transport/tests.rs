use super::*;
use crate::cluster::kv_transfer::{Block, chunk_plan};
use crate::sched::{ROOT_HASH, block_hash};
use crate::store::{BlockKey, KvStoreConfig};

const BLOCK_SIZE: usize = 16;

/// A store of `block_bytes`-byte blocks and a prompt of `num_blocks` whole blocks and a
/// few tokens more, with drawn tokens and payloads.
pub(crate) fn store_and_prefix(
    seed: u64,
    num_blocks: usize,
    block_bytes: usize,
) -> (KvStore, Vec<u32>, Prefix) {
    let cfg = KvStoreConfig {
        host_bytes: (num_blocks + 4) * block_bytes,
        ..KvStoreConfig::default()
    };
    let store = KvStore::open(&cfg, "ns", BLOCK_SIZE, block_bytes).unwrap();
    let mut rng = seed;
    let mut next = || {
        rng = crate::sampling::splitmix64(rng);
        rng
    };
    let tokens: Vec<u32> = (0..BLOCK_SIZE * num_blocks + 3)
        .map(|_| (next() % 30_000) as u32)
        .collect();
    let mut parent = ROOT_HASH;
    let blocks: Vec<Block> = tokens
        .chunks_exact(BLOCK_SIZE)
        .map(|t| {
            let hash = block_hash(parent, t, 0);
            let key = BlockKey {
                hash,
                parent_hash: parent,
                cache_salt: 0,
                tokens: t.into(),
            };
            parent = hash;
            let payload: Vec<u8> = (0..block_bytes).map(|_| next() as u8).collect();
            (key, payload.into())
        })
        .collect();
    let prefix = Prefix {
        blocks,
        states: Vec::new(),
    };
    (store, tokens, prefix)
}

/// `prefix` through `region`, a slot at a time, into `store` as a receiver with `cookie`
/// takes it.
fn through(
    region: &mut Region,
    prefix: &Prefix,
    store: &KvStore,
    cookie: &str,
) -> Result<usize, String> {
    let mut kept = 0;
    for (i, part) in chunk_plan(prefix).iter().enumerate() {
        let at = region.write(i % SLOTS, "ns", prefix, part, &host_id())?;
        kept += put_shm_blocks(store, cookie, &host_id(), &at)?;
    }
    Ok(kept)
}

#[test]
fn blocks_cross_a_region_unchanged_and_a_region_carries_many_hand_offs() {
    let mut region = Region::create("secret", SLOT_BYTES).unwrap();
    let mut rng = 17u64;
    for round in 0..4 {
        rng = crate::sampling::splitmix64(rng);
        // Drawn sizes: some prefixes fit a slot, some take several chunks.
        let block_bytes = 4096 << (rng % 7);
        let num_blocks = 1 + (rng >> 8) as usize % 48;
        let (store, tokens, prefix) = store_and_prefix(rng, num_blocks, block_bytes);
        let kept = through(&mut region, &prefix, &store, "secret").unwrap();
        assert_eq!(kept, num_blocks, "round {round}");
        let back = store.export(&tokens, 0);
        assert_eq!(back.len(), num_blocks);
        for ((k, p), (want_k, want_p)) in back.iter().zip(&prefix.blocks) {
            assert_eq!(k, want_k);
            assert_eq!(&p[..], &want_p[..]);
        }
    }
}

#[test]
fn a_region_is_refused_unless_it_is_this_clusters_and_on_this_host() {
    let (store, tokens, prefix) = store_and_prefix(3, 4, 4096);
    let part = &chunk_plan(&prefix)[0];
    let mut region = Region::create("secret", SLOT_BYTES).unwrap();
    let at = region.write(0, "ns", &prefix, part, &host_id()).unwrap();
    let refused = |at: &ShmChunk, cookie: &str, why: &str| {
        let e = put_shm_blocks(&store, cookie, &host_id(), at).unwrap_err();
        assert!(e.contains(why), "{e}");
    };
    // Made with another cookie: a node outside the cluster.
    refused(&at, "another secret", "not made by a node of this cluster");
    // Said to be from another host.
    let elsewhere = ShmChunk {
        host: "another-boot-id".into(),
        ..at.clone()
    };
    refused(&elsewhere, "secret", "another host");
    // Another nonce than the region's header carries.
    let forged = ShmChunk {
        nonce: "00".repeat(16),
        ..at.clone()
    };
    refused(&forged, "secret", "not made by a node of this cluster");
    // A descriptor of a file that is not a region.
    let plain = tempfile_in_target();
    let not_region = ShmChunk {
        fd: plain.as_raw_fd(),
        ..at.clone()
    };
    refused(&not_region, "secret", "not a KV region");
    // Past the region's end, or over its header.
    let past = ShmChunk {
        offset: at.offset + (2 * SLOT_BYTES) as u64,
        ..at.clone()
    };
    refused(&past, "secret", "of a");
    let header = ShmChunk {
        offset: 0,
        ..at.clone()
    };
    refused(&header, "secret", "of a");
    assert!(
        store.export(&tokens, 0).is_empty(),
        "a refused chunk kept blocks"
    );
    // The sender gone (its region closed): an error, not a hang (the descriptor's number
    // may be another file's by now, refused as such).
    drop(region);
    assert!(put_shm_blocks(&store, "secret", &host_id(), &at).is_err());
    assert!(store.export(&tokens, 0).is_empty());
}

#[test]
fn a_region_is_the_owners_alone_and_named_as_a_kv_region() {
    let region = Region::create("secret", SLOT_BYTES).unwrap();
    let path = format!("/proc/self/fd/{}", region.file.as_raw_fd());
    let meta = std::fs::metadata(&path).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    let target = std::fs::read_link(&path).unwrap();
    assert!(
        target.to_string_lossy().starts_with("/memfd:troupe-kv"),
        "{target:?}"
    );
}

/// An open regular file (not a memfd), removed when the test ends.
fn tempfile_in_target() -> File {
    let path = std::env::temp_dir().join(format!("troupe-not-a-region-{}", std::process::id()));
    let file = File::create(&path).unwrap();
    file.set_len(1 << 20).unwrap();
    let _ = std::fs::remove_file(&path);
    file
}
