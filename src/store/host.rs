//! The host-memory tier: blocks by chain hash, least recently used first out under a byte
//! budget.

use std::collections::{BTreeMap, HashMap};

use super::BlockKey;
use crate::sync::Shared;

struct Entry {
    key: BlockKey,
    payload: Shared<[u8]>,
    last_use: u64,
}

/// Plain data: the store guards it with its one mutex.
pub(super) struct HostTier {
    budget_bytes: usize,
    bytes: usize,
    entries: HashMap<u64, Entry>,
    /// `last_use` → hash: the eviction order.
    lru: BTreeMap<u64, u64>,
    clock: u64,
    pub(super) num_evictions: u64,
}

impl HostTier {
    pub(super) fn new(budget_bytes: usize) -> Self {
        HostTier {
            budget_bytes,
            bytes: 0,
            entries: HashMap::new(),
            lru: BTreeMap::new(),
            clock: 0,
            num_evictions: 0,
        }
    }

    pub(super) fn budget_bytes(&self) -> usize {
        self.budget_bytes
    }

    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }

    pub(super) fn contains(&self, hash: u64) -> bool {
        self.entries.contains_key(&hash)
    }

    /// The block `key` names (its hash, parent, salt and tokens all equal), now the most
    /// recently used.
    pub(super) fn get(&mut self, key: &BlockKey) -> Option<Shared<[u8]>> {
        let entry = self.entries.get_mut(&key.hash)?;
        if entry.key != *key {
            return None;
        }
        self.clock += 1;
        self.lru.remove(&entry.last_use);
        entry.last_use = self.clock;
        self.lru.insert(self.clock, key.hash);
        Some(entry.payload.clone())
    }

    /// Keeps `payload` as `key`'s block, evicting the least recently used blocks to stay
    /// within the budget (a block larger than the whole budget is not kept).
    pub(super) fn put(&mut self, key: BlockKey, payload: Shared<[u8]>) {
        if payload.len() > self.budget_bytes {
            return;
        }
        self.remove(key.hash);
        while self.bytes + payload.len() > self.budget_bytes {
            let Some((_, oldest)) = self.lru.pop_first() else {
                break;
            };
            let gone = self.entries.remove(&oldest).expect("lru and entries agree");
            self.bytes -= gone.payload.len();
            self.num_evictions += 1;
        }
        self.clock += 1;
        self.bytes += payload.len();
        self.lru.insert(self.clock, key.hash);
        self.entries.insert(
            key.hash,
            Entry {
                key,
                payload,
                last_use: self.clock,
            },
        );
    }

    fn remove(&mut self, hash: u64) {
        if let Some(old) = self.entries.remove(&hash) {
            self.lru.remove(&old.last_use);
            self.bytes -= old.payload.len();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(hash: u64) -> BlockKey {
        BlockKey {
            hash,
            parent_hash: hash ^ 1,
            cache_salt: 0,
            tokens: vec![hash as u32; 4].into(),
        }
    }

    #[test]
    fn the_least_recently_used_block_goes_first_and_the_budget_holds() {
        let mut tier = HostTier::new(300);
        for h in 0..3 {
            tier.put(key(h), vec![h as u8; 100].into());
        }
        assert!(tier.get(&key(0)).is_some(), "0 used: 1 is now the oldest");
        tier.put(key(3), vec![3; 100].into());
        assert!(tier.get(&key(1)).is_none());
        for h in [0, 2, 3] {
            assert_eq!(tier.get(&key(h)).as_deref(), Some(&[h as u8; 100][..]));
        }
        assert_eq!((tier.bytes(), tier.num_evictions), (300, 1));
        tier.put(key(9), vec![9; 301].into());
        assert!(!tier.contains(9), "larger than the budget");
        let mut other = key(2);
        other.tokens = vec![7; 4].into();
        assert!(
            tier.get(&other).is_none(),
            "same hash, other tokens: a miss"
        );
    }
}
