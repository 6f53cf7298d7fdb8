//! CUDA graphs for decode and verify steps. A decode step's ~20 launches per layer cost
//! more host and launch time than a small batch's GPU work; recorded once per token count
//! and replayed, the whole forward pass is one launch.
//!
//! A step whose rows are short (decode rows, and verify rows of a few drafts: every token
//! a logit row) runs padded to the next recorded token count (`GRAPH_TOKEN_COUNTS`) with
//! one-token padding rows. Every kernel of such a step is indexed by token through the
//! metadata, so one graph serves 8 decode rows and one row verifying 7 drafts alike.
//!
//! The first step of a count runs eagerly (it sizes every scratch buffer), the second is
//! captured, later ones replay. A graph bakes in every address it touches, so the step's
//! metadata (ids, positions, KV slots, block tables, ...) lives in one fixed device arena,
//! one region per `Meta` kind: the forward pass runs on the host as usual, its uploads
//! land in a pinned staging buffer at those regions, its launches are skipped, and one
//! copy of the staging buffer precedes the replay. Two staging buffers alternate, each
//! guarded by an event, so the host writes step N+1's while step N's copy may be pending.
//! Any reallocation of a buffer a graph uses drops every graph (`invalidate`).

use crate::sync::Shared as Arc;
use std::collections::{HashMap, HashSet};

use cudarc::driver::sys::CUstreamCaptureMode;
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, PinnedHostSlice};

use super::check;
use super::recorded::{OwnModule, Recorded};

/// Token counts that get a graph; larger steps run eagerly.
pub const GRAPH_TOKEN_COUNTS: [usize; 20] = [
    1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512, 640, 768, 1024,
];
const MAX_GRAPH_TOKENS: usize = GRAPH_TOKEN_COUNTS[GRAPH_TOKEN_COUNTS.len() - 1];
/// Sequences a graph step may hold: the block tables' region is sized by it.
const MAX_GRAPH_SEQS: usize = 256;
/// Tokens a row of a graph step may hold: longer rows are prefill chunks, whose attention
/// wants the flash kernel (its tile list varies with the rows, so it stays eager).
pub const MAX_GRAPH_ROW_TOKENS: usize = 16;

/// The kinds of per-step metadata a forward pass uploads; in a graph step each kind is
/// uploaded once and has its own arena region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Meta {
    Ids = 0,
    Positions,
    Slots,
    RowTable,
    RowVisible,
    Rows,
    /// Per token: where its id is among the last greedy picks (ZOS on the device).
    Picked,
    /// Flash-attention tiles: prefill only, never in a graph step.
    Tiles,
    /// Rows continuing a verify row of the step before (`apply_verified`): `VERIFIED_META`
    /// words each, then their drafts.
    Verified,
    /// Last: the only variable-length kind, `MAX_GRAPH_SEQS · (max blocks + 1)` long.
    Tables,
}
const NUM_META: usize = 10;
const META_KINDS: [Meta; NUM_META] = [
    Meta::Ids,
    Meta::Positions,
    Meta::Slots,
    Meta::RowTable,
    Meta::RowVisible,
    Meta::Rows,
    Meta::Picked,
    Meta::Tiles,
    Meta::Verified,
    Meta::Tables,
];
/// Words per continuing row in `Meta::Verified` (the kernel's `VERIFIED_META`).
pub const VERIFIED_META: usize = 7;
const VERIFIED_CAPACITY: usize = MAX_GRAPH_SEQS * (VERIFIED_META + MAX_GRAPH_ROW_TOKENS);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Eager,
    /// The first step of a token count: eager launches, metadata through the arena.
    Warmup(usize),
    Capture(usize),
    Replay(usize),
}

struct Staging {
    /// Held for its allocation; written through `ptr`, because its own accessors
    /// synchronize an event, which a stream capture forbids.
    _host: PinnedHostSlice<u32>,
    ptr: *mut u32,
    len: usize,
    /// Recorded after the copy out of the buffer: synchronized before it is written again.
    copied: CudaEvent,
}

// SAFETY: the pointer is into `_host`, owned here; `Graphs` is reached through a mutex.
unsafe impl Send for Staging {}

