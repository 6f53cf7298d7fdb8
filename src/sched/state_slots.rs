//! Fixed-size per-sequence state slots (an SWA ring, a compressor state): a second pool
//! beside the KV blocks. A slot is not shared and not cached, so a free stack plus an
//! in-use bitmap (to catch double frees) is all it takes; O(1) take and give back.

#[derive(Debug, Clone)]
pub struct StateSlots {
    free: Vec<u32>,
    in_use: Vec<bool>,
}

impl StateSlots {
    pub fn new(num_slots: usize) -> Self {
        assert!(num_slots <= u32::MAX as usize, "slot ids must fit in u32");
        // Reversed so slot 0 is handed out first.
        Self {
            free: (0..num_slots as u32).rev().collect(),
            in_use: vec![false; num_slots],
        }
    }

    pub fn num_slots(&self) -> usize {
        self.in_use.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn allocate(&mut self) -> Option<u32> {
        let slot = self.free.pop()?;
        self.in_use[slot as usize] = true;
        Some(slot)
    }

    pub fn free(&mut self, slot: u32) {
        assert!(
            std::mem::replace(&mut self.in_use[slot as usize], false),
            "double free of state slot {slot}"
        );
        self.free.push(slot);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_run_out_and_come_back() {
        let mut slots = StateSlots::new(2);
        let a = slots.allocate().unwrap();
        let b = slots.allocate().unwrap();
        assert_ne!(a, b);
        assert_eq!(slots.allocate(), None);
        slots.free(a);
        assert_eq!(slots.num_free(), 1);
        assert_eq!(slots.allocate(), Some(a));
    }

    #[test]
    #[should_panic(expected = "double free")]
    fn double_free_panics() {
        let mut slots = StateSlots::new(1);
        let a = slots.allocate().unwrap();
        slots.free(a);
        slots.free(a);
    }
}
