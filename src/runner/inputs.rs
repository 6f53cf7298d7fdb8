//! A step's inputs on a rank: each row's tokens, or — for a row that continues the
//! previous step under ZOS — the token that step drew, found where it lies: still on the
//! device (the embedding reads the pick there), already on the host, or, for rows the
//! sampler drew on the host, waited for in `SampledTokens`. A row continuing a verify row
//! also learns there how many drafts that row rejected, and moves back by as many
//! positions (it was planned as if all were accepted) — or, where that row's picks stay
//! on the device, is handed to the model as a `VerifiedRow` and the device does both.

use super::PrevToken;
use super::rank_step::{PriorYield, RankRow, RankStep};
use super::sampled_tokens::SampledTokens;
use crate::kernels::NOT_PICKED;
use crate::model::llama::{SeqStep, SlotState};
use crate::sched::RowInput;
use crate::step::{Remap, Step};

/// Where a continued row's token may be found besides the previous step's record.
struct Sources<'a> {
    sampled: &'a SampledTokens,
    in_group: bool,
    rank: usize,
    verifies_on_device: bool,
    read_picks: &'a mut dyn FnMut(u32, usize) -> Vec<u32>,
}

/// The rank's view of the step in flight and the one before it, reused across steps.
#[derive(Default)]
pub struct StepInputs {
    /// Input ids of the current step's rows.
    inputs: Vec<Vec<u32>>,
    /// Per row of the current step: its input's index among the device's picks
    /// (`NOT_PICKED`: its own tokens).
    picks: Vec<u32>,
    /// Per row of the current step: the positions it moves back by (drafts the row it
    /// continues rejected).
    shifts: Vec<usize>,
    /// Per row of the current step: the verify row it continues, where the device applies
    /// that row's outcome (first pick, drafts).
    verified: Vec<Option<(u32, Vec<u32>)>>,
    /// Per row of the current step: what the row it continues yielded, where known
    /// without the sampler.
    prior: Vec<Option<PriorYield>>,
    /// The last launched step (epoch, step id) and where its rows' tokens are.
    prev: Option<(u64, u64, Vec<Option<PrevToken>>)>,
}

impl StepInputs {
    /// Fills the rows' inputs for `step`, its remap table applied; `false` when the engine
    /// was reset while a row waited for its token, so the step is void (a rank of a group
    /// runs it anyway on zeros: a rank that skipped would leave its peers waiting in a
    /// collective).
    pub fn resolve(
        &mut self,
        step: &Step,
        sampled: &SampledTokens,
        in_group: bool,
        rank: usize,
        verifies_on_device: bool,
        read_picks: &mut dyn FnMut(u32, usize) -> Vec<u32>,
    ) -> bool {
        let rows = step.rows.len();
        self.inputs.resize_with(rows, Vec::new);
        self.picks.clear();
        self.shifts.clear();
        self.shifts.resize(rows, 0);
        self.verified.clear();
        self.verified.resize(rows, None);
        self.prior.clear();
        self.prior.resize(rows, None);
        let mut sources = Sources {
            sampled,
            in_group,
            rank,
            verifies_on_device,
            read_picks,
        };
        for (i, row) in step.rows.iter().enumerate() {
            let mut input = std::mem::take(&mut self.inputs[i]);
            input.clear();
            let picked = match (step.remap.source(i), &row.plan.input) {
                (None, RowInput::Tokens(ids)) => {
                    input.extend_from_slice(ids);
                    Some(NOT_PICKED)
                }
                (None, RowInput::FromPrevious { .. }) => {
                    unreachable!("the remap table lists every continued row")
                }
                (Some(_), RowInput::Tokens(_)) => {
                    unreachable!("the remap table lists only continued rows")
                }
                (Some(remap), RowInput::FromPrevious { drafts, .. }) => {
                    let picked = self.continued(i, step, remap, &mut input, &mut sources);
                    input.extend_from_slice(drafts);
                    picked
                }
            };
            self.inputs[i] = input;
            match picked {
                Some(picked) => self.picks.push(picked),
                None => return false,
            }
        }
        true
    }

