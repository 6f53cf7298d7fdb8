//! The tiny DeepSeek-V4 checkpoints' transformers references (`scripts/make_dsv4_goldens.py`):
//! prompts, every position's logits, and a greedy continuation.
#![allow(dead_code)]

use std::path::PathBuf;

use troupe::kernels::deepseek_v4::DsV4Kernels;
use troupe::model::deepseek_v4::cache::{DsV4Cache, SlotSpan, lcm_rates};
use troupe::model::deepseek_v4::{DsSeqStep, DsV4Model};

use super::Rng;

pub const CHECKPOINTS: [&str; 3] = ["tiny-dsv4-a", "tiny-dsv4-b", "tiny-dsv4-packed"];

pub struct Reference {
    pub prompts: Vec<Vec<u32>>,
    /// Per prompt: [positions, vocab] logits, row-major.
    pub logits: Vec<Vec<f32>>,
    pub vocab_size: usize,
    pub greedy_prompt: Vec<u32>,
    pub greedy_tokens: Vec<u32>,
}

/// Every row of `got` within `tol` of `want`'s row, relative to its largest magnitude.
pub fn assert_rows_close(
    name: &str,
    what: &str,
    got: &[f32],
    want: &[f32],
    vocab: usize,
    tol: f32,
) {
    assert_eq!(got.len(), want.len(), "{name} {what}: row count");
    for (pos, (g, w)) in got.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
        let scale = w.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let err = g
            .iter()
            .zip(w)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()))
            / scale;
        assert!(
            err <= tol,
            "{name} {what}: position {pos} relative error {err:.2e} > {tol:.0e}"
        );
    }
}

pub fn dir(name: &str) -> PathBuf {
    super::goldens().join(name)
}

pub fn reference(name: &str) -> Reference {
    let json = super::read_json(&format!("{name}/reference.json"));
    let bytes = std::fs::read(dir(name).join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut vocab_size = 0;
    let logits = json["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|key| {
            let t = st.tensor(key.as_str().unwrap()).unwrap();
            vocab_size = t.shape()[1];
            t.data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect()
        })
        .collect();
    Reference {
        prompts: json["prompts"]
            .as_array()
            .unwrap()
            .iter()
            .map(super::ids)
            .collect(),
        logits,
        vocab_size,
        greedy_prompt: super::ids(&json["greedy_prompt"]),
        greedy_tokens: super::ids(&json["greedy_tokens"]),
    }
}

impl Reference {
    /// Per prompt, per position: the argmax of the logits.
    pub fn argmax(&self) -> Vec<Vec<u32>> {
        self.logits
            .iter()
            .map(|l| {
                l.chunks(self.vocab_size)
                    .map(|row| {
                        (0..row.len())
                            .max_by(|&a, &b| row[a].total_cmp(&row[b]))
                            .unwrap() as u32
                    })
                    .collect()
            })
            .collect()
    }
}

/// The model's last-layer streams at every position of `prompt`, and its logits there.
pub fn main_streams(model: &DsV4Model, prompt: &[u32]) -> (Vec<f32>, Vec<f32>) {
    let block_size = lcm_rates(&model.cfg);
    let num_blocks = prompt.len().div_ceil(block_size);
    let mut cache = DsV4Cache::new(&model.cfg, 1, num_blocks, block_size);
    let table: Vec<u32> = (0..num_blocks as u32).collect();
    let step = DsSeqStep {
        token_ids: prompt,
        num_cached_tokens: 0,
        block_table: &table,
        state_slot: 0,
        span: SlotSpan::default(),
        num_logit_rows: prompt.len(),
    };
    let mut loads = vec![vec![0; model.cfg.num_routed_experts]; model.cfg.num_layers];
    let (logits, streams) = model
        .forward_streams(&mut cache, &[step], &mut loads, None)
        .unwrap();
    (streams, logits)
}

