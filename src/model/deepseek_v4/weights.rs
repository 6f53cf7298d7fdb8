//! DeepSeek-V4 tensors by DeepSeek's own names (what transformers' `save_pretrained` and
//! the released checkpoints write). Vectors stay f32 on the host; each weight matrix goes
//! where its `LinearStore` puts it: an f32 `Linear` for the host reference, a device
//! matrix for the CUDA pass (`--dummy-weights` makes those on the device).

use super::config::{AttentionKind, DsV4Config, MlpKind};
use super::ops::Linear;
use crate::error::{Result, TroupeError};
use crate::model::loader::TensorSource;

pub struct Compressor<L = Linear> {
    pub kv: L,
    pub gate: L,
    /// `[rate, width]`: added to the gate logits by position inside the window.
    pub position_bias: Vec<f32>,
    pub norm: Vec<f32>,
}

pub struct Indexer<L = Linear> {
    pub compressor: Compressor<L>,
    pub q_b: L,
    pub weights_proj: L,
}

pub struct Attention<L = Linear> {
    pub q_a: L,
    pub q_a_norm: Vec<f32>,
    pub q_b: L,
    pub kv: L,
    pub kv_norm: Vec<f32>,
    /// `[groups · o_lora_rank, heads · head_dim / groups]`: group g owns rows g·r..(g+1)·r.
    pub o_a: L,
    pub o_b: L,
    pub sinks: Vec<f32>,
    pub compressor: Option<Compressor<L>>,
    pub indexer: Option<Indexer<L>>,
}

/// One mHC mapping: `fn` `[(2 + n)·n, n·hidden]`, `base` `[(2 + n)·n]`, `scale` `[3]`.
pub struct HyperConnection<L = Linear> {
    pub fn_: L,
    pub base: Vec<f32>,
    pub scale: Vec<f32>,
}

pub struct Expert<L = Linear> {
    pub gate: L,
    pub up: L,
    pub down: L,
}

pub struct Moe<L = Linear> {
    pub router: L,
    /// `[vocab, k]` expert ids (hash layers).
    pub tid2eid: Option<Vec<u32>>,
    pub score_bias: Option<Vec<f32>>,
    pub experts: Vec<Expert<L>>,
    pub shared: Expert<L>,
}

