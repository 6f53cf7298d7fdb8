//! DeepSeek-V4 tensors by DeepSeek's own names (what transformers' `save_pretrained` and
//! the released checkpoints write), as f32 on the host.

use super::config::{AttentionKind, DsV4Config, MlpKind};
use super::ops::Linear;
use crate::error::{Result, TroupeError};
use crate::model::loader::TensorSource;

pub struct Compressor {
    pub kv: Linear,
    pub gate: Linear,
    /// `[rate, width]`: added to the gate logits by position inside the window.
    pub position_bias: Vec<f32>,
    pub norm: Vec<f32>,
}

pub struct Indexer {
    pub compressor: Compressor,
    pub q_b: Linear,
    pub weights_proj: Linear,
}

pub struct Attention {
    pub q_a: Linear,
    pub q_a_norm: Vec<f32>,
    pub q_b: Linear,
    pub kv: Linear,
    pub kv_norm: Vec<f32>,
    /// `[groups · o_lora_rank, heads · head_dim / groups]`: group g owns rows g·r..(g+1)·r.
    pub o_a: Linear,
    pub o_b: Linear,
    pub sinks: Vec<f32>,
    pub compressor: Option<Compressor>,
    pub indexer: Option<Indexer>,
}

/// One mHC mapping: `fn` `[(2 + n)·n, n·hidden]`, `base` `[(2 + n)·n]`, `scale` `[3]`.
pub struct HyperConnection {
    pub fn_: Linear,
    pub base: Vec<f32>,
    pub scale: Vec<f32>,
}

pub struct Expert {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

pub struct Moe {
    pub router: Linear,
    /// `[vocab, k]` expert ids (hash layers).
    pub tid2eid: Option<Vec<u32>>,
    pub score_bias: Option<Vec<f32>>,
    pub experts: Vec<Expert>,
    pub shared: Expert,
}

pub struct Layer {
    pub attn_norm: Vec<f32>,
    pub ffn_norm: Vec<f32>,
    pub attn_hc: HyperConnection,
    pub ffn_hc: HyperConnection,
    pub attn: Attention,
    pub moe: Moe,
}

/// DeepSeek's `MTPBlock` (`mtp.0.*`): a sliding-window, score-routed block fed with
/// `e_proj(enorm(embedding of the next token)) + h_proj(hnorm(streams))`, and its own
/// hyper-head and norm before the model's head.
pub struct MtpWeights {
    pub e_proj: Linear,
    pub h_proj: Linear,
    pub enorm: Vec<f32>,
    pub hnorm: Vec<f32>,
    pub norm: Vec<f32>,
    pub hc_head: HyperConnection,
    pub block: Layer,
}

impl MtpWeights {
    pub fn load(cfg: &DsV4Config, src: &dyn TensorSource) -> Result<Self> {
        Self::read(
            cfg,
            Reader {
                src,
                dummy_experts: None,
            },
        )
    }

    pub fn dummy(cfg: &DsV4Config) -> Result<Self> {
        Self::read(
            cfg,
            Reader {
                src: &NoTensors,
                dummy_experts: Some(cfg.num_routed_experts),
            },
        )
    }

    fn read(cfg: &DsV4Config, r: Reader<'_>) -> Result<Self> {
        let d = cfg.hidden_size;
        Ok(MtpWeights {
            e_proj: r.linear("mtp.0.e_proj", d, d)?,
            h_proj: r.linear("mtp.0.h_proj", d, d)?,
            enorm: r.vector("mtp.0.enorm.weight", d)?,
            hnorm: r.vector("mtp.0.hnorm.weight", d)?,
            norm: r.vector("mtp.0.norm.weight", d)?,
            hc_head: r.hc("mtp.0.hc_head", cfg, cfg.hc_mult, 1)?,
            block: r.layer(cfg, "mtp.0", AttentionKind::Sliding, MlpKind::Moe)?,
        })
    }
}

pub struct DsV4Weights {
    pub embed: Vec<f32>,
    pub layers: Vec<Layer>,
    pub hc_head: HyperConnection,
    pub norm: Vec<f32>,
    pub head: Linear,
}

struct Reader<'a> {
    src: &'a dyn TensorSource,
    /// `--dummy-weights`: every tensor made from its name and shape (the number of
    /// routed experts, for a valid hash table); nothing is read.
    dummy_experts: Option<usize>,
}

/// Seeded values for a tensor of `dims` named `name`: norms and scales around 1, biases,
/// sinks and position biases 0, projections uniform with std 0.02 (transformers' init);
/// hash tables route token t to experts 7t, 7t+1, … (mod the expert count).
fn dummy_values(name: &str, dims: &[usize], num_experts: usize) -> Vec<f32> {
    let n: usize = dims.iter().product();
    if name.ends_with("tid2eid") {
        let k = dims[1];
        return (0..n)
            .map(|i| ((i / k * 7 + i % k) % num_experts) as f32)
            .collect();
    }
    let seed = name
        .bytes()
        .fold(0x5eed_u64, |h, b| crate::sampling::splitmix64(h ^ b as u64));
    let (mean, half_width) = if name.ends_with("norm.weight") || name.ends_with("_scale") {
        (1.0, 0.05)
    } else if name.ends_with("_base") || name.ends_with("attn_sink") || name.ends_with(".ape") {
        (0.0, 0.0)
    } else {
        (0.0, 0.02 * 3f32.sqrt())
    };
    (0..n as u64)
        .map(|i| crate::kernels::random_weight(seed, i, mean, half_width))
        .collect()
}

