//! KV blocks between engines on one host through shared memory. The sending engine
//! writes each chunk (`kv_transfer`'s format) into a slot of a memfd region it owns and
//! tells the receiving agent where it is over the cluster's connection; the receiver
//! opens the region through `/proc/PID/fd/FD`, maps the slot and copies the blocks into
//! its store. A region has two slots, so the sender writes the next chunk while the
//! receiver copies the last: a block is copied twice (into the region, out of it) and
//! never encoded, framed or sent through a socket.
//!
//! A region has no name in any file system: it goes when the last process holding it
//! does. Only the owner's user can open it (`/proc` checks that, and the region is 0600),
//! and the receiver maps nothing until the region's header proves it was made with the
//! cluster's cookie.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};

use memmap2::{MmapMut, MmapOptions};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::kv_transfer::{ChunkPart, Prefix, put_blocks};
use crate::store::KvStore;

/// The region's first page: magic, nonce, token; the slots start after it.
const HEADER_BYTES: usize = 4096;
const REGION_MAGIC: &[u8; 8] = b"TKVSHM01";
/// The memfd's name, which `/proc/PID/fd/FD` shows as `/memfd:troupe-kv (deleted)`.
const REGION_NAME: &std::ffi::CStr = c"troupe-kv";
/// Chunks in flight at once: one being written while the other is read.
pub const SLOTS: usize = 2;
/// A slot's size unless a chunk needs more (`kv_transfer`'s chunks are about 8 MiB).
pub const SLOT_BYTES: usize = 16 << 20;

/// Where one chunk lies: sent to the receiving agent as JSON.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ShmChunk {
    /// The sender's host (`host_id`): a receiver elsewhere refuses at once.
    pub host: String,
    pub pid: u32,
    pub fd: i32,
    /// The region's nonce, hex: the header must carry it.
    pub nonce: String,
    pub offset: u64,
    pub len: u64,
}

/// This host, as processes on it see it: the kernel's boot id (two engines that read the
/// same one share a kernel, so one may open the other's regions).
pub fn host_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// What proves a region was made by a node of the cluster: a hash of the cookie and the
/// region's nonce.
fn token(cookie: &str, nonce: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"troupe kv region\0");
    h.update(cookie.as_bytes());
    h.update([0]);
    h.update(nonce);
    h.finalize().into()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A sender's region: a memfd of a header page and `SLOTS` slots, mapped.
pub struct Region {
    file: File,
    map: MmapMut,
    nonce: [u8; 16],
    pub slot_bytes: usize,
}

