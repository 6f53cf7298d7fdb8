//! Architecture-independent hyperparameters of a Llama-family model, read from a GGUF
//! header or an HF `config.json`.

use serde_json::Value;

use super::gguf::GgufFile;
use super::vision::mrope::MropeSection;
use crate::error::{Result, TroupeError};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Llama 2/3, Mistral, SmolLM2: no biases, no q/k norm.
    Llama,
    /// Qwen2 / Qwen2.5: biases on q, k, v.
    Qwen2,
    /// Qwen3: RMSNorm over each q and k head before RoPE.
    Qwen3,
}

#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    Linear {
        factor: f64,
    },
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
}

#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub max_context_tokens: usize,
    pub attention_bias: bool,
    pub tie_word_embeddings: bool,
    /// The block an FP8 checkpoint's `weight_scale_inv` grid covers (`quantization_config`'s
    /// `weight_block_size`; 128×128 where it names none).
    pub fp8_block: (usize, usize),
    /// Multimodal RoPE (Qwen2.5-VL): the frequencies each of (temporal, row, column)
    /// turns; `None`: one position a token.
    pub mrope_section: Option<MropeSection>,
}

/// Bounds no released model comes near (the largest have ~128 layers, widths of ~30k,
/// 128 heads, vocabularies of ~260k and contexts of 10M tokens).
const MAX_LAYERS: usize = 4096;
const MAX_WIDTH: usize = 1 << 20;
const MAX_HEADS: usize = 4096;
const MAX_VOCAB: usize = 1 << 24;
const MAX_CONTEXT: usize = 1 << 27;

