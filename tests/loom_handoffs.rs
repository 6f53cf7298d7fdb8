//! Loom: work handed between threads over the crate's channels (`troupe::sync::channel`)
//! and its shared caches — the CPU ranks' all-reduce, the prefix store's hand-off of
//! blocks to its disk writer, and the grammar compiler's cache under two requests.
//! Run with `cargo test --release --features loom --test loom_handoffs`.
#![cfg(feature = "loom")]

use std::path::PathBuf;
use std::sync::Arc as Shared;
use std::sync::atomic::{AtomicUsize, Ordering};

use loom::sync::Arc;
use loom::thread;
use troupe::kernels::collective::ChannelCollective;
use troupe::sched::{KvSave, ROOT_HASH, block_hash};
use troupe::store::{KvStore, KvStoreConfig};
use troupe::structured::{GrammarCompiler, GrammarSpec, Vocabulary};

#[test]
fn two_cpu_ranks_reduce_to_the_same_sum_in_rank_order() {
    loom::model(|| {
        let mut group = ChannelCollective::group(2);
        let second = group.pop().unwrap();
        let first = group.pop().unwrap();
        let h = thread::spawn(move || second.sum(&[1e8, 2.0]));
        let mine = first.sum(&[1.0, 3.0]);
        let theirs = h.join().unwrap();
        // Rank order, so the same bits on both: (1 + 1e8) rounds the 1 away.
        assert_eq!(mine, vec![1.0f32 + 1e8, 5.0]);
        assert_eq!(mine, theirs);
    });
}

#[test]
fn a_rank_whose_peer_is_gone_fails_instead_of_waiting() {
    loom::model(|| {
        let mut group = ChannelCollective::group(2);
        let peer = group.pop().unwrap();
        let me = group.pop().unwrap();
        let h = thread::spawn(move || drop(peer));
        let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| me.sum(&[1.0])));
        h.join().unwrap();
        assert!(got.is_err(), "a reduce without its peer returned");
    });
}

/// A directory of its own for each explored interleaving.
fn fresh_dir() -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "troupe-loom-store-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn block(k: u32) -> (KvSave, Vec<u8>) {
    let tokens = [k, k + 1];
    let save = KvSave {
        block_id: k,
        hash: block_hash(ROOT_HASH, &tokens, 0),
        parent_hash: ROOT_HASH,
        cache_salt: 0,
        tokens: tokens[..].into(),
    };
    (save, vec![k as u8; 3])
}

/// Blocks saved from two threads while the writer takes them: each is counted before the
/// writer can finish it (a count never goes below zero), and dropping the store waits
/// for the writer to put every one on disk.
#[test]
fn the_store_hands_every_saved_block_to_its_disk_writer() {
    loom::model(|| {
        let dir = fresh_dir();
        let cfg = KvStoreConfig {
            host_bytes: 1 << 20,
            dir: Some(dir.clone()),
            disk_bytes: 1 << 20,
            ttl: None,
        };
        let store = Arc::new(KvStore::open(&cfg, "loom", 2, 3).unwrap());
        let saver = store.clone();
        let h = thread::spawn(move || {
            let (save, bytes) = block(10);
            saver.save(&save, bytes.into());
        });
        let (save, bytes) = block(20);
        store.save(&save, bytes.into());
        h.join().unwrap();
        let stats = store.stats();
        assert!(stats.pending_writes <= 2, "{stats:?}");
        assert_eq!(stats.dropped_writes, 0, "{stats:?}");
        // The saver's handle went with its thread: this drop ends the store.
        drop(store);
        let files = walk(&dir)
            .into_iter()
            .filter(|p| p.metadata().is_ok_and(|m| m.len() > 0));
        assert_eq!(files.count(), 2, "both blocks on disk");
        let _ = std::fs::remove_dir_all(&dir);
    });
}

