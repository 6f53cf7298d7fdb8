//! The prefix store below the device: full KV blocks kept by their prefix chain hash in
//! host memory (`--kv-host-cache-bytes`) and in a directory on disk (`--kv-store-dir`,
//! `--kv-store-bytes`, `--kv-store-ttl`) that outlives the process and that several
//! engines may share. Blocks are written through as the scheduler registers them (the
//! rank copies them out; a writer thread puts them on disk, dropping a write rather than
//! stalling the rank when it falls behind) and staged back before a request is admitted
//! (read on a blocking thread while the engine runs other steps, checked, then loaded into
//! fresh device blocks by the step that admits the request). Files live under a namespace
//! per model and cache layout (`namespace`), so another model or dtype never hits.
//! A model with per-sequence state (DeepSeek-V4) also keeps here, in host memory, the
//! state a cold run has at a prompt block's end, under that block's hash: a hit ending
//! there resumes without the bounded replay.

mod disk;
mod host;

use std::io::{self, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use self::disk::{DiskRead, DiskTier};
use self::host::HostTier;
pub use crate::api::KvStoreStats;
use crate::sched::{KvSave, ROOT_HASH, StoredBlock, StoredPrefix, block_hash};
use crate::sync::{Mutex, Shared};
use rayon::prelude::*;

/// Where blocks are kept, from the command line.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KvStoreConfig {
    /// The host-memory tier's budget; 0: no host tier.
    pub host_bytes: usize,
    /// The disk tier's directory; `None`: no disk tier.
    pub dir: Option<PathBuf>,
    pub disk_bytes: u64,
    /// Blocks unused this long are dropped; `None`: kept until the budget needs room.
    pub ttl: Option<Duration>,
}

impl KvStoreConfig {
    pub fn enabled(&self) -> bool {
        self.host_bytes > 0 || self.dir.is_some()
    }
}

/// What names one block: a lookup hits only when all of it is equal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockKey {
    pub hash: u64,
    pub parent_hash: u64,
    pub cache_salt: u64,
    pub tokens: Box<[u32]>,
}

struct Inner {
    host: HostTier,
    /// Per-sequence states by the hash of the block they end (`save_state`).
    states: HostTier,
    stats: KvStoreStats,
    /// Blocks handed to the writer and not yet written (or failed), and their bytes.
    queued_writes: u64,
    queued_bytes: usize,
}

/// States take at most this fraction of the host tier's budget, on top of it.
const STATE_SHARE: usize = 4;
/// Disk blocks a lookup reads at once, in parallel.
const DISK_READ_WINDOW: usize = 32;
/// Writes queued past this many bytes are dropped (counted), never waited for.
const WRITE_QUEUE_BYTES: usize = 1 << 30;
/// The writer collects garbage at most this often (and once at start).
const GC_PERIOD: Duration = Duration::from_secs(5);

/// Blocks on their way to the disk writer.
type WriteQueue = crate::sync::channel::Sender<(BlockKey, Shared<[u8]>)>;

pub struct KvStore {
    block_size: usize,
    block_bytes: usize,
    /// Bytes of one per-sequence state; 0: the model keeps none.
    state_bytes: usize,
    /// `namespace`'s digest: blocks from another engine are taken only under the same one.
    namespace: String,
    inner: Shared<Mutex<Inner>>,
    disk: Option<Shared<DiskTier>>,
    writes: Option<WriteQueue>,
    writer: Option<crate::sync::thread::JoinHandle<()>>,
}

impl Drop for KvStore {
    /// A clean shutdown keeps every block it queued: the writer drains its queue first.
    fn drop(&mut self) {
        drop(self.writes.take());
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
    }
}

impl KvStore {
    /// The store for blocks of `block_size` tokens, `block_bytes` each as the rank's cache
    /// stores them (a file of another length is corrupt), under `namespace`.
    pub fn open(
        cfg: &KvStoreConfig,
        namespace: &str,
        block_size: usize,
        block_bytes: usize,
    ) -> io::Result<Self> {
        let inner = Shared::new(Mutex::new(Inner {
            host: HostTier::new(cfg.host_bytes),
            states: HostTier::new(cfg.host_bytes / STATE_SHARE),
            stats: KvStoreStats::default(),
            queued_writes: 0,
            queued_bytes: 0,
        }));
        let disk = match &cfg.dir {
            Some(dir) => Some(Shared::new(DiskTier::open(
                dir.join(namespace),
                cfg.disk_bytes,
                cfg.ttl,
                block_bytes,
            )?)),
            None => None,
        };
        let (writes, writer) = match &disk {
            Some(disk) => {
                let (tx, handle) = spawn_writer(disk.clone(), inner.clone())?;
                (Some(tx), Some(handle))
            }
            None => (None, None),
        };
        Ok(KvStore {
            block_size,
            block_bytes,
            state_bytes: 0,
            namespace: namespace.to_string(),
            inner,
            disk,
            writes,
            writer,
        })
    }

