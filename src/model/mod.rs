//! Models: configuration, checkpoint loaders (GGUF, HF safetensors), tokenizer, chat
//! template and the Llama-family forward pass. No scheduling here.

pub mod chat_template;
pub mod config;
pub mod deepseek_v4;
pub mod gguf;
pub mod hf_repo;
pub mod hub;
pub mod llama;
pub mod loader;
pub mod rope;
pub mod tensor_parallel;
pub mod tokenizer;
pub mod vision;
pub mod weights;

use crate::sync::Shared as Arc;
use std::path::{Path, PathBuf};

use chat_template::ChatTemplate;
use config::ModelConfig;
use deepseek_v4::config::DsV4Config;
use gguf::GgufFile;
use llama::LlamaModel;
use loader::{GgufSource, SafetensorsSource, TensorSource};
use tokenizer::Tokenizer;
use weights::Weights;

use crate::error::{Result, TroupeError};
use crate::kernels::Backend;
use crate::model::tensor_parallel::TpShard;

/// What turns text into a model's tokens and back, and when generation stops.
pub struct ModelText {
    /// The shape every model shares (vocabulary, context, layers); for DeepSeek-V4, its
    /// generic view (`DsV4Config::generic_config`) beside the full `deepseek_v4` config.
    pub config: ModelConfig,
    /// Set for a DeepSeek-V4 checkpoint: the engine then runs `deepseek_v4::DsV4Model`.
    pub deepseek_v4: Option<Arc<DsV4Config>>,
    /// `None` for checkpoints without a tokenizer: they take and return token ids.
    pub tokenizer: Option<Arc<Tokenizer>>,
    pub chat_template: Option<ChatTemplate>,
    /// Token ids that end generation (EOS, end-of-turn).
    pub stop_ids: Vec<u32>,
    /// A vision-language model's image side (Qwen2.5-VL); `None`: text only.
    pub vision: Option<Arc<vision::VisionText>>,
}

/// A model ready to run: weights on a backend plus its text side.
pub struct LoadedModel<B: Backend> {
    pub path: PathBuf,
    pub model: LlamaModel<B>,
    pub text: ModelText,
}

/// Resolves `--model`: a known name (fetched on first use), a GGUF file or an HF directory.
pub fn resolve_model_path(spec: &str) -> Result<PathBuf> {
    let path = Path::new(spec);
    if path.exists() {
        return Ok(path.to_path_buf());
    }
    if hub::is_known(spec) {
        return hub::resolve(spec);
    }
    if let Some(repo) = hf_repo::RepoSpec::parse(spec) {
        return hf_repo::fetch(&repo).map_err(|e| match e {
            TroupeError::Fetch { name, reason } => TroupeError::Fetch {
                name,
                reason: format!("{reason} (no local file or directory `{spec}` either)"),
            },
            other => other,
        });
    }
    Err(TroupeError::InvalidInput(format!(
        "model `{spec}` is neither an existing file or directory, a hub id (org/name[@revision][:quant]) nor a known model name (`{}`)",
        hub::DEFAULT_MODEL
    )))
}

pub fn load<B: Backend>(path: &Path, backend: &B) -> Result<LoadedModel<B>> {
    load_shard(path, backend, TpShard::WHOLE)
}

/// One tensor-parallel rank's shard of the model (`TpShard::WHOLE`: all of it).
pub fn load_shard<B: Backend>(path: &Path, backend: &B, shard: TpShard) -> Result<LoadedModel<B>> {
    if path.is_dir() {
        load_hf_dir(path, backend, shard)
    } else {
        load_gguf(path, backend, shard)
    }
}

/// The model for `shard` from its full config and weights.
fn sharded_model<B: Backend>(
    cfg: &ModelConfig,
    src: &dyn TensorSource,
    backend: &B,
    shard: TpShard,
    freq_factors: Option<&[f32]>,
) -> Result<LlamaModel<B>> {
    if let Some(problem) = crate::model::tensor_parallel::tp_problem(cfg, shard.size) {
        return Err(TroupeError::InvalidInput(problem));
    }
    let weights = Weights::load(cfg, src, backend, shard)?;
    Ok(LlamaModel::new(
        cfg.sharded(shard.size),
        weights,
        backend,
        freq_factors,
    ))
}

