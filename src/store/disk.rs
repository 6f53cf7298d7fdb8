//! The disk tier: a file per block in a directory several engines may share. Writes go to
//! a temporary file renamed into place (a reader sees a whole file or none); a checksum
//! over the header, the tokens and the payload is checked on every read, so a torn or
//! corrupt file is a miss (and is removed), never wrong KV. Garbage collection drops files
//! past their time to live and then the least recently used (by modification time, which
//! a hit refreshes) until the directory is within its budget.

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use super::BlockKey;
use crate::sync::Shared;

const MAGIC: &[u8; 8] = b"TROUPEKV";
const VERSION: u32 = 1;
/// Magic, version, checksum, hash, parent, salt, token count, payload length.
const HEADER_BYTES: usize = 8 + 4 + 4 + 8 + 8 + 8 + 4 + 8;
/// Leftovers of a writer that died mid-file are removed once this old.
const STALE_TEMP: Duration = Duration::from_secs(600);

/// What a read found.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum DiskRead {
    Hit(Shared<[u8]>),
    Miss,
    /// The file was there but torn, corrupt or another block's: removed, a miss.
    Corrupt,
}

/// What one garbage collection removed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Collected {
    pub(super) expired: u64,
    pub(super) evicted: u64,
    /// Bytes of block files left.
    pub(super) bytes: u64,
}

pub(super) struct DiskTier {
    dir: PathBuf,
    budget_bytes: u64,
    ttl: Option<Duration>,
    /// A payload's length in this cache's layout: any other is a corrupt file.
    block_bytes: usize,
}

impl DiskTier {
    /// The tier in `dir` (created if missing).
    pub(super) fn open(
        dir: PathBuf,
        budget_bytes: u64,
        ttl: Option<Duration>,
        block_bytes: usize,
    ) -> io::Result<Self> {
        fs::create_dir_all(&dir)?;
        Ok(DiskTier {
            dir,
            budget_bytes,
            ttl,
            block_bytes,
        })
    }

    pub(super) fn budget_bytes(&self) -> u64 {
        self.budget_bytes
    }

    fn path(&self, hash: u64) -> PathBuf {
        self.dir.join(format!("{hash:016x}.kv"))
    }

    fn expired(&self, modified: SystemTime) -> bool {
        self.ttl
            .is_some_and(|ttl| modified.elapsed().is_ok_and(|age| age > ttl))
    }

    /// Whether a live file for `hash` is there (its contents are checked on read).
    pub(super) fn contains(&self, hash: u64) -> bool {
        fs::metadata(self.path(hash))
            .and_then(|m| m.modified())
            .is_ok_and(|t| !self.expired(t))
    }

    /// Marks `hash`'s file as just used; false when there is none.
    pub(super) fn touch(&self, hash: u64) -> bool {
        fs::File::options()
            .write(true)
            .open(self.path(hash))
            .and_then(|f| f.set_modified(SystemTime::now()))
            .is_ok()
    }

    pub(super) fn read(&self, key: &BlockKey) -> DiskRead {
        let path = self.path(key.hash);
        let Ok(meta) = fs::metadata(&path) else {
            return DiskRead::Miss;
        };
        if meta.modified().is_ok_and(|t| self.expired(t)) {
            let _ = fs::remove_file(&path);
            return DiskRead::Miss;
        }
        let Ok(bytes) = fs::read(&path) else {
            return DiskRead::Miss;
        };
        match decode(&bytes, key, self.block_bytes) {
            Some(payload) => {
                // A hit is a use: the least recently used go first.
                self.touch(key.hash);
                DiskRead::Hit(payload.into())
            }
            None => {
                let _ = fs::remove_file(&path);
                DiskRead::Corrupt
            }
        }
    }