    /// Row `i`'s input token, continuing `remap`'s row of the previous step, pushed onto
    /// `input` (a placeholder where the device reads it): its index among the device's
    /// picks (`NOT_PICKED`: on the host), or `None` when the step is void.
    fn continued(
        &mut self,
        i: usize,
        step: &Step,
        remap: &Remap,
        input: &mut Vec<u32>,
        sources: &mut Sources<'_>,
    ) -> Option<u32> {
        let known = match &self.prev {
            Some((e, s, prev)) if *e == step.epoch && *s == remap.prev_step => {
                prev.get(remap.prev_row).cloned().flatten()
            }
            _ => None,
        };
        match known {
            Some(PrevToken::Host(token)) => {
                input.push(token);
                self.prior[i] = Some(PriorYield::Tokens(vec![token]));
            }
            Some(PrevToken::Device(first)) => {
                // A placeholder: the embedding reads the pick on the device.
                input.push(0);
                self.prior[i] = Some(PriorYield::Picks {
                    first,
                    drafts: Vec::new(),
                });
                return Some(first);
            }
            Some(PrevToken::HostVerified { drafts, picks }) => {
                self.take_verified(i, input, &drafts, &picks);
            }
            Some(PrevToken::DeviceVerified { first, drafts }) if sources.verifies_on_device => {
                // A placeholder: the device verifies the drafts against its picks and
                // moves the row back (`VerifiedRow`), a seeded row's draws with it
                // (`MovedBack::OnDevice`).
                input.push(0);
                self.prior[i] = Some(PriorYield::Picks {
                    first,
                    drafts: drafts.clone(),
                });
                self.verified[i] = Some((first, drafts));
                return Some(first);
            }
            Some(PrevToken::DeviceVerified { first, drafts }) => {
                // The verify row's picks, read once the device made them: no wait for
                // the readback thread and the sampler.
                let picks = (sources.read_picks)(first, drafts.len() + 1);
                self.take_verified(i, input, &drafts, &picks);
            }
            sampled_by_host => {
                tracing::debug!(
                    rank = sources.rank,
                    step = step.step_id,
                    prev_step = remap.prev_step,
                    prev_row = remap.prev_row,
                    "waiting for a sampled token"
                );
                match sources
                    .sampled
                    .wait(step.epoch, remap.prev_step, remap.prev_row)
                {
                    Some(drawn) => {
                        input.push(drawn.token);
                        self.shifts[i] = drawn.num_rejected as usize;
                        if let Some(PrevToken::Sampled { drafts }) = sampled_by_host
                            && let Some(accepted) =
                                drafts.len().checked_sub(drawn.num_rejected as usize)
                        {
                            let mut tokens = drafts[..accepted].to_vec();
                            tokens.push(drawn.token);
                            self.prior[i] = Some(PriorYield::Tokens(tokens));
                        }
                    }
                    None if sources.in_group => input.push(0),
                    None => return None,
                }
            }
        }
        Some(NOT_PICKED)
    }

    /// Row `i` continues a verify row whose `picks` the host knows: its input is the pick
    /// after the drafts it accepted, and it moves back by those it rejected.
    fn take_verified(&mut self, i: usize, input: &mut Vec<u32>, drafts: &[u32], picks: &[u32]) {
        let drawn = PrevToken::verified(drafts, picks);
        input.push(drawn.token);
        self.shifts[i] = drawn.num_rejected as usize;
        self.prior[i] = Some(PriorYield::Tokens(PrevToken::yielded(drafts, picks)));
    }

    /// `step` as this rank's model runs it: each row beside its resolved input.
    pub fn rank_step<'a>(&'a self, step: &'a Step, block_size: usize) -> RankStep<'a> {
        let rows = step.rows.iter().enumerate().map(|(i, r)| {
            let (row, input, shift) = (&r.plan, &self.inputs[i], self.shifts[i]);
            RankRow {
                row: r,
                seq: SeqStep {
                    token_ids: input,
                    num_cached_tokens: row.num_cached_tokens - shift,
                    block_table: &row.block_table,
                    // A scored prompt row returns every position's logits.
                    num_logit_rows: if r.score.is_some() {
                        input.len()
                    } else {
                        1 + row.num_draft_tokens
                    },
                    state: row.state_slot.map(|slot| SlotState {
                        slot,
                        state_start: row.state_start,
                        replay_until: row.replay_until,
                    }),
                },
                pick: self.picks[i],
                verified: self.verified[i].as_ref().map(|(f, d)| (*f, &d[..])),
                prior: self.prior[i].as_ref(),
            }
        });
        RankStep {
            block_size,
            rows: rows.collect(),
        }
    }

    /// Records where the launched step's rows' tokens are, for the next step's ZOS rows.
    pub fn launched(&mut self, epoch: u64, step_id: u64, prev: Vec<Option<PrevToken>>) {
        self.prev = Some((epoch, step_id, prev));
    }
}