fn load_gguf<B: Backend>(path: &Path, backend: &B, shard: TpShard) -> Result<LoadedModel<B>> {
    let gguf = GgufFile::open(path)?;
    let text = gguf_text(&gguf)?;
    let model = gguf_model(&gguf, &text.config, backend, shard)?;
    Ok(LoadedModel {
        path: path.to_path_buf(),
        model,
        text,
    })
}

fn gguf_model<B: Backend>(
    gguf: &GgufFile,
    cfg: &ModelConfig,
    backend: &B,
    shard: TpShard,
) -> Result<LlamaModel<B>> {
    let src = GgufSource {
        gguf,
        arch: cfg.arch,
        num_heads: cfg.num_heads,
        num_kv_heads: cfg.num_kv_heads,
    };
    let freq_factors = src.rope_freq_factors()?;
    sharded_model(cfg, &src, backend, shard, freq_factors.as_deref())
}

/// `load_shard`'s model without its text (tokenizer, template): a rank's load, beside an
/// engine that holds the text already. A GGUF's tokenizer built from its metadata takes
/// about 30 MB for a 49k vocabulary; built a second time during the weights' load it
/// raised peak RSS by as much. `dummy`: `load_dummy_shard`'s seeded weights.
pub fn load_shard_model<B: Backend>(
    path: &Path,
    backend: &B,
    shard: TpShard,
    dummy: bool,
) -> Result<LlamaModel<B>> {
    if dummy {
        let (cfg, _) = dummy_config(path)?;
        let src = loader::DummySource {
            config: cfg.clone(),
        };
        sharded_model(&cfg, &src, backend, shard, None)
    } else if path.is_dir() {
        let (cfg, _) = hf_config(path)?;
        let src = SafetensorsSource::open_dir(path)?;
        sharded_model(&cfg, &src, backend, shard, None)
    } else {
        let gguf = GgufFile::open(path)?;
        let cfg = ModelConfig::from_gguf(&gguf)?;
        gguf_model(&gguf, &cfg, backend, shard)
    }
}

/// Whether `path` is an HF directory holding a DeepSeek-V4 checkpoint.
/// Bytes of the weight files at `path`: the GGUF file, or a directory's `.safetensors`.
pub fn checkpoint_bytes(path: &Path) -> u64 {
    let size = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.len());
    if !path.is_dir() {
        return size(path);
    }
    std::fs::read_dir(path)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .map(|p| size(&p))
        .sum()
}

pub fn is_deepseek_v4_dir(path: &Path) -> bool {
    path.is_dir()
        && read_json(&path.join("config.json"))
            .ok()
            .flatten()
            .is_some_and(|json| DsV4Config::is_deepseek_v4(&json))
}

/// The text side of a model without its weights: cheap, for the request-facing half of
/// the engine.
pub fn load_text(path: &Path) -> Result<ModelText> {
    if path.is_dir() {
        let config_path = path.join("config.json");
        if let Some(json) = read_json(&config_path)?
            && DsV4Config::is_deepseek_v4(&json)
        {
            let ds = DsV4Config::from_hf_json(&config_path, &json)?;
            let mut text = hf_text(path, &json, ds.generic_config())?;
            text.deepseek_v4 = Some(Arc::new(ds));
            return Ok(text);
        }
        let (config, json) = hf_config(path)?;
        hf_text(path, &json, config)
    } else {
        gguf_text(&GgufFile::open(path)?)
    }
}

impl ModelText {
    /// Prompt logprobs need every position's logits: the Llama family gives them (a
    /// scored chunk runs like a verify row). DeepSeek-V4 reads a row of several logits as a
    /// verify row it may rewind, so it does not score prompts.
    pub fn scores_prompts(&self) -> bool {
        self.deepseek_v4.is_none()
    }

