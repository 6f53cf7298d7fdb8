//! Blocks of a prompt held by a prefix store below the device (host memory, a directory
//! on disk): the core admits them as computed and has the rank load them into fresh
//! blocks (`KvLoad`, carried by the step that first reads them); blocks it registers in
//! the prefix cache go the other way (`KvSave`). The payloads are opaque here.

use crate::sync::Shared;

/// One full block found in the store, keyed by its chain hash.
#[derive(Debug, Clone)]
pub struct StoredBlock {
    pub hash: u64,
    /// The block's K and V as the rank's cache stores them.
    pub payload: Shared<[u8]>,
    /// The per-sequence state a cold run has at the block's end, where the store kept one
    /// (`StateSave::keep_as`): a hit ending here resumes with it instead of a replay.
    pub state: Option<Shared<[u8]>>,
}

/// Consecutive blocks of a prompt found in the store, from block `first_block` on (the
/// blocks before it were on the device when the store was asked).
#[derive(Debug, Clone, Default)]
pub struct StoredPrefix {
    pub first_block: usize,
    pub blocks: Vec<StoredBlock>,
}

/// A block the rank fills from the store before the step that carries it runs.
#[derive(Debug, Clone)]
pub struct KvLoad {
    pub block_id: u32,
    pub payload: Shared<[u8]>,
}

/// A state the store kept that the rank writes into slot `slot` before the step that
/// carries it runs (`DeviceModel::import_states`): the slot then holds `position` tokens
/// of a history that begins at 0, all of them prefix hits.
#[derive(Debug, Clone)]
pub struct StateImport {
    pub slot: u32,
    pub position: usize,
    pub payload: Shared<[u8]>,
}

/// A block the rank copies to the store: computed, and registered in the prefix cache.
/// Its parent hash, salt and tokens go with it, so a lookup verifies what it hits.
#[derive(Debug, Clone)]
pub struct KvSave {
    pub block_id: u32,
    pub hash: u64,
    pub parent_hash: u64,
    pub cache_salt: u64,
    pub tokens: Box<[u32]>,
}
