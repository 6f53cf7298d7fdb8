//! The Llama-family weights on a backend, loaded from any `TensorSource`.

use super::config::{Arch, ModelConfig};
use super::loader::{HostTensor, TensorSource};
use crate::error::{Result, TroupeError};
use crate::kernels::{Backend, HostMatrix};

pub struct LayerWeights<B: Backend> {
    pub attn_norm: B::Buf, // (hidden)
    pub wq: B::Matrix,     // (num_heads * head_dim, hidden)
    pub wk: B::Matrix,     // (num_kv_heads * head_dim, hidden)
    pub wv: B::Matrix,     // (num_kv_heads * head_dim, hidden)
    pub bq: Option<B::Buf>,
    pub bk: Option<B::Buf>,
    pub bv: Option<B::Buf>,
    pub q_norm: Option<B::Buf>, // (head_dim), Qwen3
    pub k_norm: Option<B::Buf>, // (head_dim), Qwen3
    pub wo: B::Matrix,          // (hidden, num_heads * head_dim)
    pub ffn_norm: B::Buf,       // (hidden)
    pub w_gate: B::Matrix,      // (intermediate, hidden)
    pub w_up: B::Matrix,        // (intermediate, hidden)
    pub w_down: B::Matrix,      // (hidden, intermediate)
}

pub struct Weights<B: Backend> {
    pub embed: B::Matrix, // (vocab, hidden)
    pub layers: Vec<LayerWeights<B>>,
    pub final_norm: B::Buf, // (hidden)
    /// `None` when the output projection is tied to `embed`.
    pub lm_head: Option<B::Matrix>, // (vocab, hidden)
}

struct Loader<'a, B: Backend> {
    src: &'a dyn TensorSource,
    backend: &'a B,
}

impl<B: Backend> Loader<'_, B> {
    fn optional(&self, name: &str, dims: &[usize]) -> Result<Option<HostTensor>> {
        let Some(t) = self.src.tensor(name)? else {
            return Ok(None);
        };
        if t.dims != dims {
            return Err(TroupeError::Tensor {
                name: name.into(),
                reason: format!("shape {:?}, expected {dims:?} from the model config", t.dims),
            });
        }
        Ok(Some(t))
    }
    fn required(&self, name: &str, dims: &[usize]) -> Result<HostTensor> {
        self.optional(name, dims)?.ok_or_else(|| TroupeError::Tensor {
            name: name.into(),
            reason: "missing from the checkpoint".into(),
        })
    }
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<B::Matrix> {
        let t = self.required(name, &[rows, cols])?;
        Ok(self.backend.upload_matrix(HostMatrix { rows, cols, data: t.data }))
    }
    fn vector(&self, name: &str, len: usize) -> Result<B::Buf> {
        Ok(self.backend.upload(&self.required(name, &[len])?.into_f32()))
    }
    fn optional_vector(&self, name: &str, len: usize) -> Result<Option<B::Buf>> {
        Ok(self.optional(name, &[len])?.map(|t| self.backend.upload(&t.into_f32())))
    }
}

impl<B: Backend> Weights<B> {
    pub fn load(cfg: &ModelConfig, src: &dyn TensorSource, backend: &B) -> Result<Self> {
        let l = Loader { src, backend };
        let (h, q, kv, ff) = (cfg.hidden_size, cfg.q_dim(), cfg.kv_dim(), cfg.intermediate_size);
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let p = format!("model.layers.{i}");
            let bias = |n: &str, len| {
                if cfg.attention_bias {
                    l.vector(&format!("{p}.self_attn.{n}.bias"), len).map(Some)
                } else {
                    Ok(None)
                }
            };
            let qk_norm = |n: &str| {
                if cfg.arch == Arch::Qwen3 {
                    l.vector(&format!("{p}.self_attn.{n}.weight"), cfg.head_dim).map(Some)
                } else {
                    l.optional_vector(&format!("{p}.self_attn.{n}.weight"), cfg.head_dim)
                }
            };
            layers.push(LayerWeights {
                attn_norm: l.vector(&format!("{p}.input_layernorm.weight"), h)?,
                wq: l.matrix(&format!("{p}.self_attn.q_proj.weight"), q, h)?,
                wk: l.matrix(&format!("{p}.self_attn.k_proj.weight"), kv, h)?,
                wv: l.matrix(&format!("{p}.self_attn.v_proj.weight"), kv, h)?,
                bq: bias("q_proj", q)?,
                bk: bias("k_proj", kv)?,
                bv: bias("v_proj", kv)?,
                q_norm: qk_norm("q_norm")?,
                k_norm: qk_norm("k_norm")?,
                wo: l.matrix(&format!("{p}.self_attn.o_proj.weight"), h, q)?,
                ffn_norm: l.vector(&format!("{p}.post_attention_layernorm.weight"), h)?,
                w_gate: l.matrix(&format!("{p}.mlp.gate_proj.weight"), ff, h)?,
                w_up: l.matrix(&format!("{p}.mlp.up_proj.weight"), ff, h)?,
                w_down: l.matrix(&format!("{p}.mlp.down_proj.weight"), h, ff)?,
            });
        }
        let lm_head = match l.optional("lm_head.weight", &[cfg.vocab_size, h])? {
            Some(t) if !cfg.tie_word_embeddings => Some(backend.upload_matrix(HostMatrix {
                rows: cfg.vocab_size,
                cols: h,
                data: t.data,
            })),
            _ => None,
        };
        Ok(Weights {
            embed: l.matrix("model.embed_tokens.weight", cfg.vocab_size, h)?,
            layers,
            final_norm: l.vector("model.norm.weight", h)?,
            lm_head,
        })
    }
}
