//! `EngineStatus`: what the scheduler actor reports of the engine — queue and pool sizes,
//! step counts and times, prefix-cache and speculative-decoding counters — for the library
//! (`EngineHandle::status`), `--stats` and `/metrics`.

/// Draft positions the status counts acceptance at (the engine allows 16 drafts a row).
pub const MAX_SPEC_POSITIONS: usize = 16;

#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineStatus {
    /// Why the engine has failed for good (every request is refused with it); `None`
    /// while it serves.
    pub failure: Option<String>,
    pub num_running: usize,
    pub num_waiting: usize,
    /// Prompt tokens admitted or queued and not yet computed: the prefill work ahead.
    pub num_queued_prefill_tokens: usize,
    pub num_free_blocks: usize,
    pub num_total_blocks: usize,
    /// Per-sequence state slots (DeepSeek-V4; 0 and 0 for other models).
    pub num_free_state_slots: usize,
    pub num_total_state_slots: usize,
    /// Sequences preempted (their blocks taken back, recomputed later).
    pub num_preemptions: u64,
    /// EPLB (MoE models with `eplb` set): the worst layer's slowest-rank load over the
    /// mean under the current placement (0.0: no statistics), and rebalances so far.
    pub moe_lb: f64,
    pub num_eplb_rebalances: u64,
    /// Expert replicas those rebalances moved onto ranks (read there, dropped elsewhere).
    pub num_eplb_moved_experts: u64,
    /// `moe_lb` of the expert-parallel ranks' measured busy time (0.0: not measured).
    pub measured_moe_lb: f64,
    pub num_steps: u64,
    /// Times the device state was (re)attached: 1 after start, +1 per restart.
    pub num_resets: u64,
    /// Ranks in the current tensor-parallel group (smaller after a device was lost).
    pub tensor_parallel_size: usize,
    /// Tokens and measured step seconds of steps that held a prefill chunk ...
    pub num_prefill_tokens: u64,
    pub prefill_secs: f64,
    /// ... and of pure decode steps.
    pub num_decode_tokens: u64,
    pub decode_secs: f64,
    pub num_prefix_queried_blocks: u64,
    pub num_prefix_hit_blocks: u64,
    /// Prompt blocks admitted from the prefix store (host memory or disk), not computed.
    pub num_stored_hit_blocks: u64,
    /// DeepSeek-V4 prefix hits resumed from a saved state, and those that replayed the
    /// tokens before the hit instead.
    pub num_resumed_hits: u64,
    pub num_replayed_hits: u64,
    /// The prefix store's counters (all 0 without one).
    pub kv_store: KvStoreStats,
    /// Rank worker time between steps (ZOS shrinks it).
    pub worker_idle_secs: f64,
    /// The device's idle time between steps on its own timeline (CUDA events: from one
    /// step's last work to the next one's first); 0 on the CPU.
    pub device_idle_secs: f64,
    /// Row counts of the measured decode latency curve in use (0: none).
    pub num_decode_curve_points: usize,
    /// Speculative decoding: rows that verified drafts, drafts proposed (the confidence
    /// budget's cuts included), drafts verified, drafts accepted.
    pub num_spec_verify_rows: u64,
    pub num_spec_draft_tokens: u64,
    pub num_spec_verified_tokens: u64,
    pub num_spec_accepted_tokens: u64,
    /// Times a speculating sequence sat out a step under ZOS (its row in flight verifies
    /// drafts, or its drafter looks at its full history again); 0 where verify rows are
    /// continued.
    pub num_spec_sat_out_rows: u64,
    /// Sampled rows whose logits crossed to the host's sampler (processors, or a backend
    /// that does not draw them itself); the others were picked on the device.
    pub num_host_sampled_rows: u64,
    /// Per draft position (0-based, up to 16 drafts): drafts verified there, and accepted
    /// there (every earlier draft of the row accepted too).
    pub spec_verified_by_position: [u64; MAX_SPEC_POSITIONS],
    pub spec_accepted_by_position: [u64; MAX_SPEC_POSITIONS],
    /// Per rank, the cores its threads are pinned to (`0-15`), or `unpinned`.
    pub cpu_affinity: Vec<String>,
    /// The weights' bytes on the devices, all ranks together (0: not counted).
    pub resident_weight_bytes: u64,
    /// Weights a device rank keeps in host memory and computes there (DeepSeek-V4's
    /// routed experts under `--cpu-moe`, `--n-cpu-moe` or the automatic split).
    pub resident_host_weight_bytes: u64,
    /// What each tensor group runs in (the first rank's model card).
    pub weight_card: String,
    /// Vision-language models: images encoded (each once per engine, by its encoder actor
    /// ahead of the prefill or by the rank that reached it first), and ranks' lookups that
    /// found an image's rows encoded already.
    pub num_encoded_images: u64,
    pub num_image_cache_hits: u64,
    /// Images whose rows an encode engine sent here (E/P/D).
    pub num_received_images: u64,
}

/// The store's counters since it opened.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct KvStoreStats {
    pub host_hit_blocks: u64,
    pub disk_hit_blocks: u64,
    /// Disk files that failed their checks (treated as misses, removed).
    pub corrupt_blocks: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub host_evictions: u64,
    /// Disk files removed for the budget, and for their time to live.
    pub disk_evictions: u64,
    pub disk_expired: u64,
    /// Blocks not written to disk because the writer was behind.
    pub dropped_writes: u64,
    /// Blocks queued for the disk and not yet written.
    pub pending_writes: u64,
    pub host_bytes: u64,
    /// Bytes of block files at the last garbage collection.
    pub disk_bytes: u64,
    /// Seconds the rank spent copying blocks out of its cache (for the store) and into it.
    pub copy_out_secs: f64,
    pub copy_in_secs: f64,
}
