//! DeepSeek-V4 tensors by DeepSeek's own names (what transformers' `save_pretrained` and
//! the released checkpoints write), placed on the backend a `LinearStore` names: f32
//! matrices on the CPU, bf16 on CUDA (`--dummy-weights` makes those on the device). The
//! embedding stays on the host, which gathers each step's rows.

use super::config::{AttentionKind, DsV4Config, MlpKind};
pub use super::expert_table::Expert;
use crate::error::{Result, TroupeError};
use crate::kernels::cpu::CpuBackend;
use crate::kernels::deepseek_v4::DsV4Kernels;
use crate::kernels::fp4::MXFP4_GROUP;
use crate::kernels::{Backend, HostData, HostMatrix};
use crate::model::loader::TensorSource;

pub struct CompressorWeights<B: DsV4Kernels = CpuBackend> {
    pub kv: B::Matrix,
    pub gate: B::Matrix,
    /// `[rate, width]`: added to the gate logits by position inside the window.
    pub position_bias: B::Buf,
    pub norm: B::Buf,
}

pub struct Indexer<B: DsV4Kernels = CpuBackend> {
    pub compressor: CompressorWeights<B>,
    pub q_b: B::Matrix,
    pub weights_proj: B::Matrix,
}

pub struct Attention<B: DsV4Kernels = CpuBackend> {
    pub q_a: B::Matrix,
    pub q_a_norm: B::Buf,
    pub q_b: B::Matrix,
    pub kv: B::Matrix,
    pub kv_norm: B::Buf,
    /// `wo_a` (`[groups · o_lora_rank, heads · head_dim / groups]`) in its groups' blocks:
    /// group g projects its heads with rows g·r..(g+1)·r.
    pub o_a: B::RowGroups,
    pub o_b: B::Matrix,
    pub sinks: B::Buf,
    pub compressor: Option<CompressorWeights<B>>,
    pub indexer: Option<Indexer<B>>,
}

/// One mHC mapping: `fn` `[(2 + n)·n, n·hidden]`, `base` `[(2 + n)·n]`, `scale` `[3]`.
pub struct HyperConnection<B: DsV4Kernels = CpuBackend> {
    pub fn_: B::Matrix,
    pub base: B::Buf,
    pub scale: B::Buf,
}

pub struct Moe<B: DsV4Kernels = CpuBackend> {
    pub router: B::Matrix,
    /// `[vocab, k]` expert ids (hash layers).
    pub tid2eid: Option<B::Ids>,
    pub score_bias: Option<B::Buf>,
    /// By expert id; `None`: held by another rank of an expert-parallel group.
    pub experts: Vec<Option<Expert<B>>>,
    /// `experts` as the grouped kernels read them (`expert_table::matrices`); `None` where
    /// this backend holds none of the layer's routed experts (all in host memory).
    pub table: Option<B::ExpertTable>,
    pub shared: Expert<B>,
}

pub struct Layer<B: DsV4Kernels = CpuBackend> {
    pub attn_norm: B::Buf,
    pub ffn_norm: B::Buf,
    pub attn_hc: HyperConnection<B>,
    pub ffn_hc: HyperConnection<B>,
    pub attn: Attention<B>,
    pub moe: Moe<B>,
}

/// DeepSeek's `MTPBlock` (`mtp.0.*`): a sliding-window, score-routed block fed with
/// `e_proj(enorm(embedding of the next token)) + h_proj(hnorm(streams))`, and its own
/// hyper-head and norm before the model's head.
pub struct MtpWeights<B: DsV4Kernels = CpuBackend> {
    pub e_proj: B::Matrix,
    pub h_proj: B::Matrix,
    pub enorm: B::Buf,
    pub hnorm: B::Buf,
    pub norm: B::Buf,
    pub hc_head: HyperConnection<B>,
    pub block: Layer<B>,
}

impl<B: DsV4Kernels> MtpWeights<B> {
    pub fn load<S: LinearStore<Backend = B>>(
        cfg: &DsV4Config,
        src: &dyn TensorSource,
        store: &S,
    ) -> Result<Self> {
        Self::read(
            cfg,
            Reader {
                src,
                dummy_experts: None,
                store,
                holds: &hold_all,
            },
        )
    }

    pub fn dummy<S: LinearStore<Backend = B>>(cfg: &DsV4Config, store: &S) -> Result<Self> {
        Self::read(
            cfg,
            Reader {
                src: &NoTensors,
                dummy_experts: Some(cfg.num_routed_experts),
                store,
                holds: &hold_all,
            },
        )
    }

    fn read<S: LinearStore<Backend = B>>(cfg: &DsV4Config, r: Reader<'_, S>) -> Result<Self> {
        let d = cfg.hidden_size;
        Ok(MtpWeights {
            e_proj: r.linear("mtp.0.e_proj", d, d)?,
            h_proj: r.linear("mtp.0.h_proj", d, d)?,
            enorm: r.vector("mtp.0.enorm.weight", d)?,
            hnorm: r.vector("mtp.0.hnorm.weight", d)?,
            norm: r.vector("mtp.0.norm.weight", d)?,
            hc_head: r.hc("mtp.0.hc_head", cfg, cfg.hc_mult, 1)?,
            block: r.layer(cfg, ("mtp.0", None), AttentionKind::Sliding, MlpKind::Moe)?,
        })
    }
}