    /// The store for a model whose per-sequence state has `state_bytes` bytes
    /// (`DeviceModel::saved_state`'s); a state of another length is refused.
    pub fn with_state_bytes(mut self, state_bytes: usize) -> Self {
        let budget = self
            .inner
            .lock()
            .expect("kv store lock")
            .states
            .budget_bytes();
        if state_bytes > budget {
            tracing::warn!(
                "kv store: a sequence state has {state_bytes} bytes, more than the {budget} \
                 the host tier gives states (a quarter of --kv-host-cache-bytes): hits from \
                 the store replay their window"
            );
        }
        self.state_bytes = state_bytes;
        self
    }

    pub fn stats(&self) -> KvStoreStats {
        let inner = self.inner.lock().expect("kv store lock");
        KvStoreStats {
            host_bytes: inner.host.bytes() as u64,
            host_evictions: inner.host.num_evictions,
            pending_writes: inner.queued_writes,
            ..inner.stats
        }
    }

    /// Keys of `tokens`' full blocks (never the last token's), from the first.
    fn keys(&self, tokens: &[u32], cache_salt: u64) -> impl Iterator<Item = BlockKey> {
        let matchable = &tokens[..tokens.len().saturating_sub(1)];
        let mut parent_hash = ROOT_HASH;
        matchable
            .chunks_exact(self.block_size)
            .map(move |block| {
                let hash = block_hash(parent_hash, block, cache_salt);
                let key = BlockKey {
                    hash,
                    parent_hash,
                    cache_salt,
                    tokens: block.into(),
                };
                parent_hash = hash;
                key
            })
            .collect::<Vec<_>>()
            .into_iter()
    }

    /// Whether block `first_block` of `tokens` may be here (a cheap look before staging).
    pub fn may_have(&self, tokens: &[u32], cache_salt: u64, first_block: usize) -> bool {
        let Some(key) = self.keys(tokens, cache_salt).nth(first_block) else {
            return false;
        };
        let in_host = self
            .inner
            .lock()
            .expect("kv store lock")
            .host
            .contains(key.hash);
        in_host || self.disk.as_ref().is_some_and(|d| d.contains(key.hash))
    }

    /// Whether the block of `tokens` holding token `position` may be here.
    pub fn may_have_token(&self, tokens: &[u32], cache_salt: u64, position: usize) -> bool {
        self.may_have(tokens, cache_salt, position / self.block_size)
    }

    /// `tokens`' consecutive full blocks from `first_block` on that the store holds,
    /// checked (host memory first, then disk; a disk hit is kept in host memory too).
    /// Blocking: disk reads.
    pub fn stage(&self, tokens: &[u32], cache_salt: u64, first_block: usize) -> StoredPrefix {
        let keys: Vec<BlockKey> = self.keys(tokens, cache_salt).skip(first_block).collect();
        let mut blocks = Vec::new();
        {
            let mut inner = self.inner.lock().expect("kv store lock");
            while let Some(payload) = keys.get(blocks.len()).and_then(|k| inner.host.get(k)) {
                let hash = keys[blocks.len()].hash;
                let state = inner.states.get(&state_key(hash));
                blocks.push(StoredBlock {
                    hash,
                    payload,
                    state,
                });
            }
            inner.stats.host_hit_blocks += blocks.len() as u64;
        }
        let Some(disk) = &self.disk else {
            return StoredPrefix {
                first_block,
                blocks,
            };
        };
        // The rest from disk, a window of files read in parallel at a time (checksums
        // dominate), taken in order up to the first miss.
        'windows: for window in keys[blocks.len()..].chunks(DISK_READ_WINDOW) {
            let reads: Vec<DiskRead> = window.par_iter().map(|key| disk.read(key)).collect();
            for (key, read) in window.iter().zip(reads) {
                let mut inner = self.inner.lock().expect("kv store lock");
                match read {
                    DiskRead::Hit(payload) => {
                        inner.stats.disk_hit_blocks += 1;
                        inner.stats.bytes_read += payload.len() as u64;
                        inner.host.put(key.clone(), payload.clone());
                        let state = inner.states.get(&state_key(key.hash));
                        blocks.push(StoredBlock {
                            hash: key.hash,
                            payload,
                            state,
                        });
                    }
                    DiskRead::Miss => break 'windows,
                    DiskRead::Corrupt => {
                        inner.stats.corrupt_blocks += 1;
                        break 'windows;
                    }
                }
            }
        }
        StoredPrefix {
            first_block,
            blocks,
        }
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// How many full blocks of `tokens` (the last token's never) a prefix may hold.
    pub fn num_blocks_of(&self, tokens: &[u32]) -> usize {
        tokens.len().saturating_sub(1) / self.block_size
    }

