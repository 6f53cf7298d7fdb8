//! The decode latency curve, measured by a rank worker as it starts (before the scheduler
//! plans anything, so every KV block is free to borrow): confidence-scheduled verification
//! prices K more tokens a row from what this hardware does at each batch size. On a GPU the
//! sizes are the CUDA graph buckets, so measuring also records every decode graph before
//! the first request. Kept on disk by backend, device and model shape (`CurveStore`).

use std::path::PathBuf;
use std::time::Instant;

use super::rank_step::RankStep;
use crate::model::llama::SeqStep;
use crate::sampling::SamplingParams;
use crate::sched::{PlannedRow, RowInput};
use crate::spec::{CurveError, CurveStore, LatencyCurve};
use crate::step::{RowSampling, StepRow};
use crate::sync::Shared;

/// Decode batch sizes measured (the CUDA graph buckets), up to the job's `max_rows`.
const ROW_COUNTS: [usize; 14] = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256];
/// Steps timed at each size; the median is kept. The first two at a size also warm up
/// (and on a GPU record) its graph.
const REPEATS: usize = 5;

/// What a rank worker measures at start, and where the result goes.
#[derive(Clone, Debug)]
pub struct CurveJob {
    pub store_dir: PathBuf,
    /// The model and settings the steps run with (a change measures afresh).
    pub model_key: String,
    pub max_rows: usize,
}

/// One decode step of `rows` sequences at position 0, each in its own block, greedy, each
/// row verifying `drafts` drafts (0: plain decode rows): the seconds `run_step` takes to
/// launch it and wait for its picks.
pub(super) fn time_decode_step(
    rows: usize,
    drafts: usize,
    run_step: impl FnOnce(&[SeqStep<'_>], &[StepRow]),
) -> f64 {
    let tables: Vec<[u32; 1]> = (0..rows as u32).map(|b| [b]).collect();
    let ids = vec![0u32; 1 + drafts];
    let steps: Vec<SeqStep<'_>> = tables
        .iter()
        .map(|t| SeqStep {
            token_ids: &ids,
            num_cached_tokens: 0,
            block_table: t,
            num_logit_rows: 1 + drafts,
            state: None,
        })
        .collect();
    let params = Shared::new(SamplingParams::default());
    let none: Shared<[u32]> = Shared::from(Vec::new());
    let step_rows: Vec<StepRow> = (0..rows)
        .map(|b| StepRow {
            plan: PlannedRow {
                seq_id: b as u64,
                input: RowInput::Tokens(ids.clone()),
                num_cached_tokens: 0,
                block_table: vec![b as u32],
                state_slot: None,
                state_start: 0,
                replay_until: 0,
                sample: true,
                num_draft_tokens: drafts,
            },
            sampling: Some(RowSampling {
                params: params.clone(),
                position: 1,
                prompt_ids: none.clone(),
                output_ids: Shared::new(Vec::new()),
                banned_ids: none.clone(),
                constraint: None,
                drafts: vec![0; drafts],
                stop_ids: none.clone(),
                min_tokens: 0,
                rejection: false,
            }),
            score: None,
            images: None,
        })
        .collect();
    let start = Instant::now();
    run_step(&steps, &step_rows);
    start.elapsed().as_secs_f64()
}

/// The job's curve: from the store, or measured with `time(rows, drafts)` and stored: plain
/// decode steps by rows, and steps whose rows verify one draft each (by tokens: twice the
/// rows). `device` names the hardware; `num_blocks` caps the sizes (one block a row).
pub(super) fn run(
    job: &CurveJob,
    device: &str,
    num_blocks: usize,
    mut time: impl FnMut(usize, usize) -> f64,
) -> Result<LatencyCurve, CurveError> {
    let rows: Vec<usize> = ROW_COUNTS
        .iter()
        .copied()
        .filter(|&r| r <= job.max_rows.min(num_blocks))
        .collect();
    let key = CurveStore::key(
        device,
        &job.model_key,
        &format!("{rows:?} and verify steps, graphed"),
    );
    CurveStore::new(&job.store_dir).load_or_measure(&key, || {
        let decode = LatencyCurve::measure(&rows, REPEATS, |r| time(r, 0))?;
        let verify = LatencyCurve::measure(&rows, REPEATS, |r| time(r, 1))?;
        let by_tokens = verify
            .points()
            .iter()
            .map(|&(r, secs)| (2 * r, secs))
            .collect();
        Ok(decode.with_verify(LatencyCurve::new(by_tokens)?))
    })
}

/// Records the model's graphs for steps of up to `max_tokens` tokens before the first
/// request (0: none), so no step pays for recording one (an eager step, then a captured
/// one, at each count). A step that grows a buffer the graphs use drops them all, and not
/// every buffer is largest at the largest count (attention's split partials), so one eager
/// pass over every count sizes them first (`DeviceModel::warm_up`, before, sized them for
/// a prefill). A count runs as rows of equal length, as few tokens each as a block and
/// `ROW_COUNTS`' widest batch allow, one block a row.
pub fn record_graphs(
    model: &mut dyn super::DeviceModel,
    block_size: usize,
    num_blocks: usize,
    max_tokens: usize,
) {
    let Some((counts, max_row_tokens)) = model.graph_sizes().filter(|_| max_tokens > 0) else {
        return;
    };
    let max_rows = ROW_COUNTS[ROW_COUNTS.len() - 1].min(num_blocks);
    // A step of up to `max_tokens` tokens pads to the first count that holds it.
    let largest = counts.iter().copied().find(|&t| t >= max_tokens);
    let largest = largest.or(counts.last().copied()).unwrap_or(0);
    for steps_each in [1, 2] {
        for &tokens in counts.iter().rev().filter(|&&t| t <= largest) {
            let Some(per_row) = (1..=block_size.min(max_row_tokens))
                .find(|q| tokens % q == 0 && tokens / q <= max_rows)
            else {
                continue;
            };
            for _ in 0..steps_each {
                time_decode_step(tokens / per_row, per_row - 1, |steps, sampling| {
                    let launched = model.step(&RankStep::of_tokens(block_size, steps, sampling));
                    let _ = (launched.logits)();
                });
            }
        }
    }
}

/// Measures (or loads) `job`'s curve on `model`; a failure is logged, and verification
/// then prices steps with the fitted cost model alone.
pub fn measure(
    job: &CurveJob,
    model: &mut dyn super::DeviceModel,
    block_size: usize,
    num_blocks: usize,
) -> Option<LatencyCurve> {
    let device = model.device_label();
    let curve = run(job, &device, num_blocks, |rows, drafts| {
        time_decode_step(rows, drafts, |steps, sampling| {
            let launched = model.step(&RankStep::of_tokens(block_size, steps, sampling));
            let _ = (launched.logits)();
        })
    });
    match curve {
        Ok(curve) => Some(curve),
        Err(e) => {
            tracing::warn!("decode latency curve not measured: {e}");
            None
        }
    }
}
