//! What a rank hands on once a step's logits are on its device, whatever the model: rows
//! without processors picked where the logits lie (greedy ones always, sampled ones where
//! the backend samples, and so every logit row of such a verify row; there also rows whose
//! only processor is a grammar, masked here), the other sampling rows' logits copied to
//! the host, and — where the backend keeps its picks — the next step's
//! inputs left on the device (ZOS without a host round trip).

use super::inputs::{PriorYield, StepInputs};
use super::{LaunchedStep, PrevToken};
use crate::eplb::MoeBalance;
use crate::kernels::collective::AbortProbe;
use crate::kernels::{Backend, DeviceMark, MovedBack, PickRow};
use crate::model::llama::SeqStep;
use crate::sched::RowInput;
use crate::step::{StepLogits, StepRow};
use crate::structured::SeqConstraint;
use rayon::prelude::*;

/// A step whose logits (`[Σ num_logit_rows, vocab]`) lie on `backend`.
pub(super) struct StepOutcome<'a, B: Backend> {
    pub backend: &'a B,
    pub logits: &'a B::Buf,
    pub vocab: usize,
    /// Per plan row, the drafts a draft model or MTP layer proposed (empty: none).
    pub model_drafts: Vec<Vec<(u32, f32)>>,
    pub moe_balance: Option<MoeBalance>,
    /// Only a group's leader copies logits to the host for the sampler.
    pub leader: bool,
    /// The next step may read this step's plain picks on the device (the rank needs no
    /// host copy of its inputs before it runs); else it gets them as host tokens.
    pub picks_stay: bool,
    /// Set when the step's collectives were aborted: its results are void.
    pub aborted: Option<AbortProbe>,
    /// The step's first work on the device's timeline.
    pub start: Option<DeviceMark>,
    /// Per row, how far the model moved it back past the plan (`MovedBack`; empty: none).
    pub moved_back: Vec<MovedBack>,
    /// The step's inputs: what each continued row's source yielded (`StepInputs::prior`).
    pub inputs: &'a StepInputs,
}

