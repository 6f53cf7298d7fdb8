//! A step's plan, made on the host once for all layers: each row's (sequence, position),
//! each sequence's fields and block table, the step's tokens, and per compress rate the
//! entries its chunks close — uploaded where the backend's ops read them.

use super::DsSeqStep;
use super::config::{AttentionKind, DsV4Config};
use crate::kernels::deepseek_v4::{
    DsV4Kernels, NO_ENTRY, S_LEN, S_POS0, S_REPLAY, S_ROW0, S_SLOT, S_START, S_TABLE, SEQ_FIELDS,
    StepMeta,
};

pub struct Plan<B: DsV4Kernels> {
    pub meta: StepMeta<B>,
    pub token_ids: B::Ids,
    /// Per compress rate: the entries the step closes (entry index, position of the
    /// window's first token) and how many.
    pub emits: Vec<(usize, B::Ids, usize)>,
    /// Per row: its position.
    pub positions: Vec<usize>,
    /// How many compressed entries the lightning indexer scores per row: the most any row
    /// sees, or more.
    pub index_span: usize,
    /// The rows its buffers hold (`with_capacity`'s plans; 0 for a step's own).
    rows_capacity: usize,
}

/// A plan's lists on the host.
struct Lists {
    rows: Vec<u32>,
    seqs: Vec<u32>,
    tables: Vec<u32>,
    token_ids: Vec<u32>,
    positions: Vec<usize>,
    max_len: usize,
    emits: Vec<(usize, Vec<u32>)>,
}