pub struct DsV4Weights<B: DsV4Kernels = CpuBackend> {
    /// Rows gathered on the host for each step's tokens.
    pub embed: Vec<f32>,
    pub layers: Vec<Layer<B>>,
    pub hc_head: HyperConnection<B>,
    pub norm: B::Buf,
    pub head: B::Matrix,
}

/// Where the weights are put once read: a backend, and how a matrix reaches it.
pub trait LinearStore {
    type Backend: DsV4Kernels;
    fn backend(&self) -> &Self::Backend;
    fn store(
        &self,
        rows: usize,
        cols: usize,
        data: LinearData,
    ) -> Result<<Self::Backend as crate::kernels::Backend>::Matrix> {
        let data = match data {
            LinearData::Host(w) => HostData::F32(w),
            LinearData::Stored(data) => data,
            LinearData::Random {
                seed,
                mean,
                half_width,
            } => HostData::Random {
                seed,
                mean,
                half_width,
            },
        };
        Ok(self
            .backend()
            .upload_matrix(HostMatrix { rows, cols, data }))
    }
}

/// A matrix's values: read from the checkpoint (dequantized), or `--dummy-weights`'
/// seeded values (`kernels::random_weight`), made wherever the matrix lives.
pub enum LinearData {
    Host(Vec<f32>),
    /// As the checkpoint stores it: FP8 or MXFP4 kept packed, or values.
    Stored(HostData),
    Random {
        seed: u64,
        mean: f32,
        half_width: f32,
    },
}

/// Every matrix as it is read, on backend `B`.
pub struct OnBackend<'a, B>(pub &'a B);

impl<B: DsV4Kernels> LinearStore for OnBackend<'_, B> {
    type Backend = B;
    fn backend(&self) -> &B {
        self.0
    }
}

pub(super) struct Reader<'a, S: LinearStore> {
    pub(super) src: &'a dyn TensorSource,
    /// `--dummy-weights`: every tensor made from its name and shape (the number of
    /// routed experts, for a valid hash table); nothing is read.
    pub(super) dummy_experts: Option<usize>,
    pub(super) store: &'a S,
    /// Whether this rank holds routed expert (layer, expert) (`residency.rs`).
    pub(super) holds: &'a Holds<'a>,
}

/// Which routed experts (layer, expert) a rank holds.
pub type Holds<'a> = dyn Fn(usize, usize) -> bool + Sync + 'a;