/// A step of the sequence in state slot 0 with a fresh history.
pub fn step<'a>(
    token_ids: &'a [u32],
    num_cached_tokens: usize,
    num_logit_rows: usize,
    block_table: &'a [u32],
) -> DsSeqStep<'a> {
    DsSeqStep {
        token_ids,
        num_cached_tokens,
        block_table,
        state_slot: 0,
        span: SlotSpan::default(),
        num_logit_rows,
    }
}

/// `scripts/make_dsv4_goldens.py`'s MTP reference of checkpoint `name`: teacher-forced
/// logits of every position, the chained drafts' logits and tokens.
pub struct MtpReference {
    pub teacher: Vec<f32>,
    pub chain: Vec<f32>,
    pub drafts: Vec<u32>,
}

pub fn mtp_reference(name: &str) -> MtpReference {
    let json = super::read_json(&format!("{name}/mtp_reference.json"));
    let bytes = std::fs::read(dir(name).join("mtp_reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let f32s = |key: &str| -> Vec<f32> {
        st.tensor(key)
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    };
    MtpReference {
        teacher: f32s("teacher"),
        chain: f32s("chain"),
        drafts: super::ids(&json["drafts"]),
    }
}

struct ScheduledSeq {
    slot: u32,
    tokens: Vec<u32>,
    cached: usize,
    target: usize,
}

const SCHEDULE_SLOTS: usize = 4;
/// Past 4 · 64 positions the CSA indexer sees more than 64 entries: a recorded step's
/// second span.
const SCHEDULE_LONGEST: usize = 300;

/// Runs one generated schedule through `eager` and `recorded` (the same weights; the
/// second's backend takes decode steps through its `StepRecorder`) and asserts every
/// step's logits and expert counts equal bit for bit: random prompts prefilled alone,
/// decode steps over random subsets of the live sequences (their rows, closing windows
/// and block tables changing from step to step), finished slots taken by new sequences,
/// one sequence long enough that the indexer's span outgrows its first size. Returns how
/// many steps were decode steps.
pub fn assert_recorded_steps_match<B: DsV4Kernels>(
    name: &str,
    eager: &DsV4Model<B>,
    recorded: &DsV4Model<B>,
    seed: u64,
) -> usize {
    let cfg = &eager.cfg;
    let vocab = cfg.vocab_size;
    let block_size = 2 * lcm_rates(cfg);
    let per_seq = SCHEDULE_LONGEST.div_ceil(block_size) + 1;
    let num_blocks = SCHEDULE_SLOTS * per_seq;
    let tables: Vec<Vec<u32>> = (0..SCHEDULE_SLOTS)
        .map(|s| {
            (0..per_seq)
                .map(|i| (num_blocks - 1 - (i * SCHEDULE_SLOTS + s)) as u32)
                .collect()
        })
        .collect();
    let mut caches = [eager, recorded].map(|m| m.new_cache(SCHEDULE_SLOTS, num_blocks, block_size));
    let mut rng = Rng(seed);
    let new_seq = |rng: &mut Rng, slot: usize, target: usize| ScheduledSeq {
        slot: slot as u32,
        tokens: (0..1 + rng.below(20))
            .map(|_| rng.below(vocab) as u32)
            .collect(),
        cached: 0,
        target,
    };
    let mut seqs: Vec<ScheduledSeq> = (0..SCHEDULE_SLOTS)
        .map(|s| {
            let target = if s == 0 {
                SCHEDULE_LONGEST
            } else {
                20 + rng.below(100)
            };
            new_seq(&mut rng, s, target)
        })
        .collect();
    let mut started = SCHEDULE_SLOTS;
    let mut decode_steps = 0;
    for step in 0.. {
        // Fresh sequences prefill alone, so that the decode steps are decode only.
        let fresh: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].cached == 0).collect();
        let chosen: Vec<usize> = if !fresh.is_empty() {
            fresh
        } else {
            let live: Vec<usize> = (0..seqs.len())
                .filter(|&i| seqs[i].cached < seqs[i].target)
                .collect();
            if live.is_empty() {
                break;
            }
            let some: Vec<usize> = live.iter().copied().filter(|_| rng.below(4) != 0).collect();
            if some.is_empty() { vec![live[0]] } else { some }
        };
        let decode = chosen.iter().all(|&i| seqs[i].cached > 0);
        for &i in &chosen {
            if seqs[i].cached > 0 {
                let t = rng.below(vocab) as u32;
                seqs[i].tokens.push(t);
            }
        }
        let ds: Vec<DsSeqStep<'_>> = chosen
            .iter()
            .map(|&i| {
                let s = &seqs[i];
                DsSeqStep {
                    token_ids: &s.tokens[s.cached..],
                    num_cached_tokens: s.cached,
                    block_table: &tables[s.slot as usize],
                    state_slot: s.slot,
                    span: SlotSpan::default(),
                    num_logit_rows: 1,
                }
            })
            .collect();
        let [ce, cr] = &mut caches;
        let mut counts = [(); 2].map(|_| vec![vec![0u64; cfg.num_routed_experts]; cfg.num_layers]);
        let want = eager.forward_counting(ce, &ds, &mut counts[0]).unwrap();
        let got = recorded.forward_counting(cr, &ds, &mut counts[1]).unwrap();
        if let Some(i) = (0..want.len()).find(|&i| want[i].to_bits() != got[i].to_bits()) {
            panic!(
                "{name} step {step} ({} rows, decode {decode}): logit {i} is {} recorded, {} eager",
                ds.len(),
                got[i],
                want[i]
            );
        }
        assert_eq!(counts[0], counts[1], "{name} step {step}: expert counts");
        decode_steps += usize::from(decode);
        for &i in &chosen {
            seqs[i].cached = seqs[i].tokens.len();
        }
        // A finished sequence's slot takes a new one, a few times.
        for seq in &mut seqs {
            if seq.cached >= seq.target && started < 2 * SCHEDULE_SLOTS {
                let target = 10 + rng.below(40);
                *seq = new_seq(&mut rng, seq.slot as usize, target);
                started += 1;
            }
        }
    }
    let [ce, cr] = &caches;
    assert!(
        !ce.holds_decode_arena(),
        "{name}: the eager model took the recorded path"
    );
    assert!(
        cr.holds_decode_arena(),
        "{name}: no step took the recorded path"
    );
    decode_steps
}

