//! A step's tokens embedded: from the host's table, or — where the backend keeps its picks
//! on the device — from the device's, the ids of rows continuing the last step read where
//! that step picked them (ZOS with no host round trip; the hash-routed layers read the
//! same ids).

use super::plan::Plan;
use super::{DsSeqStep, DsV4Model};
use crate::kernels::NOT_PICKED;
use crate::kernels::deepseek_v4::DsV4Kernels;

/// Per step, its tokens where a picked first one was read back; the picks left to read.
type ReadBack = (Vec<Option<Vec<u32>>>, Vec<u32>);

impl<B: DsV4Kernels> DsV4Model<B> {
    /// The embedding rows of the plan's tokens into `out`, one after another; a step's
    /// first token read among the last picks where `picked_rows` says so (see
    /// `forward_on_device`), in the plan's ids too.
    pub(super) fn embed_into(
        &self,
        steps: &[DsSeqStep<'_>],
        plan: &mut Plan<B>,
        picked_rows: &[u32],
        out: &mut B::Buf,
    ) {
        let (b, d) = (&self.backend, self.cfg.hidden_size);
        let tokens = plan.num_rows();
        if !picked_rows.is_empty() {
            let mut picked = Vec::with_capacity(tokens);
            for (s, &pick) in steps.iter().zip(picked_rows) {
                picked.push(pick);
                picked.extend((1..s.token_ids.len()).map(|_| NOT_PICKED));
            }
            b.dsv4_take_picks(&mut plan.token_ids, &picked);
        }
        match &self.embed_table {
            Some(table) => b.dsv4_embed(table, d, &plan.token_ids, tokens, out),
            None => {
                assert!(
                    picked_rows.is_empty(),
                    "picks read on the device need the embedding table there"
                );
                let ids = steps.iter().flat_map(|s| s.token_ids.iter().copied());
                let rows: Vec<f32> = ids
                    .flat_map(|id| self.embedding(id).iter().copied())
                    .collect();
                b.write_floats(out, 0, &rows);
            }
        }
    }

    /// A verify row's tokens are kept for a rewind (`settle_slots`' snapshot), so one whose
    /// first token is a pick still on the device has it read back first — waiting for the
    /// last step, which only speculation with ZOS asks for. `None`: no such row; else per
    /// step its tokens where they changed, and the picks left to read on the device.
    pub(super) fn read_back_verify_picks(
        &self,
        steps: &[DsSeqStep<'_>],
        picked_rows: &[u32],
    ) -> Option<ReadBack> {
        let verify: Vec<usize> = (0..picked_rows.len())
            .filter(|&i| picked_rows[i] != NOT_PICKED && steps[i].num_logit_rows > 1)
            .collect();
        if verify.is_empty() {
            return None;
        }
        let b = &self.backend;
        let mut ids = b.upload_ids(&vec![0; verify.len()]);
        let picked: Vec<u32> = verify.iter().map(|&i| picked_rows[i]).collect();
        b.dsv4_take_picks(&mut ids, &picked);
        let firsts = b.download_ids(&ids, verify.len());
        let mut tokens = vec![None; steps.len()];
        let mut picked_rows = picked_rows.to_vec();
        for (&i, &first) in verify.iter().zip(&firsts) {
            let mut ids = steps[i].token_ids.to_vec();
            ids[0] = first;
            tokens[i] = Some(ids);
            picked_rows[i] = NOT_PICKED;
        }
        Some((tokens, picked_rows))
    }
}
