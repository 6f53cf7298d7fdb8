//! The buffers a cache keeps at fixed addresses for its recorded decode steps
//! (`recorded.rs`): the plan's lists, the embedded tokens, the streams, the logits and the
//! expert counts, sized for the widest step recorded so far.

use super::DsV4Model;
use super::plan::Plan;
use crate::kernels::deepseek_v4::DsV4Kernels;

/// The fixed-address buffers of a cache's recorded steps.
pub struct DecodeArena<B: DsV4Kernels> {
    pub rows_capacity: usize,
    pub tables_capacity: usize,
    pub plan: Plan<B>,
    /// `[rows, hidden]`: the step's embedded tokens.
    pub embedded: B::Buf,
    /// `[rows, n_hc, hidden]`
    pub streams: B::Buf,
    /// `[rows, vocab]`
    pub logits: B::Buf,
    /// `[layers, experts]`: the step's tokens per routed expert.
    pub counts: B::Ids,
}

impl<B: DsV4Kernels> DecodeArena<B> {
    pub fn new(m: &DsV4Model<B>, rows_capacity: usize, tables_capacity: usize) -> Self {
        let (b, cfg) = (&m.backend, &m.cfg);
        let rows = rows_capacity;
        DecodeArena {
            rows_capacity,
            tables_capacity,
            plan: Plan::with_capacity(b, cfg, rows, tables_capacity),
            embedded: b.alloc(rows * cfg.hidden_size),
            streams: b.alloc(rows * cfg.hc_mult * cfg.hidden_size),
            logits: b.alloc(rows * cfg.vocab_size),
            counts: b.alloc_ids(cfg.num_layers * cfg.num_routed_experts),
        }
    }

    pub fn fits(&self, rows: usize, tables: usize) -> bool {
        rows <= self.rows_capacity && tables <= self.tables_capacity
    }
}
