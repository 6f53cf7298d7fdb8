//! KV block accounting: which blocks of the paged pool are free, shared or cached.
//!
//! Every block is in exactly one of three states:
//! - **free**: refcount 0, not cached; on the intrusive free list (a stack threaded
//!   through `next`), O(1) pop and push;
//! - **evictable**: refcount 0 but registered in the prefix cache; on an intrusive
//!   doubly-linked LRU list (`prev`/`next`), so a prefix hit can pull it out in O(1) and
//!   allocation evicts the least recently released one first;
//! - **in use**: refcount ≥ 1, on no list.
//!
//! `next` is shared by both lists because a block is on at most one of them. Free plus
//! evictable blocks count as allocatable: eviction is the caller's signal
//! ([`Allocation::evicted_cached`]) to drop the block's prefix-cache entry.

/// End of an intrusive list.
const NIL: u32 = u32::MAX;

/// Answer of [`BlockManager::can_allocate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alloc {
    /// Enough free or evictable blocks now.
    Ok,
    /// Not now; blocks may come back when sequences finish or are preempted.
    Later,
    /// More blocks than the whole pool: waiting will never help.
    Never,
}

/// One block handed out by [`BlockManager::allocate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocation {
    pub block_id: u32,
    /// The block was taken from the evictable LRU: its prefix-cache entry is now stale.
    pub evicted_cached: bool,
}

/// Refcounted allocator over `num_blocks` KV blocks; see the module doc.
#[derive(Debug, Clone)]
pub struct BlockManager {
    ref_counts: Vec<u32>,
    is_cached: Vec<bool>,
    /// Free-list successor, or LRU successor for evictable blocks.
    next: Vec<u32>,
    /// LRU predecessor; meaningful only for evictable blocks.
    prev: Vec<u32>,
    free_head: u32,
    num_free_uncached: usize,
    lru_head: u32,
    lru_tail: u32,
    num_evictable: usize,
}