    /// `tokens`' consecutive full blocks from the first that the host tier holds, with
    /// their keys: what a prefill engine hands its decode engine.
    pub fn export(&self, tokens: &[u32], cache_salt: u64) -> Vec<(BlockKey, Shared<[u8]>)> {
        let mut inner = self.inner.lock().expect("kv store lock");
        self.keys(tokens, cache_salt)
            .map_while(|key| {
                let payload = inner.host.get(&key)?;
                Some((key, payload))
            })
            .collect()
    }

    /// The state kept with block `hash` (`save_state`), if any.
    pub fn export_state(&self, hash: u64) -> Option<Shared<[u8]>> {
        let mut inner = self.inner.lock().expect("kv store lock");
        inner.states.get(&state_key(hash))
    }

    /// Keeps a state another engine of the same namespace saved at the end of block
    /// `hash`, once the block is here and the state has a state's length.
    pub fn import_state(&self, hash: u64, payload: Shared<[u8]>) -> Result<(), String> {
        if self.state_bytes == 0 || payload.len() != self.state_bytes {
            return Err(format!(
                "state of block {hash:016x}: {} bytes, a state here has {}",
                payload.len(),
                self.state_bytes
            ));
        }
        let mut inner = self.inner.lock().expect("kv store lock");
        if !inner.host.contains(hash) {
            return Err(format!(
                "state of block {hash:016x}, which this store lacks"
            ));
        }
        inner.states.put(state_key(hash), payload);
        Ok(())
    }

    /// Keeps the state the rank saved at the end of block `hash` (`StateSave::keep_as`).
    pub fn save_state(&self, hash: u64, payload: Shared<[u8]>) {
        if payload.len() != self.state_bytes {
            tracing::warn!(
                "kv store: a state of {} bytes, {} expected: not kept",
                payload.len(),
                self.state_bytes
            );
            return;
        }
        let mut inner = self.inner.lock().expect("kv store lock");
        inner.states.put(state_key(hash), payload);
    }

    /// Keeps a block another engine of the same namespace computed, once its key is
    /// consistent (the hash is its parent's, tokens' and salt's) and its length a block's.
    pub fn import(&self, key: BlockKey, payload: Shared<[u8]>) -> Result<(), String> {
        if payload.len() != self.block_bytes {
            return Err(format!(
                "block {:016x}: {} bytes, a block here has {}",
                key.hash,
                payload.len(),
                self.block_bytes
            ));
        }
        if key.tokens.len() != self.block_size
            || block_hash(key.parent_hash, &key.tokens, key.cache_salt) != key.hash
        {
            return Err(format!(
                "block {:016x}: its key does not hash to it",
                key.hash
            ));
        }
        self.put(key, payload);
        Ok(())
    }

    /// Keeps a block the rank copied out (`payload`: `DeviceModel::kv_block`).
    pub fn save(&self, save: &KvSave, payload: Shared<[u8]>) {
        let key = BlockKey {
            hash: save.hash,
            parent_hash: save.parent_hash,
            cache_salt: save.cache_salt,
            tokens: save.tokens.clone(),
        };
        self.put(key, payload);
    }

