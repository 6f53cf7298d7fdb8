//! What a rank hands on once a step's logits are on its device, whatever the model: rows
//! without processors picked where the logits lie (greedy ones always, sampled ones where
//! the backend samples, and so every logit row of such a verify row), the other sampling rows'
//! logits copied to the host, and — where the backend keeps its picks — the next step's
//! inputs left on the device (ZOS without a host round trip).

use super::{LaunchedStep, PrevToken};
use crate::eplb::MoeBalance;
use crate::kernels::collective::AbortProbe;
use crate::kernels::{Backend, DeviceMark, MovedBack, PickRow};
use crate::model::llama::SeqStep;
use crate::step::{StepLogits, StepRow};

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

impl<B: Backend> StepOutcome<'_, B> {
    /// Launches the picks and the host rows' copy of `rows` (the plan's rows, `steps` as
    /// they ran): the picks' copy is left in flight, the host rows' waits for the step.
    pub fn launch(self, steps: &[SeqStep<'_>], rows: &[StepRow]) -> LaunchedStep {
        let sample_here = self.backend.capabilities().samples_on_device;
        let (mut picked, mut host) = (Vec::new(), Vec::new());
        let mut host_first = vec![None; rows.len()];
        let mut pick_rows = Vec::new();
        // Rows verified by their picks: (plan row, its first logit row, count).
        let mut verifying = Vec::new();
        let mut logit_row = 0;
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
        for (row, (s, step)) in rows
            .iter()
            .map(|r| r.sampling.as_ref())
            .zip(steps)
            .enumerate()
        {
            match s {
                Some(s) if s.is_plain() && (sample_here || s.params.is_greedy()) => {
                    picked.push(row);
                    pick_rows.push(PickRow {
                        row: logit_row,
                        params: &s.params,
                        position: s.position - shift(row),
                        verified_row: on_device(row),
                        draft: None,
                    });
                }
                Some(s) if s.verifies_on_device(sample_here) => {
                    verifying.push((row, logit_row, step.num_logit_rows));
                }
                Some(_) => {
                    host_first[row] = Some(host.len());
                    host.extend(logit_row..logit_row + step.num_logit_rows);
                }
                None => {}
            }
            logit_row += step.num_logit_rows;
        }
        // The plain rows' picks first: their indices are what the next step's embedding
        // reads on the device.
        for &(row, first, count) in &verifying {
            let s = rows[row]
                .sampling
                .as_ref()
                .expect("a verifying row samples");
            // Rejection acceptance decides each draft in the draw at its position.
            let by_rejection = s.rejection && !s.params.is_greedy();
            pick_rows.extend((0..count).map(|i| PickRow {
                row: first + i,
                params: &s.params,
                position: s.position - shift(row) + i as u64,
                verified_row: on_device(row),
                draft: s.drafts.get(i).copied().filter(|_| by_rejection),
            }));
        }
        let num_rows = rows.len();
        let mut out = StepLogits {
            moe_balance: self.moe_balance,
            picked: vec![None; num_rows],
            verify_picks: vec![None; num_rows],
            host_row: host_first,
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
        // A verify row's drafts as it ran (a draft model's filled in): its input's last.
        let drafts_of = |row: usize, count: usize| {
            let ids = steps[row].token_ids;
            ids[ids.len() + 1 - count..].to_vec()
        };
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
            prev[row] = Some(PrevToken::HostVerified(PrevToken::verified(
                &drafts_of(row, count),
                &picks,
            )));
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
