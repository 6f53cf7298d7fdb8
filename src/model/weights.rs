//! The Llama-family weights on a backend, loaded from any `TensorSource`.

use super::config::{Arch, ModelConfig};
use super::loader::{HostTensor, TensorSource};
use crate::error::{Result, TroupeError};
use crate::kernels::{Backend, HostData, HostMatrix};
use crate::model::tensor_parallel::TpShard;

pub struct LayerWeights<B: Backend> {
    pub attn_norm: B::Buf, // (hidden)
    /// q, k and v projections stacked: one matmul per layer instead of three.
    pub wqkv: B::Matrix, // (q_dim + 2 * kv_dim, hidden)
    pub bqkv: Option<B::Buf>, // (q_dim + 2 * kv_dim), Qwen2
    pub q_norm: Option<B::Buf>, // (head_dim), Qwen3
    pub k_norm: Option<B::Buf>, // (head_dim), Qwen3
    pub wo: B::Matrix,     // (hidden, num_heads * head_dim)
    pub ffn_norm: B::Buf,  // (hidden)
    /// gate and up projections stacked, rows `[gate | up]`.
    pub w_gate_up: B::Matrix, // (2 * intermediate, hidden)
    pub w_down: B::Matrix, // (hidden, intermediate)
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
    shard: TpShard,
    fp8_block: (usize, usize),
}

/// How a rank slices a `[rows, cols]` weight: column-parallel layers keep a share of the
/// output rows, row-parallel ones the matching share of the input columns.
#[derive(Clone, Copy)]
enum Split {
    Whole,
    Rows,
    Cols,
}

impl<B: Backend> Loader<'_, B> {
    fn optional(&self, name: &str, dims: &[usize]) -> Result<Option<HostTensor>> {
        let Some(t) = self.src.tensor(name)? else {
            return Ok(None);
        };
        if t.dims != dims {
            return Err(TroupeError::Tensor {
                name: name.into(),
                reason: format!(
                    "shape {:?}, expected {dims:?} from the model config",
                    t.dims
                ),
            });
        }
        Ok(Some(t))
    }
    fn required(&self, name: &str, dims: &[usize]) -> Result<HostTensor> {
        self.optional(name, dims)?
            .ok_or_else(|| TroupeError::Tensor {
                name: name.into(),
                reason: "missing from the checkpoint".into(),
            })
    }
    fn host_matrix(&self, name: &str, rows: usize, cols: usize) -> Result<HostMatrix> {
        let t = self.required(name, &[rows, cols])?;
        Ok(HostMatrix {
            rows,
            cols,
            data: self.scaled(name, t.data)?,
        })
    }
    /// An FP8 weight with its scale grid attached: `X.weight_scale_inv` (HF `fp8`, blocks)
    /// or `X.weight_scale` (compressed-tensors: per channel or per tensor).
    fn scaled(&self, name: &str, data: HostData) -> Result<HostData> {
        let HostData::Fp8(m) = data else {
            return Ok(data);
        };
        let base = name.strip_suffix(".weight").unwrap_or(name);
        let bad = |reason: String| TroupeError::Tensor {
            name: name.into(),
            reason,
        };
        let scale = match self.src.tensor(&format!("{base}.weight_scale_inv"))? {
            Some(s) => s,
            None => self
                .src
                .tensor(&format!("{base}.weight_scale"))?
                .ok_or_else(|| bad("FP8 without `weight_scale_inv` or `weight_scale`".into()))?,
        };
        let grid = match scale.dims.as_slice() {
            [] | [1] => (1, 1),
            [r] => (*r, 1),
            [r, c] => (*r, *c),
            other => return Err(bad(format!("scale grid of shape {other:?}"))),
        };
        let scales = scale.into_f32();
        Ok(HostData::Fp8(
            m.with_scales(scales, grid, self.fp8_block).map_err(bad)?,
        ))
    }
    /// This rank's part of the `[rows, cols]` tensor `name`.
    fn shard_matrix(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        split: Split,
    ) -> Result<HostMatrix> {
        let m = self.host_matrix(name, rows, cols)?;
        Ok(match split {
            Split::Whole => m,
            Split::Rows => m.sliced(self.shard.range(rows), 0..cols),
            Split::Cols => m.sliced(0..rows, self.shard.range(cols)),
        })
    }
    fn matrix(&self, name: &str, rows: usize, cols: usize, split: Split) -> Result<B::Matrix> {
        Ok(self
            .backend
            .upload_matrix(self.shard_matrix(name, rows, cols, split)?))
    }
    /// A layer projection: stored as `--quantization` asks where the checkpoint is dense.
    fn projection(&self, name: &str, rows: usize, cols: usize, split: Split) -> Result<B::Matrix> {
        let m = self.shard_matrix(name, rows, cols, split)?;
        Ok(self
            .backend
            .upload_matrix(m.quantized(self.backend.quantization())))
    }
    /// Several `[rows_i, cols]` layer projections, each cut to this rank's rows, stacked
    /// into one matrix (quantized as `--quantization` asks).
    fn stacked(&self, parts: &[(String, usize)], cols: usize) -> Result<B::Matrix> {
        let hosts = parts
            .iter()
            .map(|(name, rows)| self.shard_matrix(name, *rows, cols, Split::Rows))
            .collect::<Result<Vec<_>>>()?;
        let m = HostMatrix::concat_rows(hosts).quantized(self.backend.quantization());
        Ok(self.backend.upload_matrix(m))
    }
    fn vector(&self, name: &str, len: usize) -> Result<B::Buf> {
        Ok(self
            .backend
            .upload(&self.required(name, &[len])?.into_f32()))
    }
    fn optional_vector(&self, name: &str, len: usize) -> Result<Option<B::Buf>> {
        Ok(self
            .optional(name, &[len])?
            .map(|t| self.backend.upload(&t.into_f32())))
    }
}

