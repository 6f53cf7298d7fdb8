//! DeepSeek-V4's weights on the GPU: every matrix bf16 (`CudaMatrix`, made on the device
//! for `--dummy-weights`, with the same values the host reference draws), the vectors f32,
//! the output projection's `o_a` split by group.

use cudarc::driver::CudaSlice;

use crate::error::{Result, TroupeError};
use crate::kernels::Backend;
use crate::kernels::cuda::{CudaBackend, CudaMatrix};
use crate::kernels::{HostData, HostMatrix};
use crate::model::deepseek_v4::config::DsV4Config;
use crate::model::deepseek_v4::weights::{
    Attention, Compressor, DsV4Weights, HyperConnection, Layer, LinearData, LinearStore, Moe,
};

pub struct OnDevice<'a>(pub &'a CudaBackend);

impl LinearStore for OnDevice<'_> {
    type Linear = CudaMatrix;
    fn store(&self, rows: usize, cols: usize, data: LinearData) -> Result<CudaMatrix> {
        let data = match data {
            LinearData::Host(w) => HostData::F32(w),
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
        Ok(self.0.upload_matrix(HostMatrix { rows, cols, data }))
    }
}

pub struct DeviceHc {
    pub fn_: CudaMatrix,
    pub base: CudaSlice<f32>,
    pub scale: CudaSlice<f32>,
}

pub struct DeviceCompressorWeights {
    pub kv: CudaMatrix,
    pub gate: CudaMatrix,
    pub position_bias: CudaSlice<f32>,
    pub norm: CudaSlice<f32>,
}

pub struct DeviceAttention {
    pub q_a: CudaMatrix,
    pub q_a_norm: CudaSlice<f32>,
    pub q_b: CudaMatrix,
    pub kv: CudaMatrix,
    pub kv_norm: CudaSlice<f32>,
    /// `o_a`'s rows of each group.
    pub o_a: Vec<CudaMatrix>,
    pub o_b: CudaMatrix,
    pub sinks: CudaSlice<f32>,
    pub compressor: Option<DeviceCompressorWeights>,
    /// The indexer's compressor, `q_b` and head weights.
    pub indexer: Option<(DeviceCompressorWeights, CudaMatrix, CudaMatrix)>,
}

pub struct DeviceExpert {
    pub gate: CudaMatrix,
    pub up: CudaMatrix,
    pub down: CudaMatrix,
}

pub struct DeviceMoe {
    pub router: CudaMatrix,
    pub tid2eid: Option<CudaSlice<u32>>,
    pub score_bias: Option<CudaSlice<f32>>,
    pub experts: Vec<DeviceExpert>,
    pub shared: DeviceExpert,
}

pub struct DeviceLayer {
    pub attn_norm: CudaSlice<f32>,
    pub ffn_norm: CudaSlice<f32>,
    pub attn_hc: DeviceHc,
    pub ffn_hc: DeviceHc,
    pub attn: DeviceAttention,
    pub moe: DeviceMoe,
}

pub struct DeviceWeights {
    /// Rows gathered on the host for each step's tokens.
    pub embed: Vec<f32>,
    pub layers: Vec<DeviceLayer>,
    pub hc_head: DeviceHc,
    pub norm: CudaSlice<f32>,
    pub head: CudaMatrix,
}

/// Splits `m`'s rows into `parts` equal matrices (device-to-device copies).
fn split_rows(b: &CudaBackend, m: CudaMatrix, parts: usize) -> Vec<CudaMatrix> {
    let rows = m.rows / parts;
    (0..parts)
        .map(|g| {
            let values = b.copy_bf16(&m.w, g * rows * m.cols, rows * m.cols);
            CudaMatrix {
                rows,
                cols: m.cols,
                w: values,
            }
        })
        .collect()
}

impl DeviceWeights {
    /// Checks what the kernels assume of the shape, then places `w`'s vectors beside its
    /// matrices.
    pub fn new(b: &CudaBackend, cfg: &DsV4Config, w: DsV4Weights<CudaMatrix>) -> Result<Self> {
        let limits = [
            (cfg.hc_mult, 16, "hc_mult"),
            (cfg.num_routed_experts, 1024, "n_routed_experts"),
            (cfg.num_experts_per_tok, 32, "num_experts_per_tok"),
            (
                cfg.head_dim,
                crate::kernels::cuda::ATT_MAX_HEAD_DIM,
                "head_dim",
            ),
            (
                cfg.index_n_heads * cfg.index_head_dim,
                crate::kernels::cuda::INDEX_SMEM_BYTES / 4,
                "index_n_heads × index_head_dim",
            ),
        ];
        for (value, most, name) in limits {
            if value > most {
                return Err(TroupeError::InvalidInput(format!(
                    "DeepSeek-V4 on CUDA: {name} = {value}, the kernels handle at most {most}"
                )));
            }
        }
        let up = |v: &[f32]| b.upload(v);
        let hc = |h: HyperConnection<CudaMatrix>| DeviceHc {
            fn_: h.fn_,
            base: up(&h.base),
            scale: up(&h.scale),
        };
        let comp = |c: Compressor<CudaMatrix>| DeviceCompressorWeights {
            kv: c.kv,
            gate: c.gate,
            position_bias: up(&c.position_bias),
            norm: up(&c.norm),
        };
        let attention = |a: Attention<CudaMatrix>| DeviceAttention {
            q_a: a.q_a,
            q_a_norm: up(&a.q_a_norm),
            q_b: a.q_b,
            kv: a.kv,
            kv_norm: up(&a.kv_norm),
            o_a: split_rows(b, a.o_a, cfg.o_groups),
            o_b: a.o_b,
            sinks: up(&a.sinks),
            compressor: a.compressor.map(comp),
            indexer: a
                .indexer
                .map(|ix| (comp(ix.compressor), ix.q_b, ix.weights_proj)),
        };
        let moe = |m: Moe<CudaMatrix>| DeviceMoe {
            router: m.router,
            tid2eid: m.tid2eid.map(|t| b.upload_u32s(&t)),
            score_bias: m.score_bias.map(|v| up(&v)),
            experts: m
                .experts
                .into_iter()
                .map(|e| DeviceExpert {
                    gate: e.gate,
                    up: e.up,
                    down: e.down,
                })
                .collect(),
            shared: DeviceExpert {
                gate: m.shared.gate,
                up: m.shared.up,
                down: m.shared.down,
            },
        };
        let layers = w
            .layers
            .into_iter()
            .map(|l: Layer<CudaMatrix>| DeviceLayer {
                attn_norm: up(&l.attn_norm),
                ffn_norm: up(&l.ffn_norm),
                attn_hc: hc(l.attn_hc),
                ffn_hc: hc(l.ffn_hc),
                attn: attention(l.attn),
                moe: moe(l.moe),
            })
            .collect();
        Ok(DeviceWeights {
            embed: w.embed,
            layers,
            hc_head: hc(w.hc_head),
            norm: up(&w.norm),
            head: w.head,
        })
    }
}
