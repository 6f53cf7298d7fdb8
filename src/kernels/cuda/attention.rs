//! Paged attention on the GPU: one block per (row, head) over the whole visible context,
//! or — when few (row, head) pairs would leave most SMs idle, as in small-batch decode —
//! split-K over fixed 64-key chunks merged by a combine kernel. Chunks start at fixed
//! positions, so either way a row's result does not depend on its batch.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{CudaBackend, CudaKvCache, check};
use crate::kernels::{Backend, SeqAttention};

/// Keys per split of the split-K attention, and the (row, head) pairs below which it runs.
const SPLIT_CHUNK: usize = 64;
const SPLIT_MAX_PAIRS: usize = 1024;

impl CudaBackend {
    pub(super) fn attention(
        &self,
        q: &CudaSlice<f32>,
        cache: &CudaKvCache,
        layer: usize,
        seqs: &[SeqAttention<'_>],
        num_heads: usize,
        out: &mut CudaSlice<f32>,
    ) {
        let shape = &cache.shape;
        let mut tables = Vec::new();
        let num_rows: usize = seqs.iter().map(|s| s.num_query_tokens).sum();
        let (mut row_table, mut row_visible) = (vec![0u32; num_rows], vec![0u32; num_rows]);
        let mut max_visible = 0usize;
        for s in seqs {
            let offset = tables.len() as u32;
            tables.extend_from_slice(s.block_table);
            for t in 0..s.num_query_tokens {
                let visible = s.num_context_tokens - s.num_query_tokens + t + 1;
                row_table[s.query_start + t] = offset;
                row_visible[s.query_start + t] = visible as u32;
                max_visible = max_visible.max(visible);
            }
        }
        if tables.is_empty() {
            tables.push(0);
        }
        let (nh, nkv, hd, bs) = (
            num_heads as i32,
            shape.num_kv_heads as i32,
            shape.head_dim as i32,
            shape.block_size as i32,
        );
        let scale = 1.0 / (shape.head_dim as f32).sqrt();
        let num_splits = max_visible.div_ceil(SPLIT_CHUNK);
        // Few (row, head) pairs leave most SMs idle with one block per pair: split the keys.
        // Chunks start at fixed positions, so a row's result does not depend on its batch;
        // the invariant mode still keeps the one-block kernel, whose numbers it was checked on.
        if !self.batch_invariant && num_rows * num_heads < SPLIT_MAX_PAIRS && num_splits > 1 {
            let (tables_d, rt_d, rv_d) = (
                self.upload_u32(&tables),
                self.upload_u32(&row_table),
                self.upload_u32(&row_visible),
            );
            let parts = num_rows * num_heads * num_splits;
            let mut part_o = self.alloc(parts * shape.head_dim);
            let mut part_ml = self.alloc(parts * 2);
            let (chunk, splits) = (SPLIT_CHUNK as i32, num_splits as i32);
            let cfg = LaunchConfig {
                grid_dim: (num_rows as u32, num_heads as u32, num_splits as u32),
                block_dim: (128, 1, 1),
                shared_mem_bytes: ((shape.head_dim + SPLIT_CHUNK) * 4) as u32,
            };
            // SAFETY: as for the one-block kernel; the partials hold rows·heads·splits.
            check(
                unsafe {
                    self.stream
                        .launch_builder(&self.kernels.attention_split)
                        .arg(&mut part_o)
                        .arg(&mut part_ml)
                        .arg(q)
                        .arg(&cache.k[layer])
                        .arg(&cache.v[layer])
                        .arg(&*tables_d)
                        .arg(&*rt_d)
                        .arg(&*rv_d)
                        .arg(&nh)
                        .arg(&nkv)
                        .arg(&hd)
                        .arg(&bs)
                        .arg(&scale)
                        .arg(&chunk)
                        .arg(&splits)
                        .launch(cfg)
                },
                "attention_split",
            );
            let cfg = LaunchConfig {
                grid_dim: (num_rows as u32, num_heads as u32, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: reads the partials written above, writes rows·heads·head_dim.
            check(
                unsafe {
                    self.stream
                        .launch_builder(&self.kernels.attention_combine)
                        .arg(out)
                        .arg(&part_o)
                        .arg(&part_ml)
                        .arg(&nh)
                        .arg(&hd)
                        .arg(&splits)
                        .launch(cfg)
                },
                "attention_combine",
            );
            return;
        }
        let smem = (shape.head_dim + max_visible) * 4;
        assert!(
            smem <= self.kernels.attention_smem_bytes,
            "a context of {max_visible} tokens exceeds this attention kernel's shared memory"
        );
        let (tables_d, rt_d, rv_d) = (
            self.upload_u32(&tables),
            self.upload_u32(&row_table),
            self.upload_u32(&row_visible),
        );
        let cfg = LaunchConfig {
            grid_dim: (num_rows.max(1) as u32, num_heads as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // SAFETY: the metadata describes rows inside q/out and slots inside the cache.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.kernels.paged_attention)
                    .arg(out)
                    .arg(q)
                    .arg(&cache.k[layer])
                    .arg(&cache.v[layer])
                    .arg(&*tables_d)
                    .arg(&*rt_d)
                    .arg(&*rv_d)
                    .arg(&nh)
                    .arg(&nkv)
                    .arg(&hd)
                    .arg(&bs)
                    .arg(&scale)
                    .launch(cfg)
            },
            "paged_attention",
        );
    }
}
