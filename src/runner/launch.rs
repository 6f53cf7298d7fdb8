//! What a rank hands on once a step's logits are on its device, whatever the model: rows
//! without processors picked where the logits lie (greedy ones always, sampled ones where
//! the backend samples, and so every logit row of such a verify row; there also rows whose
//! only processor is a grammar, masked here), the other sampling rows' logits copied to
//! the host, and — where the backend keeps its picks — the next step's
//! inputs left on the device (ZOS without a host round trip).

use super::rank_step::{PriorYield, RankRow, RankStep};
use super::{LaunchedStep, PrevToken};
use crate::eplb::MoeBalance;
use crate::kernels::collective::AbortProbe;
use crate::kernels::{Backend, DeviceMark, MovedBack, Pending, PickRow};
use crate::sched::RowInput;
use crate::step::StepLogits;
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
}

/// Where a step's rows' logits go (plan rows; logit rows counted over the step).
#[derive(Default)]
struct Routes {
    /// Rows picked plainly where the logits lie: (plan row, logit row, grammar history).
    plain: Vec<(usize, usize, Option<Vec<u32>>)>,
    /// Rows verified by their picks: (plan row, first logit row, count, grammar history).
    verifying: Vec<(usize, usize, usize, Option<Vec<u32>>)>,
    /// Rows the host's sampler draws: (plan row, logit rows).
    sampled_by_host: Vec<(usize, usize)>,
    /// Logit rows copied to the host; per plan row the first of its sampling rows and of
    /// its scored rows there.
    host: Vec<usize>,
    host_first: Vec<Option<usize>>,
    score_first: Vec<Option<usize>>,
}

/// A grammar's masks to compute: (constraint, history, drafts), one mask per logit row.
type MaskJob<'s> = (&'s SeqConstraint, Vec<u32>, Vec<u32>);