pub struct Layer<L = Linear> {
    pub attn_norm: Vec<f32>,
    pub ffn_norm: Vec<f32>,
    pub attn_hc: HyperConnection<L>,
    pub ffn_hc: HyperConnection<L>,
    pub attn: Attention<L>,
    pub moe: Moe<L>,
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
                store: &OnHost,
            },
        )
    }

    pub fn dummy(cfg: &DsV4Config) -> Result<Self> {
        Self::read(
            cfg,
            Reader {
                src: &NoTensors,
                dummy_experts: Some(cfg.num_routed_experts),
                store: &OnHost,
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

pub struct DsV4Weights<L = Linear> {
    pub embed: Vec<f32>,
    pub layers: Vec<Layer<L>>,
    pub hc_head: HyperConnection<L>,
    pub norm: Vec<f32>,
    pub head: L,
}

/// Where a weight matrix is put once read.
pub trait LinearStore {
    type Linear;
    fn store(&self, rows: usize, cols: usize, data: LinearData) -> Result<Self::Linear>;
}

/// A matrix's values: read from the checkpoint (dequantized), or `--dummy-weights`'
/// seeded values (`kernels::random_weight`), made wherever the matrix lives.
pub enum LinearData {
    Host(Vec<f32>),
    Random {
        seed: u64,
        mean: f32,
        half_width: f32,
    },
}

/// The host reference's store: f32 `Linear`s.
pub struct OnHost;

impl LinearStore for OnHost {
    type Linear = Linear;
    fn store(&self, rows: usize, cols: usize, data: LinearData) -> Result<Linear> {
        let w = match data {
            LinearData::Host(w) => w,
            LinearData::Random {
                seed,
                mean,
                half_width,
            } => (0..(rows * cols) as u64)
                .map(|i| crate::kernels::random_weight(seed, i, mean, half_width))
                .collect(),
        };
        Ok(Linear { rows, cols, w })
    }
}

struct Reader<'a, S: LinearStore = OnHost> {
    src: &'a dyn TensorSource,
    /// `--dummy-weights`: every tensor made from its name and shape (the number of
    /// routed experts, for a valid hash table); nothing is read.
    dummy_experts: Option<usize>,
    store: &'a S,
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
    let LinearData::Random {
        seed,
        mean,
        half_width,
    } = dummy_spec(name)
    else {
        unreachable!("dummy_spec is random")
    };
    (0..n as u64)
        .map(|i| crate::kernels::random_weight(seed, i, mean, half_width))
        .collect()
}

/// The seeded values `dummy_values` gives tensor `name`, as a spec a device can expand.
fn dummy_spec(name: &str) -> LinearData {
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
    LinearData::Random {
        seed,
        mean,
        half_width,
    }
}

/// A source with nothing in it (what `--dummy-weights` reads).
struct NoTensors;

impl TensorSource for NoTensors {
    fn tensor(&self, _name: &str) -> Result<Option<crate::model::loader::HostTensor>> {
        Ok(None)
    }
}

impl<S: LinearStore> Reader<'_, S> {
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

    fn linear(&self, name: &str, rows: usize, cols: usize) -> Result<S::Linear> {
        let data = if self.dummy_experts.is_some() {
            dummy_spec(&format!("{name}.weight"))
        } else {
            LinearData::Host(super::quantized::linear(self.src, name, rows, cols)?.w)
        };
        self.store.store(rows, cols, data)
    }

    /// A matrix stored under its full name, never quantized (the mHC mappings).
    fn plain_linear(&self, name: &str, rows: usize, cols: usize) -> Result<S::Linear> {
        let data = if self.dummy_experts.is_some() {
            dummy_spec(name)
        } else {
            LinearData::Host(self.raw(name, &[rows, cols])?)
        };
        self.store.store(rows, cols, data)
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
    ) -> Result<Compressor<S::Linear>> {
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
    ) -> Result<HyperConnection<S::Linear>> {
        let n = cfg.hc_mult;
        Ok(HyperConnection {
            fn_: self.plain_linear(&format!("{p}_fn"), outputs, n * cfg.hidden_size)?,
            base: self.vector(&format!("{p}_base"), outputs)?,
            scale: self.vector(&format!("{p}_scale"), scales)?,
        })
    }

    fn expert(&self, p: &str, cfg: &DsV4Config) -> Result<Expert<S::Linear>> {
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
    ) -> Result<Layer<S::Linear>> {
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
        Self::load_into(cfg, src, &OnHost)
    }

    /// `--dummy-weights`: seeded random weights of the config's shape, no checkpoint.
    pub fn dummy(cfg: &DsV4Config) -> Result<Self> {
        Self::dummy_into(cfg, &OnHost)
    }
}

impl<L> DsV4Weights<L> {
    /// The checkpoint's weights, each matrix put by `store`.
    pub fn load_into<S: LinearStore<Linear = L>>(
        cfg: &DsV4Config,
        src: &dyn TensorSource,
        store: &S,
    ) -> Result<Self> {
        let src = &EitherNaming(src);
        Self::read(
            cfg,
            Reader {
                src,
                dummy_experts: None,
                store,
            },
        )
    }

    /// `dummy`, each matrix made by `store` (the same values wherever it lives).
    pub fn dummy_into<S: LinearStore<Linear = L>>(cfg: &DsV4Config, store: &S) -> Result<Self> {
        Self::read(
            cfg,
            Reader {
                src: &NoTensors,
                dummy_experts: Some(cfg.num_routed_experts),
                store,
            },
        )
    }

    fn read<S: LinearStore<Linear = L>>(cfg: &DsV4Config, r: Reader<'_, S>) -> Result<Self> {
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
