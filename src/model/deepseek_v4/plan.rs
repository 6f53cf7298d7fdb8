//! A step's plan, made on the host once for all layers: each row's (sequence, position),
//! each sequence's fields and block table, the step's tokens, and per compress rate the
//! entries its chunks close — uploaded where the backend's ops read them.

use super::DsSeqStep;
use super::config::{AttentionKind, DsV4Config};
use crate::kernels::deepseek_v4::{
    DsV4Kernels, S_LEN, S_POS0, S_REPLAY, S_ROW0, S_SLOT, S_START, S_TABLE, SEQ_FIELDS, StepMeta,
};

pub struct Plan<B: DsV4Kernels> {
    pub meta: StepMeta<B>,
    pub token_ids: B::Ids,
    /// Per compress rate: the entries the step closes (entry index, position of the
    /// window's first token) and how many.
    pub emits: Vec<(usize, B::Ids, usize)>,
    /// Per row: its position.
    pub positions: Vec<usize>,
}

impl<B: DsV4Kernels> Plan<B> {
    pub fn new(b: &B, cfg: &DsV4Config, block_size: usize, steps: &[DsSeqStep<'_>]) -> Self {
        let mut rows = Vec::new();
        let mut seqs = Vec::new();
        let mut tables = Vec::new();
        let mut token_ids = Vec::new();
        let mut positions = Vec::new();
        let mut max_len = 0;
        for (i, s) in steps.iter().enumerate() {
            let len = s.token_ids.len();
            let mut fields = [0u32; SEQ_FIELDS];
            fields[S_SLOT] = s.state_slot;
            fields[S_POS0] = s.num_cached_tokens as u32;
            fields[S_ROW0] = positions.len() as u32;
            fields[S_LEN] = len as u32;
            fields[S_START] = s.span.state_start as u32;
            fields[S_REPLAY] = s.span.replay_until as u32;
            fields[S_TABLE] = tables.len() as u32;
            seqs.extend_from_slice(&fields);
            tables.extend_from_slice(s.block_table);
            for p in s.num_cached_tokens..s.num_cached_tokens + len {
                rows.extend_from_slice(&[i as u32, p as u32]);
                positions.push(p);
            }
            token_ids.extend_from_slice(s.token_ids);
            max_len = max_len.max(len);
        }
        let emits = compress_rates(cfg)
            .into_iter()
            .map(|rate| {
                let list = closed_entries(steps, rate, block_size);
                (rate, b.upload_ids(&list), list.len() / 2)
            })
            .collect();
        Plan {
            meta: StepMeta {
                rows: b.upload_ids(&rows),
                seqs: b.upload_ids(&seqs),
                tables: b.upload_ids(&tables),
                num_rows: positions.len(),
                num_seqs: steps.len(),
                max_len,
            },
            token_ids: b.upload_ids(&token_ids),
            emits,
            positions,
        }
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