    /// Caps the context at `tokens` (`--max-model-len`, vLLM's): prompts and outputs past
    /// it are refused, and the KV budget is sized for it. More than the model's own
    /// context is refused by name.
    pub fn cap_context(&mut self, tokens: usize) -> Result<()> {
        let own = self.config.max_context_tokens;
        if tokens == 0 || tokens > own {
            return Err(TroupeError::InvalidInput(format!(
                "--max-model-len {tokens}: give 1 to the model's own context of {own} tokens"
            )));
        }
        self.config.max_context_tokens = tokens;
        Ok(())
    }

    /// Renders chats with `source` instead of the model's own template, given the same
    /// BOS and EOS token names.
    pub fn set_chat_template(&mut self, source: &str) -> Result<()> {
        if self.deepseek_v4.is_some() {
            return Err(TroupeError::InvalidInput(
                "DeepSeek-V4's chat prompts are DeepSeek's own encoding, not a template".into(),
            ));
        }
        let tok = self.tokenizer.as_ref().ok_or_else(|| {
            TroupeError::InvalidInput("the model has no tokenizer to render a template with".into())
        })?;
        // The names the model's own template was given (tokenizer_config's EOS, which a
        // generation config's first stop id need not be).
        let (bos, eos) = match &self.chat_template {
            Some(t) => (t.bos_token().to_string(), t.eos_token().to_string()),
            None => {
                let name =
                    |id: Option<u32>| id.and_then(|i| tok.id_to_token(i)).unwrap_or_default();
                (name(tok.bos_id), name(self.stop_ids.first().copied()))
            }
        };
        self.chat_template = Some(ChatTemplate::new(source, &bos, &eos)?);
        Ok(())
    }
}

fn gguf_text(gguf: &GgufFile) -> Result<ModelText> {
    let config = ModelConfig::from_gguf(gguf)?;
    let tokenizer = if gguf.meta("tokenizer.ggml.model").is_some() {
        Some(Arc::new(Tokenizer::from_gguf(gguf)?))
    } else {
        None
    };
    let chat_template = match (gguf.meta_str("tokenizer.chat_template"), &tokenizer) {
        (Some(src), Some(tok)) => {
            let name = |id: Option<u32>| id.and_then(|i| tok.id_to_token(i)).unwrap_or_default();
            let eos = name(
                gguf.meta_u64("tokenizer.ggml.eos_token_id")
                    .map(|v| v as u32),
            );
            Some(ChatTemplate::new(src, &name(tok.bos_id), &eos)?)
        }
        _ => None,
    };
    let stop_ids = match &tokenizer {
        Some(t) => t.stop_ids.clone(),
        None => gguf
            .meta_u64("tokenizer.ggml.eos_token_id")
            .map(|v| v as u32)
            .into_iter()
            .collect(),
    };
    Ok(ModelText {
        config,
        deepseek_v4: None,
        tokenizer,
        chat_template,
        stop_ids,
        vision: None,
    })
}

fn read_json(path: &Path) -> Result<Option<serde_json::Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| TroupeError::io(path, e))?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| TroupeError::ModelFormat {
            path: path.to_path_buf(),
            reason: format!("invalid JSON: {e}"),
        })
}

/// A special token in `tokenizer_config.json` is a string or `{"content": ...}`.
fn token_string(v: &serde_json::Value) -> Option<String> {
    v.as_str()
        .map(str::to_string)
        .or_else(|| v["content"].as_str().map(str::to_string))
}

fn hf_config(dir: &Path) -> Result<(ModelConfig, serde_json::Value)> {
    let config_path = dir.join("config.json");
    let json = read_json(&config_path)?.ok_or_else(|| TroupeError::ModelFormat {
        path: dir.to_path_buf(),
        reason: "not a model directory: no config.json".into(),
    })?;
    Ok((ModelConfig::from_hf_json(&json)?, json))
}