impl Staging {
    fn host(&mut self) -> &mut [u32] {
        // SAFETY: `ptr` and `len` describe `_host`'s allocation, alive as long as `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

pub struct Graphs {
    pub phase: Phase,
    arena: Option<CudaSlice<u32>>,
    staging: Vec<Staging>,
    current: usize,
    /// Per kind: the length staged this step.
    staged: [Option<usize>; NUM_META],
    tables_capacity: usize,
    recorded: HashMap<usize, Recorded>,
    warmed: HashSet<usize>,
    /// Whose kernels get programmatic edges in a recorded step (`recorded.rs`); `None`
    /// keeps the capture's full dependencies.
    programmatic: Option<OwnModule>,
    /// This step's rows staged for `apply_verified` (rows, block size), if any.
    pub verified: Option<(usize, usize)>,
}

/// The token count a step of `num_tokens` tokens in `num_seqs` short rows runs at, when a
/// graph can take it.
pub fn padded_tokens(num_tokens: usize, num_seqs: usize) -> Option<usize> {
    if num_seqs > MAX_GRAPH_SEQS {
        return None;
    }
    GRAPH_TOKEN_COUNTS
        .iter()
        .copied()
        .find(|&b| b >= num_tokens)
}

impl Graphs {
    pub fn new(programmatic: Option<OwnModule>) -> Self {
        Graphs {
            programmatic,
            phase: Phase::Eager,
            arena: None,
            staging: Vec::new(),
            current: 0,
            staged: [None; NUM_META],
            tables_capacity: 0,
            recorded: HashMap::new(),
            warmed: HashSet::new(),
            verified: None,
        }
    }

    fn offset(kind: Meta) -> usize {
        match kind {
            Meta::Tables => Meta::Verified as usize * MAX_GRAPH_TOKENS + VERIFIED_CAPACITY,
            _ => kind as usize * MAX_GRAPH_TOKENS,
        }
    }

    fn capacity(&self, kind: Meta) -> usize {
        match kind {
            Meta::Tables => self.tables_capacity,
            Meta::Verified => VERIFIED_CAPACITY,
            _ => MAX_GRAPH_TOKENS,
        }
    }

    /// The device address of `kind`'s region (an arena exists once a graph step began).
    pub fn region(&self, stream: &Arc<CudaStream>, kind: Meta) -> u64 {
        let arena = self.arena.as_ref().expect("a graph step has an arena");
        let (base, _guard) = arena.device_ptr(stream);
        base + (Self::offset(kind) * std::mem::size_of::<u32>()) as u64
    }

    /// Whether the step being run is recorded or replayed: its metadata reaches the
    /// device all at once before its launches, so a kernel can amend it in between.
    pub fn amendable(&self) -> bool {
        matches!(self.phase, Phase::Capture(_) | Phase::Replay(_))
    }

    /// Starts a graph step of `tokens` tokens (a `GRAPH_TOKEN_COUNTS` entry).
    pub fn begin(
        &mut self,
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        tokens: usize,
        max_blocks_per_seq: usize,
    ) {
        if self.arena.is_none() {
            self.tables_capacity = MAX_GRAPH_SEQS * (max_blocks_per_seq + 1);
            let len = Self::offset(Meta::Tables) + self.tables_capacity;
            self.arena = Some(check(stream.alloc_zeros::<u32>(len), "graph arena"));
            for _ in 0..2 {
                // SAFETY: only the staged prefix is ever copied, and it is written first.
                let mut host = check(unsafe { ctx.alloc_pinned::<u32>(len) }, "pinned staging");
                let ptr = check(host.as_mut_ptr(), "pinned staging");
                let copied = check(ctx.new_event(None), "event");
                self.staging.push(Staging {
                    _host: host,
                    ptr,
                    len,
                    copied,
                });
            }
        }
        self.current ^= 1;
        check(
            self.staging[self.current].copied.synchronize(),
            "staging reuse",
        );
        self.staged = [None; NUM_META];
        self.verified = None;
        self.phase = if self.recorded.contains_key(&tokens) {
            Phase::Replay(tokens)
        } else if self.warmed.contains(&tokens) {
            super::mem_pool::release_kept_memory(stream);
            check(
                stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
                "begin capture",
            );
            Phase::Capture(tokens)
        } else {
            Phase::Warmup(tokens)
        };
        tracing::debug!(phase = ?self.phase, "graph step");
    }

    /// Stages `data` as this step's `kind` and returns its device address.
    pub fn upload(&mut self, stream: &Arc<CudaStream>, kind: Meta, data: &[u32]) -> u64 {
        let offset = Self::offset(kind);
        let address = self.region(stream, kind);
        if self.staged[kind as usize].is_some() {
            // Every layer passes the same positions, slots and tables.
            return address;
        }
        assert!(
            data.len() <= self.capacity(kind),
            "{kind:?} metadata of {} entries exceeds the graph arena",
            data.len()
        );
        let staging = &mut self.staging[self.current];
        let host = staging.host();
        host[offset..offset + data.len()].copy_from_slice(data);
        self.staged[kind as usize] = Some(data.len());
        if matches!(self.phase, Phase::Warmup(_)) {
            // Eager launches follow: the data must be on the device first.
            // SAFETY: the region lies inside the arena; the pinned source outlives the copy
            // (its event is synchronized before it is written again).
            check(
                unsafe {
                    cudarc::driver::result::memcpy_htod_async(
                        address,
                        &host[offset..offset + data.len()],
                        stream.cu_stream(),
                    )
                },
                "metadata upload",
            );
            check(staging.copied.record(stream), "event");
        }
        address
    }

    /// Ends the graph step: records it if it is being captured and copies its metadata to
    /// the device; returns the token count of the graph to `launch`, `None` for a step
    /// that ran eagerly. Returns to eager mode.
    pub fn finish(&mut self, stream: &Arc<CudaStream>) -> Option<usize> {
        let tokens = match std::mem::replace(&mut self.phase, Phase::Eager) {
            Phase::Eager => return None,
            Phase::Warmup(tokens) => {
                self.warmed.insert(tokens);
                return None;
            }
            Phase::Capture(tokens) => {
                let graph = check(
                    Recorded::end_capture(stream, self.programmatic),
                    "end capture",
                );
                tracing::debug!(
                    tokens,
                    programmatic_edges = graph.num_programmatic_edges,
                    "recorded a step as a CUDA graph"
                );
                self.recorded.insert(tokens, graph);
                tokens
            }
            Phase::Replay(tokens) => tokens,
        };
        let end = META_KINDS
            .iter()
            .filter_map(|&k| self.staged[k as usize].map(|len| Self::offset(k) + len))
            .max()
            .unwrap_or(0);
        let arena = self.arena.as_ref().expect("a graph step has an arena");
        let (base, _guard) = arena.device_ptr(stream);
        let staging = &mut self.staging[self.current];
        let host = staging.host();
        // SAFETY: [0, end) lies in both; the event guards the source until the copy ran.
        check(
            unsafe {
                cudarc::driver::result::memcpy_htod_async(base, &host[..end], stream.cu_stream())
            },
            "metadata upload",
        );
        check(staging.copied.record(stream), "event");
        Some(tokens)
    }

    /// Launches the recorded step of `tokens` tokens (after `finish`).
    pub fn launch(&self, stream: &Arc<CudaStream>, tokens: usize) {
        check(self.recorded[&tokens].launch(stream), "graph launch");
    }

    /// A buffer a recorded graph uses moved: every graph is recorded again.
    pub fn invalidate(&mut self) {
        assert!(
            !matches!(self.phase, Phase::Capture(_)),
            "a buffer was reallocated while a CUDA graph was being captured"
        );
        self.recorded.clear();
        self.warmed.clear();
    }

    /// Ends a capture a panic left open. Until then every stream operation, the frees of
    /// the rank's weights and KV cache included, would be recorded instead of run, and the
    /// restarted rank would find the memory still taken.
    pub fn abandon_capture(&mut self, stream: &Arc<CudaStream>) {
        if matches!(self.phase, Phase::Capture(_)) {
            self.phase = Phase::Eager;
            Recorded::abandon_capture(stream);
        }
    }
}