/// Every expert: a lone rank's residency.
pub fn hold_all(_layer: usize, _expert: usize) -> bool {
    true
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

/// The projections DeepSeek-V4's released checkpoints store in FP8 and troupe keeps so
/// (`wo_a` is split by group into bf16 copies, so it stays dense).
fn shipped_in_fp8(name: &str) -> bool {
    [
        ".attn.wq_a",
        ".attn.wq_b",
        ".attn.wkv",
        ".attn.wo_b",
        ".ffn.shared_experts.",
    ]
    .iter()
    .any(|p| name.contains(p))
}

/// A source with nothing in it (what `--dummy-weights` reads).
pub(super) struct NoTensors;

impl TensorSource for NoTensors {
    fn tensor(&self, _name: &str) -> Result<Option<crate::model::loader::HostTensor>> {
        Ok(None)
    }
}

type MatrixOf<S> = <<S as LinearStore>::Backend as crate::kernels::Backend>::Matrix;
type BufOf<S> = <<S as LinearStore>::Backend as crate::kernels::Backend>::Buf;

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

    fn linear(&self, name: &str, rows: usize, cols: usize) -> Result<MatrixOf<S>> {
        let data = if self.dummy_experts.is_some() {
            let spec = dummy_spec(&format!("{name}.weight"));
            match spec {
                // Routed experts packed as the released checkpoints ship them.
                LinearData::Random { seed, .. }
                    if name.contains(".ffn.experts.") && cols.is_multiple_of(MXFP4_GROUP) =>
                {
                    LinearData::Stored(HostData::RandomMxfp4 { seed })
                }
                // Projections in FP8 as shipped (per channel here: a block grid of random
                // weights would say nothing more).
                LinearData::Random {
                    seed,
                    mean,
                    half_width,
                } if shipped_in_fp8(name) => LinearData::Stored(HostData::ToFp8 {
                    cols,
                    dense: Box::new(HostData::Random {
                        seed,
                        mean,
                        half_width,
                    }),
                }),
                spec => spec,
            }
        } else {
            LinearData::Stored(super::quantized::linear_data(self.src, name, rows, cols)?)
        };
        self.store.store(rows, cols, data)
    }

    /// A matrix stored under its full name, never quantized (the mHC mappings).
    fn plain_linear(&self, name: &str, rows: usize, cols: usize) -> Result<MatrixOf<S>> {
        let data = if self.dummy_experts.is_some() {
            dummy_spec(name)
        } else {
            LinearData::Host(self.raw(name, &[rows, cols])?)
        };
        self.store.store(rows, cols, data)
    }

    fn vector(&self, name: &str, n: usize) -> Result<BufOf<S>> {
        Ok(self.store.backend().upload(&self.raw(name, &[n])?))
    }

    fn compressor(
        &self,
        p: &str,
        cfg: &DsV4Config,
        width: usize,
        dim: usize,
        rate: usize,
    ) -> Result<CompressorWeights<S::Backend>> {
        Ok(CompressorWeights {
            kv: self.linear(&format!("{p}.wkv"), width, cfg.hidden_size)?,
            gate: self.linear(&format!("{p}.wgate"), width, cfg.hidden_size)?,
            position_bias: self
                .store
                .backend()
                .upload(&self.raw(&format!("{p}.ape"), &[rate, width])?),
            norm: self.vector(&format!("{p}.norm.weight"), dim)?,
        })
    }

    fn hc(
        &self,
        p: &str,
        cfg: &DsV4Config,
        outputs: usize,
        scales: usize,
    ) -> Result<HyperConnection<S::Backend>> {
        let n = cfg.hc_mult;
        Ok(HyperConnection {
            fn_: self.plain_linear(&format!("{p}_fn"), outputs, n * cfg.hidden_size)?,
            base: self.vector(&format!("{p}_base"), outputs)?,
            scale: self.vector(&format!("{p}_scale"), scales)?,
        })
    }

    pub(super) fn expert(&self, p: &str, cfg: &DsV4Config) -> Result<Expert<S::Backend>> {
        let (d, i) = (cfg.hidden_size, cfg.moe_intermediate_size);
        Ok(Expert {
            gate: self.linear(&format!("{p}.w1"), i, d)?,
            up: self.linear(&format!("{p}.w3"), i, d)?,
            down: self.linear(&format!("{p}.w2"), d, i)?,
        })
    }

    /// One block: attention of `attention`'s kind, an MLP of `mlp`'s, under prefix `p`
    /// (`model.layers.N`, or `mtp.0` for the MTP layer's block).
    /// Layer `index` of the model (`None`: the MTP layer's block, all of whose experts
    /// every rank holds).
    fn layer(
        &self,
        cfg: &DsV4Config,
        (p, index): (&str, Option<usize>),
        attention: AttentionKind,
        mlp: MlpKind,
    ) -> Result<Layer<S::Backend>> {
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
            o_a: r.store.backend().row_groups(
                r.linear(
                    &format!("{p}.attn.wo_a"),
                    cfg.o_groups * cfg.o_lora_rank,
                    heads * hd / cfg.o_groups,
                )?,
                cfg.o_groups,
            ),
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
                Some(r.store.backend().upload_ids(&ids))
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
        let experts: Vec<Option<Expert<S::Backend>>> = (0..cfg.num_routed_experts)
            .map(|e| {
                index
                    .is_none_or(|l| (r.holds)(l, e))
                    .then(|| r.expert(&format!("{p}.ffn.experts.{e}"), cfg))
                    .transpose()
            })
            .collect::<Result<_>>()?;
        let table = super::expert_table::expert_table(r.store.backend(), &experts)
            .map_err(|e| TroupeError::InvalidInput(format!("{p}.ffn.experts: {e}")))?;
        let moe = Moe {
            router: r.linear(&format!("{p}.ffn.gate"), cfg.num_routed_experts, d)?,
            tid2eid,
            score_bias,
            experts,
            table,
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
pub(super) struct EitherNaming<'a>(pub(super) &'a dyn TensorSource);

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

impl<B: DsV4Kernels> DsV4Weights<B> {
    /// The checkpoint's weights, each matrix put by `store`.
    pub fn load_into<S: LinearStore<Backend = B>>(
        cfg: &DsV4Config,
        src: &dyn TensorSource,
        store: &S,
    ) -> Result<Self> {
        Self::load_holding(cfg, Some(src), store, &hold_all)
    }

    /// `--dummy-weights`: seeded random weights of the config's shape, no checkpoint
    /// (the same values wherever `store` puts them).
    pub fn dummy_into<S: LinearStore<Backend = B>>(cfg: &DsV4Config, store: &S) -> Result<Self> {
        Self::load_holding(cfg, None, store, &hold_all)
    }

    pub(super) fn read<S: LinearStore<Backend = B>>(
        cfg: &DsV4Config,
        r: Reader<'_, S>,
    ) -> Result<Self> {
        let layers = (0..cfg.num_layers)
            .map(|l| {
                let p = format!("model.layers.{l}");
                r.layer(cfg, (&p, Some(l)), cfg.attention[l], cfg.mlp[l])
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