impl Region {
    /// A new region whose slots hold `slot_bytes` each, its header made with `cookie`.
    pub fn create(cookie: &str, slot_bytes: usize) -> std::io::Result<Region> {
        // SAFETY: memfd_create takes a NUL-terminated name and flags; the descriptor it
        // returns is new and owned by the `File` alone.
        let fd = unsafe { libc::memfd_create(REGION_NAME.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
        file.set_len((HEADER_BYTES + SLOTS * slot_bytes) as u64)?;
        // SAFETY: a receiver maps the region read-only; only a process of this user could
        // open it to write (through /proc), and what it wrote would only garble chunks this
        // process reads back nowhere: the mapping is written here, never read for meaning.
        let mut map = unsafe { MmapMut::map_mut(&file)? };
        let nonce = new_nonce();
        let header = &mut map[..HEADER_BYTES];
        header[..8].copy_from_slice(REGION_MAGIC);
        header[8..24].copy_from_slice(&nonce);
        header[24..56].copy_from_slice(&token(cookie, &nonce));
        Ok(Region {
            file,
            map,
            nonce,
            slot_bytes,
        })
    }

    /// `part` of `prefix` written into `slot`, and where it lies for the receiver.
    pub fn write(
        &mut self,
        slot: usize,
        namespace: &str,
        prefix: &Prefix,
        part: &ChunkPart,
        host: &str,
    ) -> Result<ShmChunk, String> {
        let len = part.encoded_len(namespace, prefix);
        if len > self.slot_bytes || slot >= SLOTS {
            return Err(format!(
                "a chunk of {len} bytes: past the region's {}-byte slots",
                self.slot_bytes
            ));
        }
        let offset = HEADER_BYTES + slot * self.slot_bytes;
        let mut out = &mut self.map[offset..offset + len];
        part.write(namespace, prefix, &mut out)
            .map_err(|e| format!("writing a chunk into shared memory: {e}"))?;
        Ok(ShmChunk {
            host: host.to_string(),
            pid: std::process::id(),
            fd: self.file.as_raw_fd(),
            nonce: hex(&self.nonce),
            offset: offset as u64,
            len: len as u64,
        })
    }
}

/// Unique per region (the kernel's random bytes; the time and process where those fail).
/// Not secret: the cookie is what a forger lacks.
fn new_nonce() -> [u8; 16] {
    let mut nonce = [0u8; 16];
    // SAFETY: getrandom writes at most `nonce.len()` bytes into `nonce`.
    let got = unsafe { libc::getrandom(nonce.as_mut_ptr().cast(), nonce.len(), 0) };
    if got != nonce.len() as isize {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let mut h = Sha256::new();
        h.update(std::process::id().to_le_bytes());
        h.update(now.as_nanos().to_le_bytes());
        let digest: [u8; 32] = h.finalize().into();
        nonce.copy_from_slice(&digest[..16]);
    }
    nonce
}

/// The receiver's side: the chunk `at` describes, read from the sender's region into
/// `store`; the number of blocks kept, or why not (the sender then falls back to TCP).
pub fn put_shm_blocks(
    store: &KvStore,
    cookie: &str,
    host: &str,
    at: &ShmChunk,
) -> Result<usize, String> {
    if at.host != host || host.is_empty() {
        return Err("a shared-memory region of another host".into());
    }
    let path = format!("/proc/{}/fd/{}", at.pid, at.fd);
    let target = std::fs::read_link(&path)
        .map_err(|e| format!("the sender's region {path}: {e} (its process gone?)"))?;
    let name = target.to_string_lossy();
    if !name.starts_with("/memfd:troupe-kv") {
        return Err(format!("{path} is {name}, not a KV region"));
    }
    // Non-blocking: should the number name a FIFO by now, opening it must not wait.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(&path)
        .map_err(|e| format!("opening {path}: {e}"))?;
    let meta = file.metadata().map_err(|e| format!("{path}: {e}"))?;
    if !meta.is_file() {
        return Err(format!("{path} is not a KV region (not a regular file)"));
    }
    let size = meta.len();
    let fits = at.offset >= HEADER_BYTES as u64
        && at.offset.checked_add(at.len).is_some_and(|end| end <= size);
    if !fits {
        return Err(format!(
            "a chunk at {}+{} of a {size}-byte region",
            at.offset, at.len
        ));
    }
    // SAFETY: read-only mappings of a region its owner writes a slot of only after the
    // receiver acknowledged reading it, so these bytes do not change under the copy. A
    // misbehaving process of the same user could garble them: the chunk's format and
    // each block's key and length are checked, its values are not (the cluster's nodes
    // trust each other, as over TCP).
    let header = unsafe { MmapOptions::new().len(HEADER_BYTES).map(&file) }
        .map_err(|e| format!("mapping {path}: {e}"))?;
    let nonce = &header[8..24];
    let proven = &header[..8] == REGION_MAGIC
        && hex(nonce) == at.nonce
        && bool::from(header[24..56].ct_eq(&token(cookie, nonce)));
    if !proven {
        return Err(format!(
            "{path} was not made by a node of this cluster (its token does not match the cookie)"
        ));
    }
    let body = unsafe {
        MmapOptions::new()
            .offset(at.offset)
            .len(at.len as usize)
            .populate()
            .map(&file)
    }
    .map_err(|e| format!("mapping {path}: {e}"))?;
    put_blocks(store, &body)
}

#[cfg(test)]
pub(crate) mod tests;