impl ModelConfig {
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// One rank's view in a tensor-parallel group of `size`: its share of the heads and
    /// of the MLP's intermediate rows (`tensor_parallel::tp_problem` says whether they divide).
    pub fn sharded(&self, size: usize) -> ModelConfig {
        ModelConfig {
            num_heads: self.num_heads / size,
            num_kv_heads: self.num_kv_heads / size,
            intermediate_size: self.intermediate_size / size,
            ..self.clone()
        }
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(TroupeError::InvalidInput(format!("model config: {m}")));
        if self.num_heads == 0
            || self.num_kv_heads == 0
            || !self.num_heads.is_multiple_of(self.num_kv_heads)
        {
            return bad(format!(
                "{} attention heads is not a multiple of {} kv heads",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) || self.head_dim > 512 {
            return bad(format!(
                "head_dim {} must be even and at most 512",
                self.head_dim
            ));
        }
        if self.hidden_size == 0
            || self.vocab_size == 0
            || self.num_layers == 0
            || self.intermediate_size == 0
        {
            return bad("zero-sized dimension".into());
        }
        // A config is untrusted input that sizes what the loader allocates before any
        // tensor is read: past these, no model exists and only an allocation would fail.
        for (name, value, limit) in [
            ("num_hidden_layers", self.num_layers, MAX_LAYERS),
            ("hidden_size", self.hidden_size, MAX_WIDTH),
            ("intermediate_size", self.intermediate_size, MAX_WIDTH),
            ("num_attention_heads", self.num_heads, MAX_HEADS),
            ("vocab_size", self.vocab_size, MAX_VOCAB),
            (
                "max_position_embeddings",
                self.max_context_tokens,
                MAX_CONTEXT,
            ),
        ] {
            if value > limit {
                return bad(format!(
                    "{name} {value} is past any model's ({limit} at most)"
                ));
            }
        }
        Ok(())
    }

    pub fn from_gguf(gguf: &GgufFile) -> Result<Self> {
        let arch_name = gguf
            .meta_str("general.architecture")
            .ok_or_else(|| TroupeError::Gguf {
                path: gguf.path.clone(),
                reason: "missing `general.architecture`".into(),
            })?
            .to_string();
        let arch = match arch_name.as_str() {
            "llama" | "mistral" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            other => return Err(TroupeError::UnsupportedArchitecture(other.to_string())),
        };
        let key = |k: &str| format!("{arch_name}.{k}");
        let hidden_size = gguf.require_u64(&key("embedding_length"))? as usize;
        let num_heads = gguf.require_u64(&key("attention.head_count"))? as usize;
        let num_kv_heads = gguf
            .meta_u64(&key("attention.head_count_kv"))
            .unwrap_or(num_heads as u64) as usize;
        let head_dim = gguf
            .meta_u64(&key("attention.key_length"))
            .map(|v| v as usize)
            .unwrap_or(hidden_size / num_heads.max(1));
        let vocab_size = match gguf.meta_u64(&key("vocab_size")) {
            Some(v) => v as usize,
            None => gguf
                .meta("tokenizer.ggml.tokens")
                .and_then(|t| t.as_array())
                .map(|a| a.len())
                .unwrap_or(0),
        };
        let rope_scaling = match gguf.meta_str(&key("rope.scaling.type")) {
            Some("linear") => RopeScaling::Linear {
                factor: gguf.meta_f64(&key("rope.scaling.factor")).unwrap_or(1.0),
            },
            // Llama 3 GGUFs carry their scaling as a `rope_freqs` tensor, applied by the loader.
            _ => RopeScaling::None,
        };
        let has_output = gguf.tensor_info("output.weight").is_some();
        let cfg = ModelConfig {
            arch,
            vocab_size,
            hidden_size,
            intermediate_size: gguf.require_u64(&key("feed_forward_length"))? as usize,
            num_layers: gguf.require_u64(&key("block_count"))? as usize,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: gguf
                .meta_f64(&key("attention.layer_norm_rms_epsilon"))
                .unwrap_or(1e-5) as f32,
            rope_theta: gguf.meta_f64(&key("rope.freq_base")).unwrap_or(10000.0),
            rope_scaling,
            max_context_tokens: gguf.meta_u64(&key("context_length")).unwrap_or(2048) as usize,
            attention_bias: gguf.tensor_info("blk.0.attn_q.bias").is_some(),
            tie_word_embeddings: !has_output,
            fp8_block: FP8_BLOCK,
            mrope_section: None,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn from_hf_json(outer: &Value) -> Result<Self> {
        let bad = |m: String| TroupeError::InvalidInput(format!("config.json: {m}"));
        let arch_name = outer["architectures"][0]
            .as_str()
            .or_else(|| outer["model_type"].as_str())
            .ok_or_else(|| bad("no `architectures` or `model_type`".into()))?;
        // A vision-language model's language half: its `text_config` where transformers 5
        // nests it, the top level where the hub's older files keep it.
        let merged;
        let json = match outer["text_config"].as_object() {
            Some(text) => {
                let mut m = outer.as_object().cloned().unwrap_or_default();
                m.extend(text.clone());
                merged = Value::Object(m);
                &merged
            }
            None => outer,
        };
        let arch = match arch_name {
            "LlamaForCausalLM" | "MistralForCausalLM" | "llama" | "mistral" => Arch::Llama,
            "Qwen2ForCausalLM" | "qwen2" => Arch::Qwen2,
            "Qwen2_5_VLForConditionalGeneration" | "qwen2_5_vl" => Arch::Qwen2,
            "Qwen3ForCausalLM" | "qwen3" => Arch::Qwen3,
            other => return Err(TroupeError::UnsupportedArchitecture(other.to_string())),
        };
        let usize_of = |k: &str| -> Result<usize> {
            json[k]
                .as_u64()
                .map(|v| v as usize)
                .ok_or_else(|| bad(format!("missing integer `{k}`")))
        };
        let hidden_size = usize_of("hidden_size")?;
        let num_heads = usize_of("num_attention_heads")?;
        let num_kv_heads = json["num_key_value_heads"]
            .as_u64()
            .map(|v| v as usize)
            .unwrap_or(num_heads);
        let head_dim = json["head_dim"]
            .as_u64()
            .map(|v| v as usize)
            .unwrap_or(hidden_size / num_heads.max(1));
        // transformers 5 folds rope_theta and rope_scaling into `rope_parameters`.
        let rope = if json["rope_parameters"].is_object() {
            &json["rope_parameters"]
        } else {
            &json["rope_scaling"]
        };
        let rope_theta = json["rope_theta"]
            .as_f64()
            .or_else(|| rope["rope_theta"].as_f64())
            .unwrap_or(10000.0);
        let rope_type = rope["rope_type"]
            .as_str()
            .or_else(|| rope["type"].as_str())
            .unwrap_or("default");
        let f = |k: &str| rope[k].as_f64();
        let mrope_section = match rope["mrope_section"].as_array() {
            Some(s) => {
                let s: Vec<usize> = s
                    .iter()
                    .filter_map(|v| v.as_u64())
                    .map(|v| v as usize)
                    .collect();
                let [t, h, w] = s[..] else {
                    return Err(bad(format!("mrope_section {s:?} is not three sections")));
                };
                if t + h + w != head_dim / 2 {
                    return Err(bad(format!(
                        "mrope_section {s:?} does not cover the head's {} frequencies",
                        head_dim / 2
                    )));
                }
                Some(MropeSection([t, h, w]))
            }
            None => None,
        };
        let rope_scaling = match rope_type {
            // Qwen2-VL's files name M-RoPE as a scaling type; its frequencies are plain.
            "default" | "mrope" => RopeScaling::None,
            "linear" => RopeScaling::Linear {
                factor: f("factor").unwrap_or(1.0),
            },
            "llama3" => RopeScaling::Llama3 {
                factor: f("factor")
                    .ok_or_else(|| bad("llama3 rope scaling without `factor`".into()))?,
                low_freq_factor: f("low_freq_factor").unwrap_or(1.0),
                high_freq_factor: f("high_freq_factor").unwrap_or(4.0),
                original_max_position_embeddings: f("original_max_position_embeddings")
                    .unwrap_or(8192.0),
            },
            other => return Err(bad(format!("unsupported rope type `{other}`"))),
        };
        let cfg = ModelConfig {
            arch,
            vocab_size: usize_of("vocab_size")?,
            hidden_size,
            intermediate_size: usize_of("intermediate_size")?,
            num_layers: usize_of("num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: json["rms_norm_eps"].as_f64().unwrap_or(1e-6) as f32,
            rope_theta,
            rope_scaling,
            max_context_tokens: json["max_position_embeddings"].as_u64().unwrap_or(4096) as usize,
            attention_bias: arch == Arch::Qwen2
                || json["attention_bias"].as_bool().unwrap_or(false),
            tie_word_embeddings: json["tie_word_embeddings"].as_bool().unwrap_or(false),
            fp8_block: fp8_block(&json["quantization_config"]).map_err(bad)?,
            mrope_section,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

/// HF's FP8 checkpoints scale 128×128 blocks unless `weight_block_size` says otherwise.
pub const FP8_BLOCK: (usize, usize) = (128, 128);

/// The FP8 block of a checkpoint's `quantization_config`, or why troupe cannot read its
/// weights: a method other than FP8 (GPTQ, AWQ, bitsandbytes...) is refused by name rather
/// than loaded as if its integers were floats.
fn fp8_block(q: &Value) -> std::result::Result<(usize, usize), String> {
    if q.is_null() {
        return Ok(FP8_BLOCK);
    }
    let method = q["quant_method"].as_str().unwrap_or("(none)");
    match method {
        "fp8" => {
            if let Some(fmt) = q["fmt"].as_str().filter(|f| *f != "e4m3") {
                return Err(format!(
                    "quantization_config.fmt `{fmt}`: troupe reads e4m3 FP8"
                ));
            }
            match q["weight_block_size"].as_array().map(|a| a.as_slice()) {
                None => Ok(FP8_BLOCK),
                Some([r, c]) => match (r.as_u64(), c.as_u64()) {
                    (Some(r), Some(c)) if r > 0 && c > 0 => Ok((r as usize, c as usize)),
                    _ => Err(format!("quantization_config.weight_block_size {q}")),
                },
                Some(other) => Err(format!("quantization_config.weight_block_size {other:?}")),
            }
        }
        "compressed-tensors" => {
            let groups = q["config_groups"].as_object().cloned().unwrap_or_default();
            for (name, g) in &groups {
                let w = &g["weights"];
                if w["type"].as_str() != Some("float") || w["num_bits"].as_u64() != Some(8) {
                    return Err(format!(
                        "compressed-tensors group `{name}` stores {} {}-bit weights: troupe reads FP8 (float, 8 bits)",
                        w["type"].as_str().unwrap_or("?"),
                        w["num_bits"]
                    ));
                }
            }
            Ok(FP8_BLOCK)
        }
        other => Err(format!(
            "quantization method `{other}` is not supported: troupe reads FP8 checkpoints (`fp8`, compressed-tensors FP8) and GGUF files"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_configs_give_their_block_and_other_methods_are_refused_by_name() {
        let q = |v: serde_json::Value| fp8_block(&v);
        assert_eq!(q(Value::Null), Ok(FP8_BLOCK));
        let hf = serde_json::json!({"quant_method": "fp8", "weight_block_size": [64, 32]});
        assert_eq!(q(hf), Ok((64, 32)));
        let ct = serde_json::json!({"quant_method": "compressed-tensors",
            "config_groups": {"g": {"weights": {"type": "float", "num_bits": 8}}}});
        assert_eq!(q(ct), Ok(FP8_BLOCK));
        let int4 = serde_json::json!({"quant_method": "compressed-tensors",
            "config_groups": {"g": {"weights": {"type": "int", "num_bits": 4}}}});
        assert!(q(int4).unwrap_err().contains("int 4-bit"));
        for method in ["gptq", "awq", "bitsandbytes"] {
            let err = q(serde_json::json!({ "quant_method": method })).unwrap_err();
            assert!(err.contains(method), "{err}");
        }
        let e5m2 = serde_json::json!({"quant_method": "fp8", "fmt": "e5m2"});
        assert!(q(e5m2).unwrap_err().contains("e5m2"));
    }
}