impl BlockManager {
    pub fn new(num_blocks: usize) -> Self {
        assert!(
            num_blocks < NIL as usize,
            "block ids must fit below u32::MAX"
        );
        // Free list in ascending id order: 0 is handed out first (easier to read in tests).
        let next = (0..num_blocks as u32)
            .map(|b| {
                if b + 1 < num_blocks as u32 {
                    b + 1
                } else {
                    NIL
                }
            })
            .collect();
        Self {
            ref_counts: vec![0; num_blocks],
            is_cached: vec![false; num_blocks],
            next,
            prev: vec![NIL; num_blocks],
            free_head: if num_blocks > 0 { 0 } else { NIL },
            num_free_uncached: num_blocks,
            lru_head: NIL,
            lru_tail: NIL,
            num_evictable: 0,
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    /// Free plus evictable (cached, unreferenced) blocks: what allocation can hand out.
    pub fn num_free(&self) -> usize {
        self.num_free_uncached + self.num_evictable
    }

    pub fn num_evictable(&self) -> usize {
        self.num_evictable
    }

    pub fn ref_count(&self, block_id: u32) -> u32 {
        self.ref_counts[block_id as usize]
    }

    pub fn is_cached(&self, block_id: u32) -> bool {
        self.is_cached[block_id as usize]
    }

    pub fn can_allocate(&self, num_blocks: usize) -> Alloc {
        if num_blocks > self.num_blocks() {
            Alloc::Never
        } else if num_blocks <= self.num_free() {
            Alloc::Ok
        } else {
            Alloc::Later
        }
    }

    /// Takes one block with refcount 1: a free one first, else the least recently
    /// released cached one. `None` when both lists are empty.
    pub fn allocate(&mut self) -> Option<Allocation> {
        let (block_id, evicted_cached) = if self.free_head != NIL {
            let b = self.free_head;
            self.free_head = self.next[b as usize];
            self.num_free_uncached -= 1;
            (b, false)
        } else if self.lru_head != NIL {
            let b = self.lru_head;
            self.lru_unlink(b);
            self.is_cached[b as usize] = false;
            (b, true)
        } else {
            return None;
        };
        self.next[block_id as usize] = NIL;
        self.ref_counts[block_id as usize] = 1;
        Some(Allocation {
            block_id,
            evicted_cached,
        })
    }

    /// One more holder of a block: a prefix hit (possibly on an evictable block, which
    /// leaves the LRU) or a fork.
    pub fn share(&mut self, block_id: u32) {
        let b = block_id as usize;
        if self.ref_counts[b] == 0 {
            assert!(self.is_cached[b], "share of free block {block_id}");
            self.lru_unlink(block_id);
        }
        self.ref_counts[b] += 1;
    }

    /// Drops one holder; at refcount 0 the block becomes evictable (cached) or free.
    pub fn free(&mut self, block_id: u32) {
        let b = block_id as usize;
        assert!(self.ref_counts[b] > 0, "double free of block {block_id}");
        self.ref_counts[b] -= 1;
        if self.ref_counts[b] > 0 {
            return;
        }
        if self.is_cached[b] {
            self.lru_push_tail(block_id);
        } else {
            self.next[b] = self.free_head;
            self.free_head = block_id;
            self.num_free_uncached += 1;
        }
    }

    /// Marks an in-use block as registered in the prefix cache, so that at refcount 0
    /// it stays matchable (evictable) instead of going back to the free list.
    pub fn mark_cached(&mut self, block_id: u32) {
        assert!(
            self.ref_counts[block_id as usize] > 0,
            "only a block in use can be registered (block {block_id})"
        );
        self.is_cached[block_id as usize] = true;
    }

    fn lru_unlink(&mut self, block_id: u32) {
        let b = block_id as usize;
        let (p, n) = (self.prev[b], self.next[b]);
        if p == NIL {
            self.lru_head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.lru_tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[b] = NIL;
        self.next[b] = NIL;
        self.num_evictable -= 1;
    }

    fn lru_push_tail(&mut self, block_id: u32) {
        let b = block_id as usize;
        self.prev[b] = self.lru_tail;
        self.next[b] = NIL;
        if self.lru_tail == NIL {
            self.lru_head = block_id;
        } else {
            self.next[self.lru_tail as usize] = block_id;
        }
        self.lru_tail = block_id;
        self.num_evictable += 1;
    }

    /// Walks both lists and checks every block is in exactly the state its refcount and
    /// cached flag say. Test and debug aid: O(num_blocks).
    pub fn check_integrity(&self) -> Result<(), String> {
        let n = self.num_blocks();
        let mut seen = vec![false; n];
        let mut count = 0;
        let mut b = self.free_head;
        while b != NIL {
            let i = b as usize;
            if seen[i] || self.ref_counts[i] != 0 || self.is_cached[i] {
                return Err(format!("free list holds bad block {b}"));
            }
            seen[i] = true;
            count += 1;
            b = self.next[i];
        }
        if count != self.num_free_uncached {
            return Err(format!(
                "free list has {count} blocks, counter says {}",
                self.num_free_uncached
            ));
        }
        let (mut count, mut prev) = (0, NIL);
        let mut b = self.lru_head;
        while b != NIL {
            let i = b as usize;
            if seen[i] || self.ref_counts[i] != 0 || !self.is_cached[i] || self.prev[i] != prev {
                return Err(format!("LRU list holds bad block {b}"));
            }
            seen[i] = true;
            count += 1;
            prev = b;
            b = self.next[i];
        }
        if count != self.num_evictable || prev != self.lru_tail {
            return Err(format!(
                "LRU has {count} blocks, counter says {}",
                self.num_evictable
            ));
        }
        match (0..n).find(|&i| !seen[i] && self.ref_counts[i] == 0) {
            Some(i) => Err(format!("block {i} has refcount 0 but is on no list")),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn can_allocate_answers_ok_later_never() {
        let mut bm = BlockManager::new(4);
        assert_eq!(bm.can_allocate(4), Alloc::Ok);
        assert_eq!(bm.can_allocate(5), Alloc::Never);
        let a = bm.allocate().unwrap();
        assert_eq!(bm.can_allocate(4), Alloc::Later);
        assert_eq!(bm.can_allocate(3), Alloc::Ok);
        bm.free(a.block_id);
        assert_eq!(bm.can_allocate(4), Alloc::Ok);
        for _ in 0..4 {
            bm.allocate().unwrap();
        }
        assert_eq!(bm.allocate(), None);
        assert_eq!(bm.can_allocate(1), Alloc::Later);
        bm.check_integrity().unwrap();
    }

    #[test]
    fn free_list_survives_random_alloc_free() {
        let mut bm = BlockManager::new(64);
        let mut held: Vec<u32> = Vec::new();
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..10_000 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            if (!rng.is_multiple_of(3) && !held.is_empty()) || bm.num_free() == 0 {
                let i = (rng >> 8) as usize % held.len();
                bm.free(held.swap_remove(i));
            } else {
                let a = bm.allocate().unwrap();
                assert!(!held.contains(&a.block_id), "block handed out twice");
                held.push(a.block_id);
            }
            assert_eq!(bm.num_free() + held.len(), 64);
        }
        bm.check_integrity().unwrap();
    }

    #[test]
    fn shared_block_returns_only_at_refcount_zero() {
        let mut bm = BlockManager::new(2);
        let b = bm.allocate().unwrap().block_id;
        bm.mark_cached(b);
        bm.share(b);
        bm.free(b);
        assert_eq!(bm.num_free(), 1);
        bm.free(b);
        assert_eq!(bm.num_free(), 2);
        assert_eq!(bm.num_evictable(), 1);
        // A hit on the evictable block pulls it off the LRU.
        bm.share(b);
        assert_eq!((bm.num_free(), bm.num_evictable()), (1, 0));
        bm.check_integrity().unwrap();
    }

    #[test]
    fn evicts_free_blocks_first_then_least_recently_released() {
        let mut bm = BlockManager::new(4);
        let blocks: Vec<u32> = (0..4).map(|_| bm.allocate().unwrap().block_id).collect();
        for &b in &blocks[..3] {
            bm.mark_cached(b);
        }
        // Released in the order 2, 0, 1; block 3 is uncached.
        for b in [2, 0, 1, 3] {
            bm.free(blocks[b]);
        }
        let order: Vec<Allocation> = (0..4).map(|_| bm.allocate().unwrap()).collect();
        assert_eq!(
            order,
            vec![
                Allocation {
                    block_id: 3,
                    evicted_cached: false
                },
                Allocation {
                    block_id: 2,
                    evicted_cached: true
                },
                Allocation {
                    block_id: 0,
                    evicted_cached: true
                },
                Allocation {
                    block_id: 1,
                    evicted_cached: true
                },
            ]
        );
        assert!(!bm.is_cached(2), "an evicted block is no longer cached");
        bm.check_integrity().unwrap();
    }
}