impl<B: Backend> StepOutcome<'_, B> {
    /// Launches the picks and the host rows' copy of `rows` (the plan's rows, `steps` as
    /// they ran): the picks' copy is left in flight, the host rows' waits for the step.
    pub fn launch(self, steps: &[SeqStep<'_>], rows: &[StepRow]) -> LaunchedStep {
        let sample_here = self.backend.capabilities().samples_on_device;
        let (mut picked, mut host) = (Vec::new(), Vec::new());
        // Rows the host's sampler draws: (plan row, logit rows).
        let mut sampled_by_host = Vec::new();
        let mut host_first = vec![None; rows.len()];
        let mut score_first = vec![None; rows.len()];
        let mut pick_rows = Vec::new();
        // Rows verified by their picks: (plan row, its first logit row, count).
        let mut verifying = Vec::new();
        // The first logit row of the row at hand.
        let mut row_start = 0;
        // A row continuing a verify row moved back by the drafts that row rejected; its
        // draws' positions with it: the rank knew it (the row's inputs), the model counted
        // it on the host, or only the device knows it (the sampling kernel subtracts it).
        let moved = |row: usize| self.moved_back.get(row).copied();
        let shift = |row: usize| {
            let by = match moved(row) {
                Some(MovedBack::Positions(n)) => n,
                _ => 0,
            };
            (rows[row].plan.num_cached_tokens - steps[row].num_cached_tokens + by) as u64
        };
        let on_device = |row: usize| match moved(row) {
            Some(MovedBack::OnDevice(i)) => Some(i),
            _ => None,
        };
        // A verify row's drafts as it ran: a draft model's or MTP layer's where they filled
        // its placeholders (the steps a model hands over may still hold the placeholders),
        // else its input's last tokens.
        let filled: Vec<Vec<u32>> = self
            .model_drafts
            .iter()
            .map(|d| d.iter().map(|x| x.0).collect())
            .collect();
        let drafts_of = |row: usize, count: usize| match filled.get(row) {
            Some(d) if !d.is_empty() => d.clone(),
            _ => {
                let ids = steps[row].token_ids;
                ids[ids.len() + 1 - count..].to_vec()
            }
        };
        // Grammar masks to compute (constraint, history, drafts: one mask per logit row),
        // and per pick row its job and position there.
        let (mut jobs, mut mask_of) = (Vec::new(), Vec::new());
        for (row, (s, step)) in rows
            .iter()
            .map(|r| r.sampling.as_ref())
            .zip(steps)
            .enumerate()
        {
            // The row's own logit rows: a scored row's first ones score its prompt tokens
            // (copied to the host) and its sampling rows are its last ones.
            let next_logit_row = row_start + step.num_logit_rows;
            let num_sampling_rows = match &rows[row].score {
                Some(score) => {
                    score_first[row] = Some(host.len());
                    host.extend(row_start..row_start + score.targets.len());
                    1 + rows[row].plan.num_draft_tokens
                }
                None => step.num_logit_rows,
            };
            let logit_row = next_logit_row - num_sampling_rows;
            // A row with a grammar is masked here where its history is known now.
            let history = match s {
                Some(s) if s.masked_on_device(sample_here) => self.history(row, rows),
                _ => None,
            };
            match s {
                Some(s)
                    if (s.is_plain() && (sample_here || s.params.is_greedy()))
                        || (s.drafts.is_empty() && history.is_some()) =>
                {
                    picked.push(row);
                    mask_of.push(s.constraint.as_ref().zip(history).map(|(c, h)| {
                        jobs.push((&**c, h, Vec::new()));
                        (jobs.len() - 1, 0)
                    }));
                    pick_rows.push(PickRow {
                        row: logit_row,
                        params: &s.params,
                        position: s.position - shift(row),
                        verified_row: on_device(row),
                        draft: None,
                        mask: None,
                    });
                }
                Some(s) if s.verifies_on_device(sample_here) || history.is_some() => {
                    verifying.push((row, logit_row, num_sampling_rows, history));
                }
                Some(_) => {
                    host_first[row] = Some(host.len());
                    host.extend(logit_row..logit_row + num_sampling_rows);
                    sampled_by_host.push((row, num_sampling_rows));
                }
                None => {}
            }
            row_start = next_logit_row;
        }
        // The plain rows' picks first: their indices are what the next step's embedding
        // reads on the device.
        let verifying: Vec<(usize, usize, usize)> = verifying
            .into_iter()
            .map(|(row, first, count, history)| {
                let s = rows[row]
                    .sampling
                    .as_ref()
                    .expect("a verifying row samples");
                let drafts = drafts_of(row, count);
                // Rejection acceptance decides each draft in the draw at its position (the
                // host's sampler verifies a grammar's rows by its own draw).
                let by_rejection = s.rejection && !s.params.is_greedy() && s.constraint.is_none();
                match s.constraint.as_ref().zip(history) {
                    Some((c, history)) => {
                        jobs.push((&**c, history, drafts.clone()));
                        mask_of.extend((0..count).map(|i| Some((jobs.len() - 1, i))));
                    }
                    None => mask_of.extend((0..count).map(|_| None)),
                }
                pick_rows.extend((0..count).map(|i| PickRow {
                    row: first + i,
                    params: &s.params,
                    position: s.position - shift(row) + i as u64,
                    verified_row: on_device(row),
                    draft: drafts.get(i).copied().filter(|_| by_rejection),
                    mask: None,
                }));
                (row, first, count)
            })
            .collect();
        // Each sequence's matcher is its own: the masks are computed side by side, while
        // the step's forward pass runs on the device.
        let vocab = self.vocab;
        let masks: Vec<Vec<Vec<u32>>> = jobs
            .into_par_iter()
            .map(|(c, history, drafts)| position_masks(c, history, &drafts, vocab))
            .collect();
        for (p, m) in pick_rows.iter_mut().zip(&mask_of) {
            p.mask = m.map(|(job, i)| &masks[job][i][..]);
        }
        let num_rows = rows.len();
        let mut out = StepLogits {
            moe_balance: self.moe_balance,
            picked: vec![None; num_rows],
            verify_picks: vec![None; num_rows],
            host_row: host_first,
            score_row: score_first,
            host: Vec::new(),
            model_drafts: self
                .model_drafts
                .into_iter()
                .map(|d| (!d.is_empty()).then_some(d))
                .collect(),
        };
        let picks = self.backend.pick_rows(self.logits, self.vocab, &pick_rows);
        if !host.is_empty() && self.leader {
            out.host = self.backend.download_rows(self.logits, self.vocab, &host);
        }
        let plain_rows = picked.clone();
        let verify_rows = verifying.clone();
        let aborted = self.aborted;
        let deliver = move |mut out: StepLogits, all: Vec<(u32, f32)>| {
            // The step is done on the device: if the group was aborted meanwhile, its
            // all-reduces ended without reducing (the readback thread reports the panic).
            if aborted.as_ref().is_some_and(|a| a()) {
                panic!(
                    "the step finished after its group's collectives were aborted: its results are void"
                );
            }
            let (plain, mut rest) = all.split_at(picked.len());
            for (&row, &pick) in picked.iter().zip(plain) {
                out.picked[row] = Some(pick);
            }
            for &(row, _, count) in &verifying {
                out.verify_picks[row] = Some(rest[..count].to_vec());
                rest = &rest[count..];
            }
            out
        };
        let span = self.start.zip(self.backend.timeline_mark());
        let mut prev = vec![None; num_rows];
        for &(row, count) in &sampled_by_host {
            let drafts = if count > 1 {
                drafts_of(row, count)
            } else {
                Vec::new()
            };
            prev[row] = Some(PrevToken::Sampled { drafts });
        }
        if self.picks_stay && self.backend.capabilities().picks_stay_on_device {
            for (i, &row) in plain_rows.iter().enumerate() {
                prev[row] = Some(PrevToken::Device(i as u32));
            }
            let mut first = plain_rows.len();
            for &(row, _, count) in &verify_rows {
                prev[row] = Some(PrevToken::DeviceVerified {
                    first: first as u32,
                    drafts: drafts_of(row, count),
                });
                first += count;
            }
            return LaunchedStep {
                logits: Box::new(move || deliver(out, picks())),
                span,
                prev,
            };
        }
        let all = picks();
        for (&row, pick) in plain_rows.iter().zip(&all) {
            prev[row] = Some(PrevToken::Host(pick.0));
        }
        let mut first = plain_rows.len();
        for &(row, _, count) in &verify_rows {
            let picks: Vec<u32> = all[first..first + count].iter().map(|p| p.0).collect();
            prev[row] = Some(PrevToken::HostVerified {
                drafts: drafts_of(row, count),
                picks,
            });
            first += count;
        }
        let out = deliver(out, all);
        LaunchedStep {
            logits: Box::new(move || out),
            span,
            prev,
        }
    }
}

