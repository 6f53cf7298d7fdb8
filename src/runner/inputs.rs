//! A step's inputs on a rank: each row's tokens, or — for a row that continues the
//! previous step under ZOS — the token that step drew, found where it lies: still on the
//! device (the embedding reads the pick there), already on the host, or, for rows the
//! sampler drew on the host, waited for in `SampledTokens`. A row continuing a verify row
//! also learns there how many drafts that row rejected, and moves back by as many
//! positions (it was planned as if all were accepted) — or, where that row's picks stay
//! on the device, is handed to the model as a `VerifiedRow` and the device does both.

use super::PrevToken;
use super::sampled_tokens::SampledTokens;
use crate::kernels::{NOT_PICKED, VerifiedRow};
use crate::model::llama::{SeqStep, SlotState};
use crate::sched::RowInput;
use crate::step::Step;

/// What the row a continued row follows yielded, where the rank learns it without the
/// sampler: the tokens a grammar's mask for the continuing row follows.
#[derive(Debug, Clone, PartialEq)]
pub enum PriorYield {
    /// Known on the host.
    Tokens(Vec<u32>),
    /// Picks `first..=first + drafts.len()` on the device, against the row's `drafts`
    /// (`DeviceModel::read_picks` waits for them alone).
    Picks { first: u32, drafts: Vec<u32> },
}

/// The rank's view of the step in flight and the one before it, reused across steps.
#[derive(Default)]
pub struct StepInputs {
    /// Input ids of the current step's rows.
    inputs: Vec<Vec<u32>>,
    /// Per row of the current step: its input's index among the device's picks (empty
    /// when no row reads a pick).
    picked_rows: Vec<u32>,
    /// Per row of the current step: the positions it moves back by (drafts the row it
    /// continues rejected).
    shifts: Vec<usize>,
    /// Rows whose verify row's outcome the device applies: (row, first pick, drafts).
    verified: Vec<(usize, u32, Vec<u32>)>,
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
        let epoch = step.epoch;
        self.inputs.resize_with(step.rows.len(), Vec::new);
        self.picked_rows.clear();
        self.shifts.clear();
        self.shifts.resize(step.rows.len(), 0);
        self.verified.clear();
        self.prior.clear();
        self.prior.resize(step.rows.len(), None);
        for (i, (row, input)) in step.rows.iter().zip(self.inputs.iter_mut()).enumerate() {
            input.clear();
            let mut picked = NOT_PICKED;
            match (step.remap.source(i), &row.plan.input) {
                (None, RowInput::Tokens(ids)) => input.extend_from_slice(ids),
                (None, RowInput::FromPrevious { .. }) => {
                    unreachable!("the remap table lists every continued row")
                }
                (Some(_), RowInput::Tokens(_)) => {
                    unreachable!("the remap table lists only continued rows")
                }
                (Some(remap), RowInput::FromPrevious { drafts, .. }) => {
                    let (prev_step, prev_row) = (&remap.prev_step, &remap.prev_row);
                    let known = match &self.prev {
                        Some((e, s, prev)) if *e == epoch && s == prev_step => {
                            prev.get(*prev_row).cloned().flatten()
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
                            picked = first;
                            self.prior[i] = Some(PriorYield::Picks {
                                first,
                                drafts: Vec::new(),
                            });
                        }
                        Some(PrevToken::HostVerified { drafts, picks }) => {
                            let drawn = PrevToken::verified(&drafts, &picks);
                            input.push(drawn.token);
                            self.shifts[i] = drawn.num_rejected as usize;
                            self.prior[i] =
                                Some(PriorYield::Tokens(PrevToken::yielded(&drafts, &picks)));
                        }
                        Some(PrevToken::DeviceVerified {
                            first,
                            drafts: verified,
                        }) if verifies_on_device => {
                            // A placeholder: the device verifies the drafts against its
                            // picks and moves the row back (`VerifiedRow`), a seeded row's
                            // draws with it (`MovedBack::OnDevice`).
                            input.push(0);
                            picked = first;
                            self.prior[i] = Some(PriorYield::Picks {
                                first,
                                drafts: verified.clone(),
                            });
                            self.verified.push((i, first, verified));
                        }
                        Some(PrevToken::DeviceVerified {
                            first,
                            drafts: verified,
                        }) => {
                            // The verify row's picks, read once the device made them: no
                            // wait for the readback thread and the sampler.
                            let picks = read_picks(first, verified.len() + 1);
                            let drawn = PrevToken::verified(&verified, &picks);
                            input.push(drawn.token);
                            self.shifts[i] = drawn.num_rejected as usize;
                            self.prior[i] =
                                Some(PriorYield::Tokens(PrevToken::yielded(&verified, &picks)));
                        }
                        sampled_by_host => {
                            tracing::debug!(
                                rank,
                                step = step.step_id,
                                prev_step,
                                prev_row,
                                "waiting for a sampled token"
                            );
                            match sampled.wait(epoch, *prev_step, *prev_row) {
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
                                None if in_group => input.push(0),
                                None => return false,
                            }
                        }
                    }
                    input.extend_from_slice(drafts);
                }
            }
            self.picked_rows.push(picked);
        }
        if self.picked_rows.iter().all(|&p| p == NOT_PICKED) {
            self.picked_rows.clear();
        }
        true
    }

    /// The resolved rows as the model runs them.
    pub fn seq_steps<'a>(&'a self, step: &'a Step) -> Vec<SeqStep<'a>> {
        step.rows
            .iter()
            .zip(&self.inputs)
            .zip(&self.shifts)
            .map(|((r, input), &shift)| (&r.plan, r.score.is_some(), input, shift))
            .map(|(row, scored, input, shift)| SeqStep {
                token_ids: input,
                num_cached_tokens: row.num_cached_tokens - shift,
                block_table: &row.block_table,
                // A scored prompt row returns every position's logits.
                num_logit_rows: if scored {
                    input.len()
                } else {
                    1 + row.num_draft_tokens
                },
                state: row.state_slot.map(|slot| SlotState {
                    slot,
                    state_start: row.state_start,
                    replay_until: row.replay_until,
                }),
            })
            .collect()
    }

    pub fn picked_rows(&self) -> &[u32] {
        &self.picked_rows
    }

    pub fn verified_rows(&self) -> Vec<VerifiedRow<'_>> {
        self.verified
            .iter()
            .map(|(row, first, drafts)| VerifiedRow {
                row: *row,
                first_pick: *first,
                drafts,
            })
            .collect()
    }

    /// What the row that row `row` continues yielded, where the rank knows it without the
    /// sampler (`None` for a row of its own tokens, and for one whose source the host's
    /// sampler drew).
    pub fn prior(&self, row: usize) -> Option<&PriorYield> {
        self.prior.get(row)?.as_ref()
    }

    /// Records where the launched step's rows' tokens are, for the next step's ZOS rows.
    pub fn launched(&mut self, epoch: u64, step_id: u64, prev: Vec<Option<PrevToken>>) {
        self.prev = Some((epoch, step_id, prev));
    }
}
