//! Prefix cache: maps a chain hash of FULL blocks to the KV block that holds them.
//!
//! Block `i` of a sequence hashes as `hash(hash of block i-1, its tokens, cache_salt)`,
//! so one lookup per block walks a prompt's prefix and any request can hit any cached
//! prefix of any other request with the same salt. A hit is verified against the stored
//! tokens, parent hash and salt, so a 64-bit collision costs a miss, never wrong KV.
//!
//! The cache owns no refcounts: [`BlockManager`](super::BlockManager) keeps cached blocks
//! with refcount 0 on its LRU, and the scheduler calls [`PrefixCache::remove_block`]
//! when allocation evicts one. Lookup is O(block_size) per block (hash + verify).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Parent hash of a sequence's first block.
pub const ROOT_HASH: u64 = 0x6a09_e667_f3bc_c908;

/// Hit/query counters over the scheduler's lifetime (not cleared by a device reset).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Full prompt blocks looked up at admission.
    pub num_queried_blocks: u64,
    /// Of those, blocks found (and verified) in the cache.
    pub num_hit_blocks: u64,
}

/// Chain hash of one full block. A function pointer so tests can force collisions.
pub type BlockHashFn = fn(parent_hash: u64, tokens: &[u32], cache_salt: u64) -> u64;

/// The default [`BlockHashFn`]: a murmur3-style finalizer folded over the tokens.
/// Deterministic across processes (no random state), so caches compare across runs.
pub fn block_hash(parent_hash: u64, tokens: &[u32], cache_salt: u64) -> u64 {
    let mut h = mix64(parent_hash ^ mix64(cache_salt.wrapping_add(0x9e37_79b9_7f4a_7c15)));
    for pair in tokens.chunks(2) {
        let word = pair[0] as u64 | (pair.get(1).copied().unwrap_or(u32::MAX) as u64) << 32;
        h = mix64(h ^ word).wrapping_add(0x9e37_79b9_7f4a_7c15);
    }
    mix64(h ^ tokens.len() as u64)
}

fn mix64(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// Keys are already well-mixed hashes: hashing them again would only cost time.
#[derive(Default)]
struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | b as u64;
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

#[derive(Debug, Clone)]
struct Entry {
    hash: u64,
    parent_hash: u64,
    cache_salt: u64,
    tokens: Box<[u32]>,
}

/// One verified hit of [`PrefixCache::match_prefix`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CachedBlock {
    pub block_id: u32,
    pub hash: u64,
}

#[derive(Clone)]
pub struct PrefixCache {
    block_size: usize,
    by_hash: HashMap<u64, u32, BuildHasherDefault<IdentityHasher>>,
    /// Indexed by block id; `Some` while the block is registered.
    entries: Vec<Option<Entry>>,
    hash_fn: BlockHashFn,
    stats: PrefixCacheStats,
}

