//! DeepSeek-V4's cache on the GPU, laid out as the host's (`cache.rs`, seed §8.1): per
//! layer the sliding-window ring of every state slot, each compressor's open windows and
//! overlap state per slot, and its entries per block; the slots' histories are kept on the
//! host, where steps are checked and planned.

use cudarc::driver::CudaSlice;

use crate::kernels::Backend;
use crate::kernels::cuda::{CudaBackend, DeviceCompressor};
use crate::model::deepseek_v4::cache::SlotSpan;
use crate::model::deepseek_v4::config::{AttentionKind, DsV4Config};

pub struct DeviceLayerCache {
    pub ring: CudaSlice<f32>,
    pub compressor: Option<DeviceCompressor>,
    pub indexer: Option<DeviceCompressor>,
}

pub struct DeviceCache {
    pub block_size: usize,
    pub num_blocks: usize,
    pub ring_len: usize,
    pub layers: Vec<DeviceLayerCache>,
    pub spans: Vec<SlotSpan>,
    pub slot_tokens: Vec<usize>,
}

fn compressor(
    b: &CudaBackend,
    rate: usize,
    dim: usize,
    overlap: bool,
    num_slots: usize,
    num_blocks: usize,
    block_size: usize,
) -> DeviceCompressor {
    let width = if overlap { 2 * dim } else { dim };
    let prev = if overlap { rate * dim } else { 0 };
    let entries_per_block = block_size / rate;
    DeviceCompressor {
        rate,
        width,
        dim,
        overlap,
        entries_per_block,
        buf_kv: b.alloc(num_slots * rate * width),
        buf_gate: b.alloc(num_slots * rate * width),
        prev_kv: b.alloc((num_slots * prev).max(1)),
        prev_gate: b.alloc((num_slots * prev).max(1)),
        entries: b.alloc((num_blocks * entries_per_block * dim).max(1)),
    }
}

impl DeviceCache {
    pub fn new(
        b: &CudaBackend,
        cfg: &DsV4Config,
        num_slots: usize,
        num_blocks: usize,
        block_size: usize,
    ) -> Self {
        let ring_len = cfg.sliding_window - 1;
        let layers = (0..cfg.num_layers)
            .map(|l| {
                let csa = cfg.attention[l] == AttentionKind::CompressedSparse;
                DeviceLayerCache {
                    ring: b.alloc((num_slots * ring_len * cfg.head_dim).max(1)),
                    compressor: cfg.rate(l).map(|rate| {
                        compressor(
                            b,
                            rate,
                            cfg.head_dim,
                            csa,
                            num_slots,
                            num_blocks,
                            block_size,
                        )
                    }),
                    indexer: csa.then(|| {
                        compressor(
                            b,
                            cfg.csa_rate,
                            cfg.index_head_dim,
                            true,
                            num_slots,
                            num_blocks,
                            block_size,
                        )
                    }),
                }
            })
            .collect();
        DeviceCache {
            block_size,
            num_blocks,
            ring_len,
            layers,
            spans: vec![SlotSpan::default(); num_slots],
            slot_tokens: vec![0; num_slots],
        }
    }

    pub fn num_slots(&self) -> usize {
        self.slot_tokens.len()
    }
}