fn walk(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// A vocabulary of the bytes `a`–`f`, one token each (id 6: end of text).
struct Letters;

impl Vocabulary for Letters {
    fn tokenizer_json(&self) -> Result<String, String> {
        let vocab: serde_json::Map<String, serde_json::Value> = ('a'..='f')
            .enumerate()
            .map(|(i, c)| (c.to_string(), (i as u32).into()))
            .chain([("<eos>".to_string(), 6u32.into())])
            .collect();
        Ok(
            serde_json::json!({"version": "1.0", "added_tokens": [{"id": 6, "content": "<eos>",
            "single_word": false, "lstrip": false, "rstrip": false, "normalized": false,
            "special": true}], "normalizer": null, "pre_tokenizer": null,
            "post_processor": null,
            "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}]}, "truncation": null, "padding": null,
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab, "merges": []}})
            .to_string(),
        )
    }

    fn encode_plain_text(&self, text: &str) -> Result<Vec<u32>, String> {
        text.bytes()
            .map(|b| match b {
                b'a'..=b'f' => Ok((b - b'a') as u32),
                _ => Err(format!("{b} is not a letter of the vocabulary")),
            })
            .collect()
    }

    fn vocab_size(&self) -> usize {
        7
    }
}

/// Two requests compiling the same grammar at once share one compiled grammar and one
/// cache entry, beside a third grammar another request compiles.
#[test]
fn two_requests_compiling_one_grammar_share_one_entry() {
    // Compiling a grammar recurses deeper than a loom thread's default stack.
    let big = || thread::Builder::new().stack_size(32 << 20);
    loom::model(move || {
        let first = big()
            .spawn(move || {
                let compiler = Arc::new(GrammarCompiler::new(Shared::new(Letters), 6).unwrap());
                let spec = GrammarSpec::Regex("a[bc]+".into());
                let other = compiler.clone();
                let theirs_spec = spec.clone();
                let h = big()
                    .spawn(move || other.compile(&theirs_spec).unwrap())
                    .unwrap();
                let mine = compiler.compile(&spec).unwrap();
                let third = compiler.compile(&GrammarSpec::Regex("d+".into())).unwrap();
                let theirs = h.join().unwrap();
                assert!(Shared::ptr_eq(&mine, &theirs), "one grammar, two entries");
                assert!(!Shared::ptr_eq(&mine, &third));
                assert_eq!(compiler.num_cached(), 2);
                assert!(mine.accepts("abcb") && !mine.accepts("ad"));
            })
            .unwrap();
        first.join().unwrap();
    });
}

/// The engine's image rows: two claimants of one image (the encoder actor and a rank) —
/// exactly one encodes, the other gets its rows; a claim given up (a failed encoder)
/// passes to the waiter, which encodes it itself.
#[test]
fn one_claimant_encodes_an_image_and_the_other_gets_its_rows() {
    use troupe::runner::image_encoder::{Claim, EmbeddingCache};
    for give_up in [false, true] {
        loom::model(move || {
            let cache = Arc::new(EmbeddingCache::new(1 << 20));
            let encode = |cache: &EmbeddingCache, value: f32, give_up: bool| -> Option<f32> {
                match cache.claim(7, true).expect("waits") {
                    Claim::Ready(rows) => Some(rows[0]),
                    Claim::Mine if give_up => {
                        cache.abandon(7);
                        None
                    }
                    Claim::Mine => {
                        cache.complete(7, Shared::new(vec![value]));
                        Some(value)
                    }
                }
            };
            let other = cache.clone();
            let h = thread::spawn(move || encode(&other, 2.0, false));
            let mine = encode(&cache, 1.0, give_up);
            let theirs = h.join().unwrap();
            let stats = cache.stats();
            match (mine, theirs) {
                (Some(a), Some(b)) => {
                    assert_eq!(a, b, "both claimants see one encoding");
                    assert_eq!((stats.num_encoded, stats.num_hits), (1, 1));
                }
                // Given up first: the other claimed it after and encoded it.
                (None, Some(b)) => {
                    assert!(give_up);
                    assert_eq!(b, 2.0);
                    assert_eq!(stats.num_encoded, 1);
                }
                other => panic!("{other:?}"),
            }
        });
    }
}