/// A source with nothing in it (what `--dummy-weights` reads).
struct NoTensors;

impl TensorSource for NoTensors {
    fn tensor(&self, _name: &str) -> Result<Option<crate::model::loader::HostTensor>> {
        Ok(None)
    }
}

impl Reader<'_> {
    fn raw(&self, name: &str, dims: &[usize]) -> Result<Vec<f32>> {
        if let Some(experts) = self.dummy_experts {
            return Ok(dummy_values(name, dims, experts));
        }
        let t = self.src.tensor(name)?.ok_or_else(|| TroupeError::Tensor {
            name: name.to_string(),
            reason: "missing from the checkpoint".into(),
        })?;
        if t.dims != dims {
            return Err(TroupeError::Tensor {
                name: name.to_string(),
                reason: format!("shape {:?}, expected {dims:?}", t.dims),
            });
        }
        Ok(t.into_f32())
    }

    fn linear(&self, name: &str, rows: usize, cols: usize) -> Result<Linear> {
        if self.dummy_experts.is_some() {
            let w = self.raw(&format!("{name}.weight"), &[rows, cols])?;
            return Ok(Linear { rows, cols, w });
        }
        super::quantized::linear(self.src, name, rows, cols)
    }

    fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>> {
        self.raw(name, &[n])
    }

    fn compressor(
        &self,
        p: &str,
        cfg: &DsV4Config,
        width: usize,
        dim: usize,
        rate: usize,
    ) -> Result<Compressor> {
        Ok(Compressor {
            kv: self.linear(&format!("{p}.wkv"), width, cfg.hidden_size)?,
            gate: self.linear(&format!("{p}.wgate"), width, cfg.hidden_size)?,
            position_bias: self.raw(&format!("{p}.ape"), &[rate, width])?,
            norm: self.vector(&format!("{p}.norm.weight"), dim)?,
        })
    }

    fn hc(
        &self,
        p: &str,
        cfg: &DsV4Config,
        outputs: usize,
        scales: usize,
    ) -> Result<HyperConnection> {
        let n = cfg.hc_mult;
        Ok(HyperConnection {
            fn_: Linear {
                rows: outputs,
                cols: n * cfg.hidden_size,
                w: self.raw(&format!("{p}_fn"), &[outputs, n * cfg.hidden_size])?,
            },
            base: self.vector(&format!("{p}_base"), outputs)?,
            scale: self.vector(&format!("{p}_scale"), scales)?,
        })
    }

    fn expert(&self, p: &str, cfg: &DsV4Config) -> Result<Expert> {
        let (d, i) = (cfg.hidden_size, cfg.moe_intermediate_size);
        Ok(Expert {
            gate: self.linear(&format!("{p}.w1"), i, d)?,
            up: self.linear(&format!("{p}.w3"), i, d)?,
            down: self.linear(&format!("{p}.w2"), d, i)?,
        })
    }

    /// One block: attention of `attention`'s kind, an MLP of `mlp`'s, under prefix `p`
    /// (`model.layers.N`, or `mtp.0` for the MTP layer's block).
    fn layer(
        &self,
        cfg: &DsV4Config,
        p: &str,
        attention: AttentionKind,
        mlp: MlpKind,
    ) -> Result<Layer> {
        let r = self;
        let src = r.src;
        let d = cfg.hidden_size;
        let n = cfg.hc_mult;
        let hd = cfg.head_dim;
        let heads = cfg.num_heads;
        let (compressor, indexer) = match attention {
            AttentionKind::Sliding => (None, None),
            AttentionKind::HeavilyCompressed => (
                Some(r.compressor(&format!("{p}.attn.compressor"), cfg, hd, hd, cfg.hca_rate)?),
                None,
            ),
            AttentionKind::CompressedSparse => {
                let ihd = cfg.index_head_dim;
                let indexer = Indexer {
                    compressor: r.compressor(
                        &format!("{p}.attn.indexer.compressor"),
                        cfg,
                        2 * ihd,
                        ihd,
                        cfg.csa_rate,
                    )?,
                    q_b: r.linear(
                        &format!("{p}.attn.indexer.wq_b"),
                        cfg.index_n_heads * ihd,
                        cfg.q_lora_rank,
                    )?,
                    weights_proj: r.linear(
                        &format!("{p}.attn.indexer.weights_proj"),
                        cfg.index_n_heads,
                        d,
                    )?,
                };
                (
                    Some(r.compressor(
                        &format!("{p}.attn.compressor"),
                        cfg,
                        2 * hd,
                        hd,
                        cfg.csa_rate,
                    )?),
                    Some(indexer),
                )
            }
        };
        let attn = Attention {
            q_a: r.linear(&format!("{p}.attn.wq_a"), cfg.q_lora_rank, d)?,
            q_a_norm: r.vector(&format!("{p}.attn.q_norm.weight"), cfg.q_lora_rank)?,
            q_b: r.linear(&format!("{p}.attn.wq_b"), heads * hd, cfg.q_lora_rank)?,
            kv: r.linear(&format!("{p}.attn.wkv"), hd, d)?,
            kv_norm: r.vector(&format!("{p}.attn.norm.weight"), hd)?,
            o_a: r.linear(
                &format!("{p}.attn.wo_a"),
                cfg.o_groups * cfg.o_lora_rank,
                heads * hd / cfg.o_groups,
            )?,
            o_b: r.linear(&format!("{p}.attn.wo_b"), d, cfg.o_groups * cfg.o_lora_rank)?,
            sinks: r.vector(&format!("{p}.attn.attn_sink"), heads)?,
            compressor,
            indexer,
        };
        let k = cfg.num_experts_per_tok;
        let tid2eid = match mlp {
            MlpKind::Moe => None,
            MlpKind::HashMoe => {
                let name = format!("{p}.ffn.gate.tid2eid");
                let table = r.raw(&name, &[cfg.vocab_size, k])?;
                let ids: Vec<u32> = table.iter().map(|&e| e as u32).collect();
                if let Some(bad) = table
                    .iter()
                    .find(|&&e| e < 0.0 || e as usize >= cfg.num_routed_experts)
                {
                    return Err(TroupeError::Tensor {
                        name,
                        reason: format!("expert id {bad} outside 0..{}", cfg.num_routed_experts),
                    });
                }
                Some(ids)
            }
        };
        let score_bias = match mlp {
            MlpKind::HashMoe => None,
            MlpKind::Moe => {
                let name = format!("{p}.ffn.gate.bias");
                match src.tensor(&name)? {
                    Some(_) => Some(r.vector(&name, cfg.num_routed_experts)?),
                    None => None,
                }
            }
        };
        let moe = Moe {
            router: r.linear(&format!("{p}.ffn.gate"), cfg.num_routed_experts, d)?,
            tid2eid,
            score_bias,
            experts: (0..cfg.num_routed_experts)
                .map(|e| r.expert(&format!("{p}.ffn.experts.{e}"), cfg))
                .collect::<Result<_>>()?,
            shared: r.expert(&format!("{p}.ffn.shared_experts"), cfg)?,
        };
        Ok(Layer {
            attn_norm: r.vector(&format!("{p}.attn_norm.weight"), d)?,
            ffn_norm: r.vector(&format!("{p}.ffn_norm.weight"), d)?,
            attn_hc: r.hc(&format!("{p}.hc_attn"), cfg, (2 + n) * n, 3)?,
            ffn_hc: r.hc(&format!("{p}.hc_ffn"), cfg, (2 + n) * n, 3)?,
            attn,
            moe,
        })
    }
}

