//! A step's traffic with the prefix store and the saved states, around its pass: stored
//! KV blocks and slot states written into the cache before its rows run, slot states
//! saved (and kept in the store) after, and registered blocks copied out to the store.
//! A failure is the rank's: the engine rebuilds it and recomputes.

use std::time::Instant;

use super::DeviceModel;
use crate::sched::KvSave;
use crate::step::Step;
use crate::store::KvStore;
use crate::sync::Shared;

/// `saves`' blocks copied out of the cache into the prefix store.
pub fn save_kv(
    model: &mut dyn DeviceModel,
    store: &Shared<KvStore>,
    saves: &[KvSave],
) -> Result<(), String> {
    let started = Instant::now();
    let ids: Vec<u32> = saves.iter().map(|s| s.block_id).collect();
    let bytes = model
        .kv_copies()
        .and_then(|kv| kv.kv_blocks(&ids))
        .ok_or("the model's KV cannot be stored")?;
    let per_block = bytes.len() / ids.len().max(1);
    for (save, block) in saves.iter().zip(bytes.chunks_exact(per_block)) {
        store.save(save, block.into());
    }
    store.add_copy_secs(started.elapsed().as_secs_f64(), 0.0);
    Ok(())
}

/// What `step` brings into the cache before it runs: stored KV blocks, saved and stored
/// slot states.
pub fn load_step_state(
    model: &mut dyn DeviceModel,
    store: Option<&Shared<KvStore>>,
    rank: usize,
    step: &Step,
) -> Result<(), String> {
    let loads: Vec<(u32, &[u8])> = step
        .kv_loads
        .iter()
        .map(|l| (l.block_id, &*l.payload))
        .collect();
    // A store entry that does not fit the cache: recompute rather than run on a block
    // nobody wrote.
    let loading = Instant::now();
    if !loads.is_empty() && !model.kv_copies().is_some_and(|kv| kv.set_kv_blocks(&loads)) {
        return Err(format!(
            "rank {rank}: a stored KV block does not fit the cache"
        ));
    }
    let (state_loads, imports) = (&step.state_loads, &step.state_imports);
    if !(state_loads.is_empty() && imports.is_empty()) {
        let Some(states) = model.slot_states() else {
            return Err(format!(
                "rank {rank}: a state for a model without state slots"
            ));
        };
        if !states.load_states(state_loads) {
            return Err(format!(
                "rank {rank}: a saved state or slot it does not hold"
            ));
        }
        // The store checked each state's length: one that does not fit is a slot missing.
        if !states.import_states(imports) {
            return Err(format!("rank {rank}: a stored state does not fit its slot"));
        }
    }
    if let (Some(store), false) = (store, loads.is_empty()) {
        store.add_copy_secs(0.0, loading.elapsed().as_secs_f64());
    }
    Ok(())
}

/// `step`'s slot states saved, before any later step can move the slots on (they are
/// this rank's alone). One at a time: two saves of a step may share a saved state (the
/// pool's least recently used), and the store must copy each before the next overwrites it.
pub fn save_step_states(
    model: &mut dyn DeviceModel,
    store: Option<&Shared<KvStore>>,
    rank: usize,
    step: &Step,
) -> Result<(), String> {
    if step.state_saves.is_empty() {
        return Ok(());
    }
    let Some(states) = model.slot_states() else {
        return Err(format!(
            "rank {rank}: a state save for a model without state slots"
        ));
    };
    for save in &step.state_saves {
        if !states.save_states(std::slice::from_ref(save)) {
            return Err(format!(
                "rank {rank}: a saved state or slot it does not hold"
            ));
        }
        if let (Some(store), Some(hash)) = (store, save.keep_as)
            && let Some(bytes) = states.saved_state(save.saved)
        {
            store.save_state(hash, bytes.into());
        }
    }
    Ok(())
}
