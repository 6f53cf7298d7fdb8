//! DeepSeek-V4 with routed experts in host memory: the differential cases, generated
//! placements, and a model's logits on any backend.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use troupe::kernels::deepseek_v4::DsV4Kernels;
use troupe::model::deepseek_v4::cache::{DsV4Cache, SlotSpan, lcm_rates};
use troupe::model::deepseek_v4::config::DsV4Config;
use troupe::model::deepseek_v4::expert_placement::ExpertPlacement;
use troupe::model::deepseek_v4::expert_streaming::StreamExperts;
use troupe::model::deepseek_v4::{DsSeqStep, DsV4Model};
use troupe::sampling::splitmix64;

pub fn case_dirs() -> Vec<PathBuf> {
    let root = std::env::var_os("TROUPE_DSV4_CASES")
        .map(PathBuf::from)
        .unwrap_or_else(|| super::goldens().join("dsv4-diff"));
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("case.json").exists())
        .collect();
    dirs.sort();
    assert!(!dirs.is_empty(), "no cases under {}", root.display());
    dirs
}

/// Every expert on the host, the first layers' (`--n-cpu-moe`), and a generated count per
/// layer (split layers included).
pub fn placements(cfg: &DsV4Config, seed: u64) -> Vec<(String, ExpertPlacement)> {
    let (l, e) = (cfg.num_layers, cfg.num_routed_experts);
    let first = (splitmix64(seed) as usize) % l + 1;
    let per_layer: Vec<usize> = (0..l)
        .map(|i| (splitmix64(seed ^ ((i as u64 + 1) * 0x9e37)) as usize) % (e + 1))
        .collect();
    let mut out = vec![
        ("--cpu-moe".to_string(), first_layers(l, e, l)),
        (format!("--n-cpu-moe {first}"), first_layers(l, e, first)),
    ];
    out.push((
        format!("host experts per layer {per_layer:?}"),
        ExpertPlacement::new(per_layer, e),
    ));
    out
}

pub fn first_layers(l: usize, e: usize, n: usize) -> ExpertPlacement {
    ExpertPlacement::new((0..l).map(|i| if i < n { e } else { 0 }).collect(), e)
}

/// `dir`'s model on `backend` with `placement`'s experts in host memory (none held on
/// the device); `invariant`: the host computes in the batch-invariant mode.
pub fn with_host_experts<B: DsV4Kernels>(
    backend: B,
    dir: &Path,
    placement: ExpertPlacement,
    invariant: bool,
) -> DsV4Model<B> {
    streaming(backend, dir, placement, (invariant, StreamExperts::Never)).unwrap()
}

/// `with_host_experts` with `--stream-experts`' mode `stream`, or why it was refused.
pub fn streaming<B: DsV4Kernels>(
    backend: B,
    dir: &Path,
    placement: ExpertPlacement,
    (invariant, stream): (bool, StreamExperts),
) -> troupe::error::Result<DsV4Model<B>> {
    let holds = |l: usize, e: usize| !placement.on_host(l, e);
    let mut model = DsV4Model::load_dir_holding(backend, dir, false, &holds)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    model.keep_experts_on_host(dir, false, placement, (invariant, stream))?;
    Ok(model)
}

/// Every position's logits of `tokens`, fed in chunks of `chunk`.
pub fn logits<B: DsV4Kernels>(model: &DsV4Model<B>, tokens: &[u32], chunk: usize) -> Vec<f32> {
    let block_size = 2 * lcm_rates(&model.cfg);
    let num_blocks = tokens.len().div_ceil(block_size) + 1;
    let table: Vec<u32> = (0..num_blocks as u32).rev().collect();
    let mut cache = DsV4Cache::on(&model.backend, &model.cfg, 1, num_blocks, block_size);
    let mut out = Vec::new();
    for start in (0..tokens.len()).step_by(chunk) {
        let n = chunk.min(tokens.len() - start);
        let step = DsSeqStep {
            token_ids: &tokens[start..start + n],
            num_cached_tokens: start,
            block_table: &table,
            state_slot: 0,
            span: SlotSpan::default(),
            num_logit_rows: n,
        };
        out.extend(model.forward(&mut cache, &[step]).unwrap());
    }
    out
}

pub fn argmax_rows(logits: &[f32], vocab: usize) -> Vec<u32> {
    logits
        .chunks(vocab)
        .map(|r| (0..vocab).max_by(|&a, &b| r[a].total_cmp(&r[b])).unwrap() as u32)
        .collect()
}

pub fn case(dir: &Path) -> (Vec<u32>, Vec<u32>) {
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("case.json")).unwrap()).unwrap();
    (
        super::ids(&json["prompt"]),
        super::ids(&json["greedy_tokens"]),
    )
}

/// `prompts` decoded together: each prompt fed whole into its own state slot, then
/// `steps` steps of one token a sequence (the tokens generated from `seed`). Returns every
/// decode step's logits, step by step, and the tokens per `[layer][expert]` counted.
pub fn batch_decode<B: DsV4Kernels>(
    model: &DsV4Model<B>,
    prompts: &[Vec<u32>],
    steps: usize,
    seed: u64,
) -> (Vec<f32>, Vec<Vec<u64>>) {
    let block_size = 2 * lcm_rates(&model.cfg);
    let n = prompts.len();
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0) + steps;
    let per_seq = longest.div_ceil(block_size) + 1;
    let mut cache = DsV4Cache::on(&model.backend, &model.cfg, n, n * per_seq, block_size);
    let tables: Vec<Vec<u32>> = (0..n)
        .map(|i| {
            ((i * per_seq) as u32..((i + 1) * per_seq) as u32)
                .rev()
                .collect()
        })
        .collect();
    let mut counts = vec![vec![0; model.cfg.num_routed_experts]; model.cfg.num_layers];
    fn step<'a>(table: &'a [u32], i: usize, tokens: &'a [u32], cached: usize) -> DsSeqStep<'a> {
        DsSeqStep {
            token_ids: tokens,
            num_cached_tokens: cached,
            block_table: table,
            state_slot: i as u32,
            span: SlotSpan::default(),
            num_logit_rows: 1,
        }
    }
    for (i, p) in prompts.iter().enumerate() {
        model
            .forward(&mut cache, &[step(&tables[i], i, p, 0)])
            .unwrap();
    }
    let vocab = model.vocab_size() as u64;
    let mut out = Vec::new();
    for s in 0..steps {
        let tokens: Vec<u32> = (0..n)
            .map(|i| (splitmix64(seed ^ (((s * n + i) as u64 + 1) * 0x9e37)) % vocab) as u32)
            .collect();
        let batch: Vec<DsSeqStep<'_>> = (0..n)
            .map(|i| step(&tables[i], i, &tokens[i..i + 1], prompts[i].len() + s))
            .collect();
        out.extend(
            model
                .forward_counting(&mut cache, &batch, &mut counts)
                .unwrap(),
        );
    }
    (out, counts)
}