/// A pass with rounded operands against an f32 reference (the GPU's bf16 operands, the
/// host experts' 8-bit activations): they move the logits by about 1 %, and now and then
/// flip a router's or the indexer's choice, moving a position by more (0.1 measured for a
/// decode row of these tiny random models): the typical (median) position is close and
/// the argmax mostly the same.
pub fn assert_tracks(name: &str, what: &str, got: &[f32], want: &[f32], vocab: usize) {
    let mut errors: Vec<f32> = got
        .chunks(vocab)
        .zip(want.chunks(vocab))
        .map(|(g, w)| {
            let scale = w.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            g.iter()
                .zip(w)
                .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()))
                / scale
        })
        .collect();
    let agree = got
        .chunks(vocab)
        .zip(want.chunks(vocab))
        .filter(|(g, w)| row_argmax(g) == row_argmax(w))
        .count();
    errors.sort_by(f32::total_cmp);
    let (median, worst) = (errors[errors.len() / 2], errors[errors.len() - 1]);
    let positions = errors.len();
    eprintln!(
        "{name} {what}: median error {median:.2e}, worst {worst:.2e}, argmax agrees at \
         {agree}/{positions}"
    );
    assert!(
        median <= 5e-2,
        "{name} {what}: median relative error {median:.2e}"
    );
    assert!(
        agree * 20 >= positions * 17,
        "{name} {what}: argmax agrees at {agree}/{positions}"
    );
}

fn row_argmax(row: &[f32]) -> usize {
    (0..row.len())
        .max_by(|&a, &b| row[a].total_cmp(&row[b]).then(b.cmp(&a)))
        .unwrap()
}