/// The model of an HF directory's `config.json` with seeded random weights (no checkpoint
/// is read): for benchmarks of shapes whose weights are not at hand.
pub fn load_dummy<B: Backend>(dir: &Path, backend: &B) -> Result<LoadedModel<B>> {
    load_dummy_shard(dir, backend, TpShard::WHOLE)
}

/// `load_dummy` for one tensor-parallel rank.
pub fn load_dummy_shard<B: Backend>(
    dir: &Path,
    backend: &B,
    shard: TpShard,
) -> Result<LoadedModel<B>> {
    let (cfg, json) = dummy_config(dir)?;
    let src = loader::DummySource {
        config: cfg.clone(),
    };
    let model = sharded_model(&cfg, &src, backend, shard, None)?;
    let text = hf_text(dir, &json, cfg)?;
    Ok(LoadedModel {
        path: dir.to_path_buf(),
        model,
        text,
    })
}

/// The config of a `--dummy-weights` model: an HF directory's.
fn dummy_config(dir: &Path) -> Result<(ModelConfig, serde_json::Value)> {
    if !dir.is_dir() {
        return Err(TroupeError::InvalidInput(format!(
            "--dummy-weights needs an HF model directory with a config.json; {} is not one",
            dir.display()
        )));
    }
    hf_config(dir)
}

fn load_hf_dir<B: Backend>(dir: &Path, backend: &B, shard: TpShard) -> Result<LoadedModel<B>> {
    let (cfg, json) = hf_config(dir)?;
    let src = SafetensorsSource::open_dir(dir)?;
    let model = sharded_model(&cfg, &src, backend, shard, None)?;
    let text = hf_text(dir, &json, cfg)?;
    Ok(LoadedModel {
        path: dir.to_path_buf(),
        model,
        text,
    })
}

fn hf_text(dir: &Path, config: &serde_json::Value, cfg: ModelConfig) -> Result<ModelText> {
    let tok_cfg = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or_default();
    let gen_cfg = read_json(&dir.join("generation_config.json"))?.unwrap_or_default();
    let eos_ids: Vec<u32> = [&gen_cfg["eos_token_id"], &config["eos_token_id"]]
        .iter()
        .flat_map(|v| match v {
            serde_json::Value::Array(a) => a
                .iter()
                .filter_map(|x| x.as_u64())
                .map(|x| x as u32)
                .collect(),
            v => v.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        })
        .collect();
    let bos = token_string(&tok_cfg["bos_token"]);
    let eos = token_string(&tok_cfg["eos_token"]);
    let tokenizer = if dir.join("tokenizer.json").exists() {
        let add_bos = tok_cfg["add_bos_token"].as_bool().unwrap_or(false);
        let mut tok = Tokenizer::from_hf_dir(dir, bos.as_deref(), add_bos, eos_ids.clone())?;
        if let Some(id) = eos.as_deref().and_then(|e| tok.token_to_id(e))
            && !tok.stop_ids.contains(&id)
        {
            tok.stop_ids.push(id);
        }
        Some(Arc::new(tok))
    } else {
        None
    };
    let template_src = tok_cfg["chat_template"]
        .as_str()
        .map(str::to_string)
        .or_else(|| std::fs::read_to_string(dir.join("chat_template.jinja")).ok());
    let chat_template = match template_src {
        Some(t) => Some(ChatTemplate::new(
            &t,
            bos.as_deref().unwrap_or(""),
            eos.as_deref().unwrap_or(""),
        )?),
        None => None,
    };
    let stop_ids = tokenizer.as_ref().map_or(eos_ids, |t| t.stop_ids.clone());
    let vision = vision::VisionText::from_hf_dir(dir, config)
        .map_err(|e| TroupeError::ModelFormat {
            path: dir.to_path_buf(),
            reason: e.to_string(),
        })?
        .map(Arc::new);
    Ok(ModelText {
        config: cfg,
        deepseek_v4: None,
        tokenizer,
        chat_template,
        stop_ids,
        vision,
    })
}
