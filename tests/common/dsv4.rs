//! The tiny DeepSeek-V4 checkpoints' transformers references (`scripts/make_dsv4_goldens.py`):
//! prompts, every position's logits, and a greedy continuation.
#![allow(dead_code)]

use std::path::PathBuf;

use troupe::model::deepseek_v4::cache::{DsV4Cache, SlotSpan, lcm_rates};
use troupe::model::deepseek_v4::{DsSeqStep, DsV4Model};

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