impl<B: Backend> StepOutcome<'_, B> {
    /// Launches the picks and the host rows' copy of `step`'s rows: the picks' copy is
    /// left in flight, the host rows' waits for the step.
    pub fn launch(self, step: &RankStep<'_>) -> LaunchedStep {
        let routes = self.route(step);
        let (mut pick_rows, jobs, mask_of) = self.pick_rows(step, &routes);
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
        let picks = self.backend.pick_rows(self.logits, self.vocab, &pick_rows);
        let host = if !routes.host.is_empty() && self.leader {
            self.backend
                .download_rows(self.logits, self.vocab, &routes.host)
        } else {
            Vec::new()
        };
        self.hand_on(step, routes, host, picks)
    }

    /// Sorts `step`'s rows by where their logits go.
    fn route(&self, step: &RankStep<'_>) -> Routes {
        let sample_here = self.backend.device_picks().is_some();
        let mut routes = Routes {
            host_first: vec![None; step.len()],
            score_first: vec![None; step.len()],
            ..Routes::default()
        };
        // The first logit row of the row at hand.
        let mut row_start = 0;
        for (row, r) in step.rows.iter().enumerate() {
            let (s, seq) = (r.row.sampling.as_ref(), &r.seq);
            // The row's own logit rows: a scored row's first ones score its prompt tokens
            // (copied to the host) and its sampling rows are its last ones.
            let next_logit_row = row_start + seq.num_logit_rows;
            let num_sampling_rows = match &r.row.score {
                Some(score) => {
                    routes.score_first[row] = Some(routes.host.len());
                    routes
                        .host
                        .extend(row_start..row_start + score.targets.len());
                    1 + r.row.plan.num_draft_tokens
                }
                None => seq.num_logit_rows,
            };
            let logit_row = next_logit_row - num_sampling_rows;
            // A row with a grammar is masked here where its history is known now.
            let history = match s {
                Some(s) if s.masked_on_device(sample_here) => self.history(r),
                _ => None,
            };
            match s {
                Some(s)
                    if (s.is_plain() && (sample_here || s.params.is_greedy()))
                        || (s.drafts.is_empty() && history.is_some()) =>
                {
                    routes.plain.push((row, logit_row, history));
                }
                Some(s) if s.verifies_on_device(sample_here) || history.is_some() => {
                    let verifying = (row, logit_row, num_sampling_rows, history);
                    routes.verifying.push(verifying);
                }
                Some(_) => {
                    routes.host_first[row] = Some(routes.host.len());
                    routes.host.extend(logit_row..logit_row + num_sampling_rows);
                    routes.sampled_by_host.push((row, num_sampling_rows));
                }
                None => {}
            }
            row_start = next_logit_row;
        }
        routes
    }

    /// The picks to make — the plain rows' first: their indices are what the next step's
    /// embedding reads on the device — with the grammar masks they need (jobs, and per
    /// pick its job and position there).
    #[allow(clippy::type_complexity)]
    fn pick_rows<'s>(
        &self,
        step: &'s RankStep<'_>,
        routes: &Routes,
    ) -> (
        Vec<PickRow<'s>>,
        Vec<MaskJob<'s>>,
        Vec<Option<(usize, usize)>>,
    ) {
        let (mut pick_rows, mut jobs, mut mask_of) = (Vec::new(), Vec::new(), Vec::new());
        let sampling = |row: usize| {
            let s = step.rows[row].row.sampling.as_ref();
            s.expect("a picked row samples")
        };
        for (row, logit_row, history) in &routes.plain {
            let s = sampling(*row);
            mask_of.push(s.constraint.as_ref().zip(history.clone()).map(|(c, h)| {
                jobs.push((&**c, h, Vec::new()));
                (jobs.len() - 1, 0)
            }));
            pick_rows.push(PickRow {
                row: *logit_row,
                params: &s.params,
                position: s.position - self.shift(step, *row),
                verified_row: self.on_device(*row),
                draft: None,
                mask: None,
            });
        }
        for (row, first, count, history) in &routes.verifying {
            let (s, row, count) = (sampling(*row), *row, *count);
            let drafts = self.drafts_of(step, row, count);
            // Rejection acceptance decides each draft in the draw at its position (the
            // host's sampler verifies a grammar's rows by its own draw).
            let by_rejection = s.rejection && !s.params.is_greedy() && s.constraint.is_none();
            match s.constraint.as_ref().zip(history.clone()) {
                Some((c, history)) => {
                    jobs.push((&**c, history, drafts.clone()));
                    mask_of.extend((0..count).map(|i| Some((jobs.len() - 1, i))));
                }
                None => mask_of.extend((0..count).map(|_| None)),
            }
            pick_rows.extend((0..count).map(|i| PickRow {
                row: first + i,
                params: &s.params,
                position: s.position - self.shift(step, row) + i as u64,
                verified_row: self.on_device(row),
                draft: drafts.get(i).copied().filter(|_| by_rejection),
                mask: None,
            }));
        }
        (pick_rows, jobs, mask_of)
    }

    /// The step's `StepLogits` (its host rows' logits in `host`, its picks once `picks`
    /// lands) and where the next step finds each row's token: on the device where the
    /// picks stay there, else on the host, which then waits for the step here.
    fn hand_on(
        mut self,
        step: &RankStep<'_>,
        routes: Routes,
        host: Vec<f32>,
        picks: Pending<Vec<(u32, f32)>>,
    ) -> LaunchedStep {
        let num_rows = step.len();
        let span = self.start.take().zip(self.backend.timeline_mark());
        // Ok: on the host now (the step waited for); Err: read when the step lands.
        let picks = if self.picks_stay && self.backend.device_picks().is_some() {
            Err(picks)
        } else {
            Ok(picks())
        };
        let prev = self.prev_tokens(step, &routes, picks.as_ref().ok().map(Vec::as_slice));
        let plain: Vec<usize> = routes.plain.iter().map(|p| p.0).collect();
        let verifying: Vec<(usize, usize)> = routes.verifying.iter().map(|v| (v.0, v.2)).collect();
        let aborted = self.aborted;
        let out = StepLogits {
            moe_balance: self.moe_balance,
            picked: vec![None; num_rows],
            verify_picks: vec![None; num_rows],
            host_row: routes.host_first,
            score_row: routes.score_first,
            host,
            model_drafts: self
                .model_drafts
                .into_iter()
                .map(|d| (!d.is_empty()).then_some(d))
                .collect(),
        };
        let deliver = move |mut out: StepLogits, all: Vec<(u32, f32)>| {
            // The step is done on the device: if the group was aborted meanwhile, its
            // all-reduces ended without reducing (the readback thread reports the panic).
            if aborted.as_ref().is_some_and(|a| a()) {
                panic!(
                    "the step finished after its group's collectives were aborted: its results are void"
                );
            }
            let (plain_picks, mut rest) = all.split_at(plain.len());
            for (&row, &pick) in plain.iter().zip(plain_picks) {
                out.picked[row] = Some(pick);
            }
            for &(row, count) in &verifying {
                out.verify_picks[row] = Some(rest[..count].to_vec());
                rest = &rest[count..];
            }
            out
        };
        let logits: Pending<StepLogits> = match picks {
            Err(later) => Box::new(move || deliver(out, later())),
            Ok(all) => {
                let out = deliver(out, all);
                Box::new(move || out)
            }
        };
        LaunchedStep { logits, span, prev }
    }

    /// Where the next step finds each row's token: the host's sampler's draw, or this
    /// step's picks — on the host where `host_picks` holds them, else on the device.
    fn prev_tokens(
        &self,
        step: &RankStep<'_>,
        routes: &Routes,
        host_picks: Option<&[(u32, f32)]>,
    ) -> Vec<Option<PrevToken>> {
        let mut prev = vec![None; step.len()];
        for &(row, count) in &routes.sampled_by_host {
            let drafts = if count > 1 {
                self.drafts_of(step, row, count)
            } else {
                Vec::new()
            };
            prev[row] = Some(PrevToken::Sampled { drafts });
        }
        for (i, &(row, ..)) in routes.plain.iter().enumerate() {
            prev[row] = Some(match host_picks {
                None => PrevToken::Device(i as u32),
                Some(all) => PrevToken::Host(all[i].0),
            });
        }
        let mut first = routes.plain.len();
        for &(row, _, count, _) in &routes.verifying {
            let drafts = self.drafts_of(step, row, count);
            prev[row] = Some(match host_picks {
                None => PrevToken::DeviceVerified {
                    first: first as u32,
                    drafts,
                },
                Some(all) => PrevToken::HostVerified {
                    drafts,
                    picks: all[first..first + count].iter().map(|p| p.0).collect(),
                },
            });
            first += count;
        }
        prev
    }

    /// How far row `row`'s draws' positions move back: a row continuing a verify row moved
    /// back by the drafts that row rejected, and its draws with it — the rank knew it (the
    /// row's inputs), the model counted it on the host, or only the device knows it (the
    /// sampling kernel subtracts it, `on_device`).
    fn shift(&self, step: &RankStep<'_>, row: usize) -> u64 {
        let by = match self.moved_back.get(row) {
            Some(MovedBack::Positions(n)) => *n,
            _ => 0,
        };
        let r = &step.rows[row];
        (r.row.plan.num_cached_tokens - r.seq.num_cached_tokens + by) as u64
    }

    fn on_device(&self, row: usize) -> Option<u32> {
        match self.moved_back.get(row) {
            Some(MovedBack::OnDevice(i)) => Some(*i),
            _ => None,
        }
    }

    /// A verify row's drafts as it ran: a draft model's or MTP layer's where they filled
    /// its placeholders (the step's rows still hold the placeholders), else its input's
    /// last tokens.
    fn drafts_of(&self, step: &RankStep<'_>, row: usize, count: usize) -> Vec<u32> {
        match self.model_drafts.get(row) {
            Some(d) if !d.is_empty() => d.iter().map(|x| x.0).collect(),
            _ => {
                let ids = step.rows[row].seq.token_ids;
                ids[ids.len() + 1 - count..].to_vec()
            }
        }
    }

    /// The tokens a row with a grammar follows, where the rank knows them now: the
    /// scheduler's, and for a row continuing one in flight what that row yielded (its
    /// accepted drafts and the pick after them, read from the device's picks, which waits
    /// for that step alone). `None` where only the host's sampler will know: the row is
    /// masked and drawn there.
    fn history(&self, row: &RankRow<'_>) -> Option<Vec<u32>> {
        let s = row.row.sampling.as_ref()?;
        let mut history = s.output_ids.to_vec();
        if let RowInput::FromPrevious { .. } = row.row.plan.input {
            match row.prior? {
                PriorYield::Tokens(tokens) => history.extend_from_slice(tokens),
                PriorYield::Picks { first, drafts } => {
                    let picks = self
                        .backend
                        .device_picks()
                        .expect("only a backend that keeps picks leaves them on the device")
                        .read_picks(*first as usize, drafts.len() + 1);
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
