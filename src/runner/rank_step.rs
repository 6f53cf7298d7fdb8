//! A step as one rank's model runs it (`RankStep`): each of the scheduler's rows beside
//! the input this rank resolved for it (`StepInputs::resolve`: a ZOS row's token found
//! where the previous step left it). It is all `DeviceModel::step` takes: the row's plan
//! and sampling, what the model runs, and where its input lies, in one place a row.

use crate::kernels::{NOT_PICKED, VerifiedRow};
use crate::model::llama::SeqStep;
use crate::step::StepRow;

/// One step on one rank.
pub struct RankStep<'a> {
    pub block_size: usize,
    pub rows: Vec<RankRow<'a>>,
}

/// One row of a `RankStep`.
pub struct RankRow<'a> {
    /// The scheduler's row: its plan, how it is sampled, whether its prompt is scored.
    pub row: &'a StepRow,
    /// What the model runs for it: its tokens at their positions (moved back by the drafts
    /// the verify row it continues rejected, where the rank learned that), its blocks.
    pub seq: SeqStep<'a>,
    /// Its input is entry `pick` of the device's last picks, which the embedding reads
    /// there (`NOT_PICKED`: its input is in `seq`).
    pub pick: u32,
    /// The verify row it continues keeps its picks on the device: (first pick, drafts),
    /// which the device verifies and moves this row back by (`VerifiedRow`).
    pub verified: Option<(u32, &'a [u32])>,
    /// What the row it continues yielded, where the rank knows it without the sampler.
    pub prior: Option<&'a PriorYield>,
}

impl<'a> RankStep<'a> {
    /// Rows of their own tokens, `seqs[i]` running `rows[i]`: a step no earlier step
    /// feeds (the decode latency curve's, a warm-up's).
    pub fn of_tokens(block_size: usize, seqs: &[SeqStep<'a>], rows: &'a [StepRow]) -> Self {
        assert_eq!(seqs.len(), rows.len(), "a sequence for every row");
        let rows = rows
            .iter()
            .zip(seqs)
            .map(|(row, seq)| RankRow {
                row,
                seq: seq.clone(),
                pick: NOT_PICKED,
                verified: None,
                prior: None,
            })
            .collect();
        RankStep { block_size, rows }
    }

    /// What the model runs, row by row (the forward pass's view).
    pub fn seqs(&self) -> Vec<SeqStep<'a>> {
        self.rows.iter().map(|r| r.seq.clone()).collect()
    }

    /// Per row, its input's index among the device's picks; empty where no row reads one.
    pub fn picked_rows(&self) -> Vec<u32> {
        if self.rows.iter().all(|r| r.pick == NOT_PICKED) {
            return Vec::new();
        }
        self.rows.iter().map(|r| r.pick).collect()
    }

    /// The rows whose verify row's outcome the device applies.
    pub fn verified_rows(&self) -> Vec<VerifiedRow<'a>> {
        let rows = self.rows.iter().enumerate();
        rows.filter_map(|(row, r)| {
            r.verified.map(|(first_pick, drafts)| VerifiedRow {
                row,
                first_pick,
                drafts,
            })
        })
        .collect()
    }

    /// Per row: how many of its last tokens are placeholders a drafting model fills in.
    pub fn num_placeholders(&self) -> Vec<usize> {
        let sampling = self.rows.iter().map(|r| r.row.sampling.as_ref());
        sampling.map(|s| s.map_or(0, |s| s.drafts.len())).collect()
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }
}

/// What the row a continued row follows yielded, where the rank learns it without the
/// sampler: the tokens a grammar's mask for the continuing row follows.
#[derive(Debug, Clone, PartialEq)]
pub enum PriorYield {
    /// Known on the host.
    Tokens(Vec<u32>),
    /// Picks `first..=first + drafts.len()` on the device, against the row's `drafts`
    /// (`DeviceModel::device_picks` waits for them alone).
    Picks { first: u32, drafts: Vec<u32> },
}