    /// Writes `key`'s block; returns the file's bytes.
    pub(super) fn write(&self, key: &BlockKey, payload: &[u8]) -> io::Result<u64> {
        let bytes = encode(key, payload);
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let temp = self.dir.join(format!(
            ".{:016x}.{}.{nanos}.tmp",
            key.hash,
            std::process::id()
        ));
        let written = (|| {
            let mut file = fs::File::create(&temp)?;
            file.write_all(&bytes)?;
            // On disk before it has its name: a crash leaves a whole file or a temp one.
            file.sync_data()?;
            fs::rename(&temp, self.path(key.hash))?;
            // The name on disk too before the block is reported saved: without it a power
            // cut can take back a rename that already returned.
            fs::File::open(&self.dir)?.sync_all()
        })();
        if written.is_err() {
            let _ = fs::remove_file(&temp);
        }
        written.map(|()| bytes.len() as u64)
    }

    /// Removes expired files, then the least recently used until within the budget.
    pub(super) fn collect_garbage(&self) -> io::Result<Collected> {
        let mut files = Vec::new();
        let mut done = Collected::default();
        for entry in fs::read_dir(&self.dir)? {
            let Ok(entry) = entry else { continue };
            let path = entry.path();
            let Ok(meta) = entry.metadata() else { continue };
            let modified = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
            if is_temp(&path) {
                if modified.elapsed().is_ok_and(|age| age > STALE_TEMP) {
                    let _ = fs::remove_file(&path);
                }
                continue;
            }
            if path.extension().is_none_or(|e| e != "kv") {
                continue;
            }
            if self.expired(modified) {
                if fs::remove_file(&path).is_ok() {
                    done.expired += 1;
                }
                continue;
            }
            files.push((modified, meta.len(), path));
        }
        files.sort_unstable();
        let mut bytes: u64 = files.iter().map(|f| f.1).sum();
        for (_, len, path) in &files {
            if bytes <= self.budget_bytes {
                break;
            }
            // Another engine sharing the directory may have removed it first.
            if fs::remove_file(path).is_ok() {
                done.evicted += 1;
            }
            bytes -= len;
        }
        done.bytes = bytes;
        Ok(done)
    }
}

fn is_temp(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with('.') && n.ends_with(".tmp"))
}

fn encode(key: &BlockKey, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_BYTES + key.tokens.len() * 4 + payload.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&key.hash.to_le_bytes());
    out.extend_from_slice(&key.parent_hash.to_le_bytes());
    out.extend_from_slice(&key.cache_salt.to_le_bytes());
    out.extend_from_slice(&(key.tokens.len() as u32).to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend(key.tokens.iter().flat_map(|t| t.to_le_bytes()));
    out.extend_from_slice(payload);
    let crc = crc32fast::hash(&out[16..]);
    out[12..16].copy_from_slice(&crc.to_le_bytes());
    out
}

/// The payload of a whole, uncorrupted file of `key`'s block; `None` otherwise.
fn decode<'a>(bytes: &'a [u8], key: &BlockKey, expected_len: usize) -> Option<&'a [u8]> {
    let u32_at = |at: usize| Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?));
    let u64_at = |at: usize| Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?));
    if bytes.get(..8)? != MAGIC || u32_at(8)? != VERSION {
        return None;
    }
    if crc32fast::hash(bytes.get(16..)?) != u32_at(12)? {
        return None;
    }
    let (hash, parent, salt) = (u64_at(16)?, u64_at(24)?, u64_at(32)?);
    let (num_tokens, payload_len) = (u32_at(40)? as usize, u64_at(44)? as usize);
    let tokens_end = HEADER_BYTES + num_tokens * 4;
    if tokens_end.checked_add(payload_len) != Some(bytes.len())
        || payload_len != expected_len
        || (hash, parent, salt) != (key.hash, key.parent_hash, key.cache_salt)
        || num_tokens != key.tokens.len()
    {
        return None;
    }
    let same_tokens = bytes[HEADER_BYTES..tokens_end]
        .chunks_exact(4)
        .zip(key.tokens.iter())
        .all(|(b, &t)| b == t.to_le_bytes());
    same_tokens.then(|| &bytes[tokens_end..])
}

#[cfg(test)]
mod tests;