impl Lists {
    fn new(cfg: &DsV4Config, block_size: usize, steps: &[DsSeqStep<'_>]) -> Self {
        let mut l = Lists {
            rows: Vec::new(),
            seqs: Vec::new(),
            tables: Vec::new(),
            token_ids: Vec::new(),
            positions: Vec::new(),
            max_len: 0,
            emits: Vec::new(),
        };
        for (i, s) in steps.iter().enumerate() {
            let len = s.token_ids.len();
            let mut fields = [0u32; SEQ_FIELDS];
            fields[S_SLOT] = s.state_slot;
            fields[S_POS0] = s.num_cached_tokens as u32;
            fields[S_ROW0] = l.positions.len() as u32;
            fields[S_LEN] = len as u32;
            fields[S_START] = s.span.state_start as u32;
            fields[S_REPLAY] = s.span.replay_until as u32;
            fields[S_TABLE] = l.tables.len() as u32;
            l.seqs.extend_from_slice(&fields);
            l.tables.extend_from_slice(s.block_table);
            for p in s.num_cached_tokens..s.num_cached_tokens + len {
                l.rows.extend_from_slice(&[i as u32, p as u32]);
                l.positions.push(p);
            }
            l.token_ids.extend_from_slice(s.token_ids);
            l.max_len = l.max_len.max(len);
        }
        l.emits = compress_rates(cfg)
            .into_iter()
            .map(|rate| (rate, closed_entries(steps, rate, block_size)))
            .collect();
        l
    }

    fn index_span(&self, cfg: &DsV4Config) -> usize {
        let max_pos = self.positions.iter().copied().max().unwrap_or(0);
        (max_pos + 1).checked_div(cfg.csa_rate).unwrap_or(0)
    }
}

impl<B: DsV4Kernels> Plan<B> {
    pub fn new(b: &B, cfg: &DsV4Config, block_size: usize, steps: &[DsSeqStep<'_>]) -> Self {
        let l = Lists::new(cfg, block_size, steps);
        let index_span = l.index_span(cfg);
        Plan {
            meta: StepMeta {
                rows: b.upload_ids(&l.rows),
                seqs: b.upload_ids(&l.seqs),
                tables: b.upload_ids(&l.tables),
                num_rows: l.positions.len(),
                num_seqs: steps.len(),
                max_len: l.max_len,
            },
            token_ids: b.upload_ids(&l.token_ids),
            emits: l
                .emits
                .into_iter()
                .map(|(rate, list)| {
                    let count = list.len() / 2;
                    (rate, b.upload_ids(&list), count)
                })
                .collect(),
            positions: l.positions,
            index_span,
            rows_capacity: 0,
        }
    }

    /// A plan of `rows` one-token rows at fixed addresses (a recorded step's), its block
    /// tables up to `tables` entries; `refill` writes each step's.
    pub fn with_capacity(b: &B, cfg: &DsV4Config, rows: usize, tables: usize) -> Self {
        Plan {
            meta: StepMeta {
                rows: b.alloc_ids(2 * rows),
                seqs: b.alloc_ids(SEQ_FIELDS * rows),
                tables: b.alloc_ids(tables),
                num_rows: rows,
                num_seqs: rows,
                max_len: 1,
            },
            token_ids: b.alloc_ids(rows),
            emits: compress_rates(cfg)
                .into_iter()
                .map(|rate| (rate, b.alloc_ids(2 * rows), rows))
                .collect(),
            positions: Vec::new(),
            index_span: 0,
            rows_capacity: rows,
        }
    }

    /// This plan (`with_capacity`'s) rewritten in place for `steps`, one token each, at
    /// most as many as it has rows: each emitted-entry list padded with `NO_ENTRY` to a row each
    /// (a row closes at most one window of a rate), and the indexer's span rounded up to a
    /// power of two, so that steps differ only in what the buffers hold.
    pub fn refill(&mut self, b: &B, cfg: &DsV4Config, block_size: usize, steps: &[DsSeqStep<'_>]) {
        let l = Lists::new(cfg, block_size, steps);
        let rows = steps.len();
        assert!(
            l.positions.len() == rows && rows <= self.rows_capacity && l.max_len == 1,
            "a recorded plan takes at most {} one-token rows",
            self.rows_capacity
        );
        self.meta.num_rows = rows;
        self.meta.num_seqs = rows;
        b.write_ids(&mut self.meta.rows, &l.rows);
        b.write_ids(&mut self.meta.seqs, &l.seqs);
        b.write_ids(&mut self.meta.tables, &l.tables);
        b.write_ids(&mut self.token_ids, &l.token_ids);
        self.index_span = l.index_span(cfg).next_power_of_two().max(64);
        for ((_, ids, count), (_, mut list)) in self.emits.iter_mut().zip(l.emits) {
            list.resize(2 * rows, NO_ENTRY);
            b.write_ids(ids, &list);
            *count = rows;
        }
        self.positions = l.positions;
    }

    pub fn num_rows(&self) -> usize {
        self.positions.len()
    }

    /// The entries of compress rate `rate` this step closes, and how many.
    pub fn emits(&self, rate: usize) -> (&B::Ids, usize) {
        let (_, list, count) = self
            .emits
            .iter()
            .find(|(r, _, _)| *r == rate)
            .expect("the plan lists every compress rate");
        (list, *count)
    }
}

/// Every compress rate the model's layers and indexers use.
fn compress_rates(cfg: &DsV4Config) -> Vec<usize> {
    let mut rates: Vec<usize> = (0..cfg.num_layers).filter_map(|l| cfg.rate(l)).collect();
    if cfg.attention.contains(&AttentionKind::CompressedSparse) {
        rates.push(cfg.csa_rate);
    }
    rates.sort_unstable();
    rates.dedup();
    rates
}

/// (entry index, first position) of each window of `rate` the steps close, skipping
/// windows of a replayed prefix (their entries are cached already).
fn closed_entries(steps: &[DsSeqStep<'_>], rate: usize, block_size: usize) -> Vec<u32> {
    let mut list = Vec::new();
    for s in steps {
        for pos in s.num_cached_tokens..s.num_cached_tokens + s.token_ids.len() {
            let w = pos / rate;
            if pos % rate != rate - 1 || (w + 1) * rate <= s.span.replay_until {
                continue;
            }
            let first = w * rate;
            let block = s.block_table[first / block_size] as usize;
            let entry = block * (block_size / rate) + (first % block_size) / rate;
            list.extend_from_slice(&[entry as u32, first as u32]);
        }
    }
    list
}