    fn put(&self, key: BlockKey, payload: Shared<[u8]>) {
        self.inner
            .lock()
            .expect("kv store lock")
            .host
            .put(key.clone(), payload.clone());
        if let Some(writes) = &self.writes {
            let mut inner = self.inner.lock().expect("kv store lock");
            let len = payload.len();
            // Counted before the writer can take it, so `flush` never misses it.
            if inner.queued_bytes + len > WRITE_QUEUE_BYTES || writes.send((key, payload)).is_err()
            {
                inner.stats.dropped_writes += 1;
            } else {
                inner.queued_writes += 1;
                inner.queued_bytes += len;
            }
        }
    }

    /// Seconds the rank spent copying blocks out of its cache and into it.
    pub fn add_copy_secs(&self, out_secs: f64, in_secs: f64) {
        let mut inner = self.inner.lock().expect("kv store lock");
        inner.stats.copy_out_secs += out_secs;
        inner.stats.copy_in_secs += in_secs;
    }
}

/// A state's key in its tier: the hash of the block it ends (the block's own key was
/// checked when the block was found).
fn state_key(hash: u64) -> BlockKey {
    BlockKey {
        hash,
        parent_hash: 0,
        cache_salt: 0,
        tokens: Box::new([]),
    }
}

/// The disk writer: queued blocks to files, garbage collected as it goes.
fn spawn_writer(
    disk: Shared<DiskTier>,
    inner: Shared<Mutex<Inner>>,
) -> io::Result<(WriteQueue, crate::sync::thread::JoinHandle<()>)> {
    let (tx, rx) = crate::sync::channel::unbounded::<(BlockKey, Shared<[u8]>)>();
    let handle = crate::sync::thread::Builder::new()
        .name("kv-store-writer".into())
        .spawn(move || {
            let collect = |inner: &Mutex<Inner>| {
                if let Ok(done) = disk.collect_garbage() {
                    let mut inner = inner.lock().expect("kv store lock");
                    inner.stats.disk_evictions += done.evicted;
                    inner.stats.disk_expired += done.expired;
                    inner.stats.disk_bytes = done.bytes;
                }
            };
            collect(&inner);
            let (mut collected, mut since_collected) = (Instant::now(), 0u64);
            for (key, payload) in rx {
                // Another engine, or an earlier run, wrote it (a bad file is removed
                // when read, and written again the next time its block is computed).
                let written = match disk.touch(key.hash) {
                    true => Ok(0),
                    false => disk.write(&key, &payload),
                };
                if let Err(e) = &written {
                    tracing::warn!("kv store: writing block {:016x}: {e}", key.hash);
                }
                let bytes = written.unwrap_or(0);
                since_collected += bytes;
                {
                    let mut inner = inner.lock().expect("kv store lock");
                    inner.stats.bytes_written += bytes;
                    inner.queued_writes -= 1;
                    inner.queued_bytes -= payload.len();
                }
                // Over budget by an eighth at most, and never stale for long.
                if collected.elapsed() > GC_PERIOD || since_collected > disk.budget_bytes() / 8 {
                    collect(&inner);
                    (collected, since_collected) = (Instant::now(), 0);
                }
            }
        })?;
    Ok((tx, handle))
}

/// A directory name for blocks of one model and cache layout: a digest of `settings`
/// (the model's configuration, block size, cache dtype, device and modes) and of the
/// weight files at `model_path` (sizes, first and last MiB).
pub fn namespace(model_path: &Path, settings: &str) -> io::Result<String> {
    use sha2::Digest;
    let mut hasher = sha2::Sha256::new();
    hasher.update(settings.as_bytes());
    let mut files = if model_path.is_dir() {
        std::fs::read_dir(model_path)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.extension()
                    .is_some_and(|e| e == "safetensors" || e == "gguf" || e == "json")
            })
            .collect()
    } else {
        vec![model_path.to_path_buf()]
    };
    files.sort();
    let mut buf = vec![0u8; 1 << 20];
    for path in files {
        let mut file = std::fs::File::open(&path)?;
        let len = file.metadata()?.len();
        hasher.update(
            path.file_name()
                .map(|n| n.as_encoded_bytes())
                .unwrap_or_default(),
        );
        hasher.update(len.to_le_bytes());
        for start in [0, len.saturating_sub(buf.len() as u64)] {
            file.seek(SeekFrom::Start(start))?;
            let n = file.read(&mut buf)?;
            hasher.update(&buf[..n]);
        }
    }
    Ok(hasher.finalize()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}