impl PrefixCache {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self::with_hash_fn(num_blocks, block_size, block_hash)
    }

    pub fn with_hash_fn(num_blocks: usize, block_size: usize, hash_fn: BlockHashFn) -> Self {
        Self {
            block_size,
            by_hash: HashMap::default(),
            entries: vec![None; num_blocks],
            hash_fn,
            stats: PrefixCacheStats::default(),
        }
    }

    pub fn hash_block(&self, parent_hash: u64, tokens: &[u32], cache_salt: u64) -> u64 {
        (self.hash_fn)(parent_hash, tokens, cache_salt)
    }

    /// The chain hashes of every cached block (what a router matches prompts against).
    pub fn hashes(&self) -> impl Iterator<Item = u64> + '_ {
        self.by_hash.keys().copied()
    }

    pub fn num_cached_blocks(&self) -> usize {
        self.by_hash.len()
    }

    pub fn stats(&self) -> PrefixCacheStats {
        self.stats
    }

    pub fn record_query(&mut self, num_queried_blocks: usize, num_hit_blocks: usize) {
        self.stats.num_queried_blocks += num_queried_blocks as u64;
        self.stats.num_hit_blocks += num_hit_blocks as u64;
    }

    /// Appends to `hits` the cached blocks of the longest cached prefix of `tokens`'s
    /// full blocks, at most `max_blocks` of them. Pure lookup: no refcount, no counters.
    pub fn match_prefix(
        &self,
        tokens: &[u32],
        cache_salt: u64,
        max_blocks: usize,
        hits: &mut Vec<CachedBlock>,
    ) {
        let mut parent_hash = ROOT_HASH;
        for block_tokens in tokens.chunks_exact(self.block_size).take(max_blocks) {
            let hash = self.hash_block(parent_hash, block_tokens, cache_salt);
            let Some(&block_id) = self.by_hash.get(&hash) else {
                return;
            };
            let entry = self.entries[block_id as usize]
                .as_ref()
                .expect("hash map and entries agree");
            // Collision safety: the same hash with other content is a miss.
            if entry.parent_hash != parent_hash
                || entry.cache_salt != cache_salt
                || *entry.tokens != *block_tokens
            {
                return;
            }
            hits.push(CachedBlock { block_id, hash });
            parent_hash = hash;
        }
    }

    /// Registers `block_id` as holding `tokens` under `hash`. Returns false (and keeps
    /// the existing entry) when another block already holds this hash: two sequences
    /// computed the same prefix at once, and the first one to finish wins.
    pub fn insert(
        &mut self,
        block_id: u32,
        hash: u64,
        parent_hash: u64,
        tokens: &[u32],
        cache_salt: u64,
    ) -> bool {
        debug_assert_eq!(tokens.len(), self.block_size);
        if self.by_hash.contains_key(&hash) || self.entries[block_id as usize].is_some() {
            return false;
        }
        self.by_hash.insert(hash, block_id);
        self.entries[block_id as usize] = Some(Entry {
            hash,
            parent_hash,
            cache_salt,
            tokens: tokens.into(),
        });
        true
    }

    /// Forgets an evicted block.
    pub fn remove_block(&mut self, block_id: u32) {
        if let Some(entry) = self.entries[block_id as usize].take() {
            self.by_hash.remove(&entry.hash);
        }
    }

    /// Drops every entry (the device lost its KV); counters are kept.
    pub fn clear(&mut self) {
        self.by_hash.clear();
        self.entries.iter_mut().for_each(|e| *e = None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Registers `tokens`' full blocks under block ids `first_block..`.
    fn register(cache: &mut PrefixCache, tokens: &[u32], salt: u64, first_block: u32) {
        let mut parent = ROOT_HASH;
        for (i, block) in tokens.chunks_exact(cache.block_size).enumerate() {
            let hash = cache.hash_block(parent, block, salt);
            assert!(cache.insert(first_block + i as u32, hash, parent, block, salt));
            parent = hash;
        }
    }

    fn matched(cache: &PrefixCache, tokens: &[u32], salt: u64) -> Vec<u32> {
        let mut hits = Vec::new();
        cache.match_prefix(tokens, salt, usize::MAX, &mut hits);
        hits.iter().map(|h| h.block_id).collect()
    }

    #[test]
    fn shared_prefix_hits_up_to_the_first_difference() {
        let mut cache = PrefixCache::new(16, 4);
        let a: Vec<u32> = (0..12).collect();
        register(&mut cache, &a, 0, 0);
        let mut b = a.clone();
        b[9] = 99; // differs in the third block
        b.extend([1, 2, 3]);
        assert_eq!(matched(&cache, &b, 0), vec![0, 1]);
        assert_eq!(
            matched(&cache, &a[..11], 0),
            vec![0, 1],
            "partial blocks never match"
        );
    }

    #[test]
    fn salt_separates_identical_prompts() {
        let mut cache = PrefixCache::new(16, 4);
        let a: Vec<u32> = (0..8).collect();
        register(&mut cache, &a, 7, 0);
        assert_eq!(matched(&cache, &a, 7), vec![0, 1]);
        assert!(matched(&cache, &a, 8).is_empty());
    }

    #[test]
    fn hash_collision_is_a_miss_after_verification() {
        // Every block of the same length collides.
        fn colliding(parent: u64, tokens: &[u32], _salt: u64) -> u64 {
            parent.wrapping_add(tokens.len() as u64)
        }
        let mut cache = PrefixCache::with_hash_fn(16, 4, colliding);
        register(&mut cache, &[1, 2, 3, 4], 0, 0);
        assert_eq!(matched(&cache, &[1, 2, 3, 4], 0), vec![0]);
        assert!(matched(&cache, &[1, 2, 3, 5], 0).is_empty());
    }

    #[test]
    fn removed_block_no_longer_matches() {
        let mut cache = PrefixCache::new(16, 4);
        let a: Vec<u32> = (0..8).collect();
        register(&mut cache, &a, 0, 3);
        cache.remove_block(4);
        assert_eq!(matched(&cache, &a, 0), vec![3]);
        assert_eq!(cache.num_cached_blocks(), 1);
        cache.clear();
        assert!(matched(&cache, &a, 0).is_empty());
    }
}