impl<B: Backend> StepOutcome<'_, B> {
    /// The tokens a row with a grammar follows, where the rank knows them now: the
    /// scheduler's, and for a row continuing one in flight what that row yielded (its
    /// accepted drafts and the pick after them, read from the device's picks, which waits
    /// for that step alone). `None` where only the host's sampler will know: the row is
    /// masked and drawn there.
    fn history(&self, row: usize, rows: &[StepRow]) -> Option<Vec<u32>> {
        let s = rows[row].sampling.as_ref()?;
        let mut history = s.output_ids.to_vec();
        if let RowInput::FromPrevious { .. } = rows[row].plan.input {
            match self.inputs.prior(row)? {
                PriorYield::Tokens(tokens) => history.extend_from_slice(tokens),
                PriorYield::Picks { first, drafts } => {
                    let picks = self.backend.read_picks(*first as usize, drafts.len() + 1);
                    history.extend(PrevToken::yielded(drafts, &picks));
                }
            }
        }
        Some(history)
    }
}

/// A verify row's masks, one per logit row: after the history, then after each draft in
/// turn. Past a draft the grammar forbids, the row's picks are discarded (the pick there
/// differs from the draft), so the masks repeat the last one.
fn position_masks(
    constraint: &SeqConstraint,
    mut history: Vec<u32>,
    drafts: &[u32],
    vocab: usize,
) -> Vec<Vec<u32>> {
    let mut out: Vec<Vec<u32>> = vec![constraint.allowed_bits(&history, vocab)];
    for &d in drafts {
        let last = out.last().expect("one mask at least");
        let next = if crate::structured::allows(last, d) {
            history.push(d);
            constraint.allowed_bits(&history, vocab)
        } else {
            last.clone()
        };
        out.push(next);
    }
    out
}
