//! DeepSeek-V4 hyperparameters from an HF `config.json` in transformers' `DeepseekV4Config`
//! format (legacy keys folded in as transformers folds them).

use std::path::Path;

use serde_json::Value;

use crate::error::{Result, TroupeError};
use crate::model::config::{Arch, ModelConfig, RopeScaling};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKind {
    /// Sliding window only.
    Sliding,
    /// Sliding window + overlapping compressor (rate m) + lightning indexer top-k.
    CompressedSparse,
    /// Sliding window + non-overlapping compressor (rate m'), every entry visible.
    HeavilyCompressed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlpKind {
    /// Experts chosen by a frozen token → experts table.
    HashMoe,
    /// Experts chosen by the router's top-k.
    Moe,
}

pub use crate::kernels::deepseek_v4::Scoring;

/// One rotary flavour: the sliding layers' plain RoPE ("main") or the compressed
/// layers' ("compress", optionally YaRN-scaled, never with YaRN's magnitude factor).
#[derive(Debug, Clone, PartialEq)]
pub struct RopeSpec {
    pub theta: f64,
    pub yarn: Option<Yarn>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Yarn {
    pub factor: f64,
    pub original_max_position_embeddings: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
}

#[derive(Debug, Clone)]
pub struct DsV4Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub moe_intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub head_dim: usize,
    pub rope_head_dim: usize,
    pub q_lora_rank: usize,
    pub num_experts_per_tok: usize,
    pub num_routed_experts: usize,
    pub scoring: Scoring,
    pub routed_scaling_factor: f32,
    pub attention: Vec<AttentionKind>,
    pub mlp: Vec<MlpKind>,
    pub csa_rate: usize,
    pub hca_rate: usize,
    pub main_rope: RopeSpec,
    pub compress_rope: RopeSpec,
    pub hc_mult: usize,
    pub hc_sinkhorn_iters: usize,
    pub hc_eps: f32,
    pub swiglu_limit: f32,
    pub sliding_window: usize,
    pub o_groups: usize,
    pub o_lora_rank: usize,
    pub index_n_heads: usize,
    pub index_head_dim: usize,
    pub index_topk: usize,
    pub rms_norm_eps: f32,
    pub max_context_tokens: usize,
    pub eos_token_ids: Vec<u32>,
}

/// More layers than any model has (the largest have about 128).
const MAX_LAYERS: usize = 4096;

impl DsV4Config {
    /// What the request-facing engine reads of any model: vocabulary, context, layers.
    /// Attention and MLP fields describe no real DeepSeek-V4 tensor.
    pub fn generic_config(&self) -> ModelConfig {
        ModelConfig {
            arch: Arch::Llama,
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.moe_intermediate_size,
            num_layers: self.num_layers,
            num_heads: self.num_heads,
            num_kv_heads: 1,
            head_dim: self.head_dim,
            rms_norm_eps: self.rms_norm_eps,
            rope_theta: self.main_rope.theta,
            rope_scaling: RopeScaling::None,
            max_context_tokens: self.max_context_tokens,
            attention_bias: false,
            tie_word_embeddings: false,
            fp8_block: crate::model::config::FP8_BLOCK,
            mrope_section: None,
        }
    }

    /// `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| TroupeError::io(&path, e))?;
        let json: Value = serde_json::from_str(&text).map_err(|e| TroupeError::ModelFormat {
            path: path.clone(),
            reason: format!("invalid JSON: {e}"),
        })?;
        Self::from_hf_json(&path, &json)
    }

    pub fn is_deepseek_v4(config_json: &Value) -> bool {
        config_json["model_type"].as_str() == Some("deepseek_v4")
    }

    pub fn from_hf_json(path: &Path, v: &Value) -> Result<Self> {
        let bad = |reason: String| TroupeError::ModelFormat {
            path: path.to_path_buf(),
            reason,
        };
        let req = |key: &str| -> Result<usize> {
            v[key]
                .as_u64()
                .map(|x| x as usize)
                .ok_or_else(|| bad(format!("`{key}` missing or not a non-negative integer")))
        };
        let opt = |key: &str, default: usize| v[key].as_u64().map_or(default, |x| x as usize);
        let optf = |key: &str, default: f64| v[key].as_f64().unwrap_or(default);

        let num_layers = req("num_hidden_layers")?;
        // Before the per-layer lists below are built from it (found by fuzzing: a count
        // of 2^40 layers asked for a vector of that many).
        if num_layers > MAX_LAYERS {
            return Err(bad(format!(
                "num_hidden_layers {num_layers} is past any model's ({MAX_LAYERS} at most)"
            )));
        }
        let head_dim = opt("head_dim", 512);
        let rope_head_dim = match (
            v["partial_rotary_factor"].as_f64(),
            v["qk_rope_head_dim"].as_u64(),
        ) {
            (Some(f), _) => (head_dim as f64 * f) as usize,
            (None, Some(d)) => d as usize,
            (None, None) => head_dim / 8,
        };

        let mut csa_rate = 4;
        let mut hca_rate = 128;
        if let Some(rates) = v["compress_rates"].as_object() {
            for (name, rate) in rates {
                let rate = rate
                    .as_u64()
                    .ok_or_else(|| bad(format!("compress rate of `{name}` is not an integer")))?
                    as usize;
                match name.as_str() {
                    "compressed_sparse_attention" => csa_rate = rate,
                    "heavily_compressed_attention" => hca_rate = rate,
                    other => return Err(bad(format!("unknown compress rate key `{other}`"))),
                }
            }
        }
        csa_rate = opt("compress_rate_csa", csa_rate);
        hca_rate = opt("compress_rate_hca", hca_rate);

        let attention = match (v["layer_types"].as_array(), v["compress_ratios"].as_array()) {
            (Some(types), _) => types
                .iter()
                .map(|t| match t.as_str() {
                    Some("sliding_attention") => Ok(AttentionKind::Sliding),
                    Some("compressed_sparse_attention") => Ok(AttentionKind::CompressedSparse),
                    Some("heavily_compressed_attention") => Ok(AttentionKind::HeavilyCompressed),
                    _ => Err(bad(format!("unknown layer type {t}"))),
                })
                .collect::<Result<Vec<_>>>()?,
            (None, Some(ratios)) => ratios
                .iter()
                .map(|r| match r.as_u64() {
                    Some(0) => Ok(AttentionKind::Sliding),
                    Some(4) => Ok(AttentionKind::CompressedSparse),
                    Some(128) => Ok(AttentionKind::HeavilyCompressed),
                    _ => Err(bad(format!("compress ratio {r} is not 0, 4 or 128"))),
                })
                .collect::<Result<Vec<_>>>()?,
            (None, None) => (0..num_layers)
                .map(|i| match i {
                    0 | 1 => AttentionKind::HeavilyCompressed,
                    i if (i - 2) % 2 == 1 => AttentionKind::CompressedSparse,
                    _ => AttentionKind::HeavilyCompressed,
                })
                .collect(),
        };
        let mlp = match v["mlp_layer_types"].as_array() {
            Some(types) => types
                .iter()
                .map(|t| match t.as_str() {
                    Some("hash_moe") => Ok(MlpKind::HashMoe),
                    Some("moe") => Ok(MlpKind::Moe),
                    _ => Err(bad(format!("unknown MLP layer type {t}"))),
                })
                .collect::<Result<Vec<_>>>()?,
            None => {
                let hash_layers = opt("num_hash_layers", 3);
                (0..num_layers)
                    .map(|i| {
                        if i < hash_layers {
                            MlpKind::HashMoe
                        } else {
                            MlpKind::Moe
                        }
                    })
                    .collect()
            }
        };
        if attention.len() < num_layers || mlp.len() < num_layers {
            return Err(bad(format!(
                "{num_layers} layers but {} attention and {} MLP layer types",
                attention.len(),
                mlp.len()
            )));
        }

        let scoring = match v["scoring_func"].as_str().unwrap_or("sqrtsoftplus") {
            "sqrtsoftplus" => Scoring::SqrtSoftplus,
            "sigmoid" => Scoring::Sigmoid,
            "softmax" => Scoring::Softmax,
            other => return Err(bad(format!("unknown scoring_func `{other}`"))),
        };

        let rope_theta = optf("rope_theta", 10000.0);
        let compress_theta = optf("compress_rope_theta", 160000.0);
        let rp = &v["rope_parameters"];
        let (main_rope, compress_rope) = if rp["main"].is_object() && rp["compress"].is_object() {
            (
                rope_spec(&rp["main"], rope_theta, &bad)?,
                rope_spec(&rp["compress"], compress_theta, &bad)?,
            )
        } else {
            // Flat parameters (or legacy `rope_scaling`) scale the compressed branches only.
            let flat = if rp.is_object() {
                rp
            } else {
                &v["rope_scaling"]
            };
            (
                RopeSpec {
                    theta: rope_theta,
                    yarn: None,
                },
                rope_spec(flat, compress_theta, &bad)?,
            )
        };

        let eos_token_ids = match &v["eos_token_id"] {
            Value::Number(n) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
            Value::Array(a) => a
                .iter()
                .filter_map(|x| x.as_u64())
                .map(|x| x as u32)
                .collect(),
            _ => Vec::new(),
        };

        let cfg = DsV4Config {
            vocab_size: req("vocab_size")?,
            hidden_size: req("hidden_size")?,
            moe_intermediate_size: req("moe_intermediate_size")?,
            num_layers,
            num_heads: req("num_attention_heads")?,
            head_dim,
            rope_head_dim,
            q_lora_rank: req("q_lora_rank")?,
            num_experts_per_tok: req("num_experts_per_tok")?,
            num_routed_experts: req("n_routed_experts")?,
            scoring,
            routed_scaling_factor: optf("routed_scaling_factor", 1.5) as f32,
            attention: attention[..num_layers].to_vec(),
            mlp: mlp[..num_layers].to_vec(),
            csa_rate,
            hca_rate,
            main_rope,
            compress_rope,
            hc_mult: opt("hc_mult", 4),
            hc_sinkhorn_iters: opt("hc_sinkhorn_iters", 20),
            hc_eps: optf("hc_eps", 1e-6) as f32,
            swiglu_limit: optf("swiglu_limit", 10.0) as f32,
            sliding_window: opt("sliding_window", 128),
            o_groups: opt("o_groups", 8),
            o_lora_rank: opt("o_lora_rank", 1024),
            index_n_heads: opt("index_n_heads", 64),
            index_head_dim: opt("index_head_dim", 128),
            index_topk: opt("index_topk", 512),
            rms_norm_eps: optf("rms_norm_eps", 1e-6) as f32,
            max_context_tokens: opt("max_position_embeddings", 1 << 20),
            eos_token_ids,
        };
        cfg.validate().map_err(bad)?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<(), String> {
        // The config sizes what loading allocates before any tensor is read: past these
        // no model exists, only a failed allocation.
        for (name, value, limit) in [
            ("hidden_size", self.hidden_size, 1 << 20),
            ("moe_intermediate_size", self.moe_intermediate_size, 1 << 20),
            ("vocab_size", self.vocab_size, 1 << 24),
            ("num_attention_heads", self.num_heads, 4096),
            ("head_dim", self.head_dim, 4096),
            ("q_lora_rank", self.q_lora_rank, 1 << 20),
            ("o_lora_rank", self.o_lora_rank, 1 << 20),
            ("n_routed_experts", self.num_routed_experts, 1 << 16),
            ("num_experts_per_tok", self.num_experts_per_tok, 1 << 16),
            ("hc_mult", self.hc_mult, 64),
            ("hc_sinkhorn_iters", self.hc_sinkhorn_iters, 1 << 10),
            ("index_n_heads", self.index_n_heads, 4096),
            ("index_head_dim", self.index_head_dim, 4096),
            ("index_topk", self.index_topk, 1 << 24),
            ("sliding_window", self.sliding_window, 1 << 27),
            ("o_groups", self.o_groups, 4096),
            ("compress rates", self.csa_rate.max(self.hca_rate), 1 << 20),
            ("max_position_embeddings", self.max_context_tokens, 1 << 27),
        ] {
            if value > limit {
                return Err(format!(
                    "{name} {value} is past any model's ({limit} at most)"
                ));
            }
        }
        let checks = [
            (
                self.num_heads > 0 && self.head_dim > 0,
                "heads and head_dim must be positive",
            ),
            (
                self.rope_head_dim.is_multiple_of(2) && self.rope_head_dim <= self.head_dim,
                "the rotary part must be even and fit the head",
            ),
            (
                self.rope_head_dim <= self.index_head_dim
                    || !self.attention.contains(&AttentionKind::CompressedSparse),
                "the indexer head must hold the rotary part",
            ),
            (
                self.o_groups > 0 && self.num_heads.is_multiple_of(self.o_groups),
                "o_groups must divide the attention heads",
            ),
            (
                self.sliding_window >= 1,
                "sliding_window must be at least 1",
            ),
            (
                self.csa_rate >= 1 && self.hca_rate >= 1,
                "compress rates must be at least 1",
            ),
            (
                self.hc_mult >= 1 && self.hc_sinkhorn_iters >= 1,
                "hc_mult and hc_sinkhorn_iters must be at least 1",
            ),
            (
                self.num_experts_per_tok >= 1
                    && self.num_experts_per_tok <= self.num_routed_experts,
                "num_experts_per_tok must be between 1 and n_routed_experts",
            ),
        ];
        match checks.iter().find(|(ok, _)| !ok) {
            Some((_, why)) => Err(format!("invalid DeepSeek-V4 config: {why}")),
            None => Ok(()),
        }
    }

    /// Compress rate of a layer, if it compresses.
    pub fn rate(&self, layer: usize) -> Option<usize> {
        match self.attention[layer] {
            AttentionKind::Sliding => None,
            AttentionKind::CompressedSparse => Some(self.csa_rate),
            AttentionKind::HeavilyCompressed => Some(self.hca_rate),
        }
    }

    /// Source tokens per KV block must be a multiple of every compress rate in use, so a
    /// block boundary is also a window boundary.
    pub fn block_size_problem(&self, block_size: usize) -> Option<String> {
        (0..self.num_layers)
            .filter_map(|l| self.rate(l))
            .find(|r| !block_size.is_multiple_of(*r))
            .map(|r| format!("block size {block_size} is not a multiple of compress rate {r}"))
    }

    /// Tokens before a prefix-cache hit to recompute so the slot's state is exactly what
    /// a cold run leaves there (bounded replay, seed §8.3). A replay from position `s`
    /// sees no window keys before `s`, so layer `l`'s input is exact from `s + l·(W-1)` on;
    /// the ring needs layer L-1's keys of the last W-1 positions, and the CSA overlap
    /// state layer L-1's projections of the last window: L·(W-1), or (L-1)·(W-1) + m.
    /// Rounded up to whole windows of every compressor.
    pub fn num_replay_tokens(&self) -> usize {
        let (l, w) = (self.num_layers, self.sliding_window - 1);
        let csa = if self.attention.contains(&AttentionKind::CompressedSparse) {
            self.csa_rate
        } else {
            0
        };
        let tokens = (l * w).max(l.saturating_sub(1) * w + csa);
        let lcm = lcm_rates(self);
        tokens.div_ceil(lcm) * lcm
    }

    pub fn rope(&self, layer: usize) -> &RopeSpec {
        match self.attention[layer] {
            AttentionKind::Sliding => &self.main_rope,
            _ => &self.compress_rope,
        }
    }
}

fn rope_spec(
    p: &Value,
    default_theta: f64,
    bad: &dyn Fn(String) -> TroupeError,
) -> Result<RopeSpec> {
    let theta = p["rope_theta"].as_f64().unwrap_or(default_theta);
    let kind = p["rope_type"]
        .as_str()
        .or(p["type"].as_str())
        .unwrap_or("default");
    let yarn = match kind {
        "default" => None,
        "yarn" => Some(Yarn {
            factor: p["factor"]
                .as_f64()
                .ok_or_else(|| bad("yarn rope without `factor`".into()))?,
            original_max_position_embeddings: p["original_max_position_embeddings"]
                .as_f64()
                .ok_or_else(
                    || bad("yarn rope without `original_max_position_embeddings`".into()),
                )?,
            beta_fast: p["beta_fast"].as_f64().unwrap_or(32.0),
            beta_slow: p["beta_slow"].as_f64().unwrap_or(1.0),
        }),
        other => {
            return Err(bad(format!(
                "unsupported rope type `{other}` for DeepSeek-V4"
            )));
        }
    };
    Ok(RopeSpec { theta, yarn })
}

/// The least common multiple of the compress rates in use: the smallest valid block size.
pub fn lcm_rates(cfg: &DsV4Config) -> usize {
    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 { a } else { gcd(b, a % b) }
    }
    (0..cfg.num_layers)
        .filter_map(|l| cfg.rate(l))
        .fold(1, |acc, r| acc / gcd(acc, r) * r)
}