/// DeepSeek's released checkpoints name tensors without transformers' `model.` prefix
/// (`embed.weight`, `layers.N.…`, `norm.weight`, `hc_head_fn`); transformers' own save
/// keeps the prefix. Either is read.
struct EitherNaming<'a>(&'a dyn TensorSource);

impl TensorSource for EitherNaming<'_> {
    fn tensor(&self, name: &str) -> Result<Option<crate::model::loader::HostTensor>> {
        if let Some(t) = self.0.tensor(name)? {
            return Ok(Some(t));
        }
        let original = match name {
            "model.embed_tokens.weight" => "embed.weight".to_string(),
            _ => match name.strip_prefix("model.") {
                Some(rest) => rest.replace("hc_head.hc_", "hc_head_"),
                None => return Ok(None),
            },
        };
        self.0.tensor(&original)
    }
}

impl DsV4Weights {
    pub fn load(cfg: &DsV4Config, src: &dyn TensorSource) -> Result<Self> {
        let src = &EitherNaming(src);
        Self::read(
            cfg,
            Reader {
                src,
                dummy_experts: None,
            },
        )
    }

    /// `--dummy-weights`: seeded random weights of the config's shape, no checkpoint.
    pub fn dummy(cfg: &DsV4Config) -> Result<Self> {
        let src = &NoTensors;
        Self::read(
            cfg,
            Reader {
                src,
                dummy_experts: Some(cfg.num_routed_experts),
            },
        )
    }

    fn read(cfg: &DsV4Config, r: Reader<'_>) -> Result<Self> {
        let layers = (0..cfg.num_layers)
            .map(|l| {
                r.layer(
                    cfg,
                    &format!("model.layers.{l}"),
                    cfg.attention[l],
                    cfg.mlp[l],
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let (d, n) = (cfg.hidden_size, cfg.hc_mult);
        Ok(DsV4Weights {
            embed: r.raw("model.embed_tokens.weight", &[cfg.vocab_size, d])?,
            layers,
            hc_head: r.hc("model.hc_head.hc", cfg, n, 1)?,
            norm: r.vector("model.norm.weight", d)?,
            head: r.linear("head", cfg.vocab_size, d)?,
        })
    }
}