/// What the weights take on the device, and what each tensor group runs in.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WeightFootprint {
    pub resident_bytes: usize,
    /// Weights a device rank keeps in host memory and computes there (DeepSeek-V4's
    /// routed experts under `--cpu-moe`): not in `resident_bytes`.
    pub host_resident_bytes: usize,
    /// Tensor group and its formats (distinct ones, in layer order, `/`-joined).
    pub groups: Vec<(&'static str, String)>,
}

impl WeightFootprint {
    /// `embed Q8_0 × q8, attn_qkv Q4_K+Q6_K × q8 / Q4_K × q8, ...`: the model card.
    pub fn card(&self) -> String {
        let groups: Vec<String> = self
            .groups
            .iter()
            .map(|(g, f)| format!("{g} {f}"))
            .collect();
        groups.join(", ")
    }
}

impl WeightFootprint {
    /// Adds tensor group `name` of `matrices`: their bytes, and their distinct formats.
    pub fn add_group<B: Backend>(
        &mut self,
        backend: &B,
        name: &'static str,
        matrices: Vec<&B::Matrix>,
    ) {
        let mut formats: Vec<String> = Vec::new();
        for m in matrices {
            let (bytes, format) = backend.matrix_footprint(m);
            self.resident_bytes += bytes;
            if !formats.contains(&format) {
                formats.push(format);
            }
        }
        if !formats.is_empty() {
            self.groups.push((name, formats.join(" / ")));
        }
    }
}

impl<B: Backend> Weights<B> {
    pub fn footprint(&self, backend: &B) -> WeightFootprint {
        let mut out = WeightFootprint::default();
        let mut group = |name, matrices| out.add_group(backend, name, matrices);
        group("embed", vec![&self.embed]);
        group("lm_head", self.lm_head.iter().collect());
        group("attn_qkv", self.layers.iter().map(|l| &l.wqkv).collect());
        group("attn_out", self.layers.iter().map(|l| &l.wo).collect());
        group(
            "ffn_gate_up",
            self.layers.iter().map(|l| &l.w_gate_up).collect(),
        );
        group("ffn_down", self.layers.iter().map(|l| &l.w_down).collect());
        out
    }
}

impl<B: Backend> Weights<B> {
    /// The weights of tensor-parallel rank `shard` of the model `cfg` describes (whole:
    /// `TpShard::WHOLE`); `cfg` is the full model's.
    pub fn load(
        cfg: &ModelConfig,
        src: &dyn TensorSource,
        backend: &B,
        shard: TpShard,
    ) -> Result<Self> {
        let l = Loader {
            src,
            backend,
            shard,
            fp8_block: cfg.fp8_block,
        };
        let (h, q, kv, ff) = (
            cfg.hidden_size,
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.intermediate_size,
        );
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let p = format!("model.layers.{i}");
            let bqkv = if cfg.attention_bias {
                let mut b = Vec::with_capacity(q + 2 * kv);
                for (n, len) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
                    let all = l
                        .required(&format!("{p}.self_attn.{n}.bias"), &[len])?
                        .into_f32();
                    b.extend_from_slice(&all[shard.range(len)]);
                }
                Some(backend.upload(&b))
            } else {
                None
            };
            let attn = |n: &str, rows| (format!("{p}.self_attn.{n}.weight"), rows);
            let mlp = |n: &str| (format!("{p}.mlp.{n}.weight"), ff);
            let qk_norm = |n: &str| {
                if cfg.arch == Arch::Qwen3 {
                    l.vector(&format!("{p}.self_attn.{n}.weight"), cfg.head_dim)
                        .map(Some)
                } else {
                    l.optional_vector(&format!("{p}.self_attn.{n}.weight"), cfg.head_dim)
                }
            };
            layers.push(LayerWeights {
                attn_norm: l.vector(&format!("{p}.input_layernorm.weight"), h)?,
                wqkv: l.stacked(
                    &[attn("q_proj", q), attn("k_proj", kv), attn("v_proj", kv)],
                    h,
                )?,
                bqkv,
                q_norm: qk_norm("q_norm")?,
                k_norm: qk_norm("k_norm")?,
                wo: l.projection(&format!("{p}.self_attn.o_proj.weight"), h, q, Split::Cols)?,
                ffn_norm: l.vector(&format!("{p}.post_attention_layernorm.weight"), h)?,
                w_gate_up: l.stacked(&[mlp("gate_proj"), mlp("up_proj")], h)?,
                w_down: l.projection(&format!("{p}.mlp.down_proj.weight"), h, ff, Split::Cols)?,
            });
        }
        let lm_head = match l.optional("lm_head.weight", &[cfg.vocab_size, h])? {
            Some(t) if !cfg.tie_word_embeddings => Some(backend.upload_matrix(HostMatrix {
                rows: cfg.vocab_size,
                cols: h,
                data: l.scaled("lm_head.weight", t.data)?,
            })),
            _ => None,
        };
        Ok(Weights {
            embed: l.matrix("model.embed_tokens.weight", cfg.vocab_size, h, Split::Whole)?,
            layers,
            final_norm: l.vector("model.norm.weight", h)?,
            lm_head,
        })
    }
}
