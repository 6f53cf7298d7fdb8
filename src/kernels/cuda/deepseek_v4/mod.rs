//! DeepSeek-V4's kernels (`kernels-cuda/deepseek_v4.cu`) on the CUDA backend: a program of
//! their own, built on first use so that a Llama rank never compiles them, typed
//! launchers over the step's metadata (`StepMeta`), and `DsV4Kernels` over them (`ops.rs`).

// The launchers take a kernel's operands one by one: bundling them would only move the
// argument list into struct literals at every call.
#![allow(clippy::too_many_arguments)]

mod attention;

pub use attention::ATT_MAX_HEAD_DIM;
use attention::{ATTENTION_SMEM_BYTES, MMA_SMEM_BYTES};
mod moe;
mod ops;
mod row_groups;

pub use row_groups::CudaRowGroups;

pub use moe::CudaExperts;

use crate::sync::Shared as Arc;

use cudarc::driver::{CudaFunction, CudaModule, CudaSlice, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

use super::{CudaBackend, CudaError, check};
use crate::kernels::deepseek_v4::{Compressor, DsV4KernelError, DsV4Shape, StepMeta};

type Meta = StepMeta<CudaBackend>;

pub const DEEPSEEK_V4_SOURCE: &str = concat!(
    include_str!("../../../../kernels-cuda/torch_topk.cu"),
    include_str!("../../../../kernels-cuda/deepseek_v4.cu"),
    include_str!("../../../../kernels-cuda/dsv4_attention.cu"),
    include_str!("../../../../kernels-cuda/mma_tile.cu"),
    include_str!("../../../../kernels-cuda/dsv4_attention_mma.cu"),
    include_str!("../../../../kernels-cuda/moe.cu"),
    include_str!("../../../../kernels-cuda/moe_pipe.cu"),
    include_str!("../../../../kernels-cuda/moe_gemv_mma.cu")
);

/// Entries a block of the indexer's score kernel takes (`IX_ENTRIES`).
const IX_ENTRIES: usize = 32;

/// The indexer's queries of a row in shared memory, at most (heads · dim floats).
pub const INDEX_SMEM_BYTES: usize = 64 << 10;
/// The indexer's key width, at most: a block's keys share the queries' shared memory.
pub const INDEX_MAX_HEAD_DIM: usize = 512;

/// Shared memory of an indexer score block: the queries, then `IX_ENTRIES` key rows
/// padded by 4 floats (as `dsv4_index_scores_kernel` lays them out; dim a multiple of 4).
fn index_smem_bytes(heads: usize, dim: usize) -> usize {
    4 * (heads * dim + IX_ENTRIES * (dim + 4))
}

/// The shapes the kernels take, or the dimension they cannot (`DsV4Kernels::dsv4_prepare`).
pub fn check_shape(shape: &DsV4Shape) -> Result<(), DsV4KernelError> {
    let limits = [
        (shape.hc_mult, 16, "hc_mult"),
        (shape.num_routed_experts, 1024, "n_routed_experts"),
        (shape.num_experts_per_tok, 32, "num_experts_per_tok"),
        (shape.head_dim, ATT_MAX_HEAD_DIM, "head_dim"),
        (
            shape.index_width,
            INDEX_SMEM_BYTES / 4,
            "index_n_heads × index_head_dim",
        ),
        (shape.index_head_dim, INDEX_MAX_HEAD_DIM, "index_head_dim"),
    ];
    for (value, most, name) in limits {
        if value > most {
            return Err(DsV4KernelError::Shape {
                device: "CUDA",
                name,
                value,
                most,
            });
        }
    }
    // The indexer's score kernel reads 4 floats at a time.
    if !shape.index_head_dim.is_multiple_of(4) {
        return Err(DsV4KernelError::NotMultiple {
            device: "CUDA",
            name: "index_head_dim",
            value: shape.index_head_dim,
            of: 4,
        });
    }
    Ok(())
}

pub struct DsV4Program {
    _module: Arc<CudaModule>,
    rope: CudaFunction,
    mhc_mix: CudaFunction,
    mhc_merge: CudaFunction,
    mhc_head: CudaFunction,
    expand: CudaFunction,
    take_picks: CudaFunction,
    embed: CudaFunction,
    swap: CudaFunction,
    compress_feed: CudaFunction,
    compress_keep: CudaFunction,
    entry_finish: CudaFunction,
    index_scores: CudaFunction,
    topk: CudaFunction,
    attention: CudaFunction,
    attention_mma: CudaFunction,
    attention_merge: CudaFunction,
    ring_write: CudaFunction,
    moe_route: CudaFunction,
    swiglu: CudaFunction,
    moe_combine: CudaFunction,
    moe: moe::MoeFunctions,
}

fn load(backend: &CudaBackend) -> Result<DsV4Program, CudaError> {
    let cc = backend
        .ctx
        .compute_capability()
        .map_err(|e| CudaError::Unavailable(e.to_string()))?;
    let image = super::kernel_image(DEEPSEEK_V4_SOURCE, cc)?;
    let module = backend
        .ctx
        .load_module(Ptx::from_binary(image))
        .map_err(|e| CudaError::Compile(format!("loading the DeepSeek-V4 kernels: {e}")))?;
    let f = |name: &str| {
        module
            .load_function(&format!("dsv4_{name}_kernel"))
            .map_err(|e| CudaError::Compile(format!("kernel `dsv4_{name}_kernel`: {e}")))
    };
    let attention = f("attention")?;
    let index_scores = f("index_scores")?;
    super::module::opt_in_smem(
        &index_scores,
        INDEX_SMEM_BYTES + index_smem_bytes(0, INDEX_MAX_HEAD_DIM),
        "dsv4_index_scores",
    )?;
    super::module::opt_in_smem(&attention, ATTENTION_SMEM_BYTES, "dsv4_attention")?;
    let attention_mma = f("attention_mma")?;
    super::module::opt_in_smem(&attention_mma, MMA_SMEM_BYTES, "dsv4_attention_mma")?;
    Ok(DsV4Program {
        rope: f("rope")?,
        mhc_mix: f("mhc_mix")?,
        mhc_merge: f("mhc_merge")?,
        mhc_head: f("mhc_head")?,
        expand: f("expand")?,
        take_picks: f("take_picks")?,
        embed: f("embed")?,
        swap: f("swap")?,
        compress_feed: f("compress_feed")?,
        compress_keep: f("compress_keep")?,
        entry_finish: f("entry_finish")?,
        index_scores,
        topk: f("topk")?,
        attention,
        attention_mma,
        attention_merge: f("attention_merge")?,
        ring_write: f("ring_write")?,
        moe_route: f("moe_route")?,
        swiglu: f("swiglu")?,
        moe_combine: f("moe_combine")?,
        moe: moe::MoeFunctions::load(f)?,
        _module: module,
    })
}

pub(super) fn blocks(x: usize, y: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (x.max(1) as u32, y.max(1) as u32, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl CudaBackend {
    /// DeepSeek-V4's kernels, built (or read from the disk cache) on first use.
    pub fn dsv4_kernels(&self) -> Result<&DsV4Program, CudaError> {
        if let Some(k) = self.dsv4.get() {
            return Ok(k);
        }
        let k = load(self)?;
        Ok(self.dsv4.get_or_init(|| k))
    }

    /// `DsV4Kernels::dsv4_take_picks`: the last picks, still on the device, into `ids`.
    fn take_picks(&self, ids: &mut CudaSlice<u32>, picked: &[u32]) {
        let picked_d = self.upload_u32(super::graph::Meta::Picked, picked);
        let picks = self.picks.lock().unwrap_or_else(|e| e.into_inner());
        let n = picked.len() as i32;
        // SAFETY: ids holds picked.len() entries, picked indices < MAX_PICKS.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.ds().take_picks)
                    .arg(ids)
                    .arg(&picked_d.ptr)
                    .arg(&picks.0)
                    .arg(&n)
                    .launch(super::grid_for(picked.len()))
            },
            "dsv4_take_picks",
        );
    }

    /// `DsV4Kernels::dsv4_embed`: rows of the f32 `table` chosen by `ids` on the device.
    fn embed_rows(
        &self,
        table: &CudaSlice<f32>,
        dim: usize,
        ids: &CudaSlice<u32>,
        tokens: usize,
        out: &mut CudaSlice<f32>,
    ) {
        let dim = dim as i32;
        // SAFETY: ids holds `tokens` rows of the table; out holds tokens · dim.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.ds().embed)
                    .arg(out)
                    .arg(table)
                    .arg(ids)
                    .arg(&dim)
                    .launch(LaunchConfig {
                        grid_dim: (tokens.max(1) as u32, 1, 1),
                        block_dim: (1024, 1, 1),
                        shared_mem_bytes: 0,
                    })
            },
            "dsv4_embed",
        );
    }

    pub(super) fn ds(&self) -> &DsV4Program {
        self.dsv4
            .get()
            .expect("dsv4_kernels() is called when the model is loaded")
    }

    pub fn upload_u32s(&self, data: &[u32]) -> CudaSlice<u32> {
        if data.is_empty() {
            return check(self.stream.alloc_zeros::<u32>(1), "alloc");
        }
        check(self.stream.clone_htod(data), "upload")
    }

    /// A buffer of `len` values left as the allocator hands it out (no memset launch): for
    /// what a kernel writes whole before anything reads it.
    pub fn alloc_written(&self, len: usize) -> CudaSlice<f32> {
        // SAFETY: f32 has no invalid bit patterns; callers write before they read.
        check(unsafe { self.stream.alloc::<f32>(len.max(1)) }, "alloc")
    }

    pub fn alloc_u32s(&self, len: usize) -> CudaSlice<u32> {
        check(self.stream.alloc_zeros::<u32>(len.max(1)), "alloc")
    }

    pub fn alloc_i32s(&self, len: usize) -> CudaSlice<i32> {
        check(self.stream.alloc_zeros::<i32>(len.max(1)), "alloc")
    }

    pub fn download_u32s(&self, buf: &CudaSlice<u32>, len: usize) -> Vec<u32> {
        let mut out = vec![0u32; len];
        if len > 0 {
            check(
                self.stream.memcpy_dtoh(&buf.slice(0..len), &mut out),
                "download",
            );
        }
        out
    }

    /// The lightning indexer: scores of every visible entry, then each row's top `k`.
    pub(super) fn launch_index_select(
        &self,
        sel: &mut CudaSlice<u32>,
        scores: &mut CudaSlice<f32>,
        q: &CudaSlice<f32>,
        head_weights: &CudaSlice<f32>,
        keys: &Compressor<CudaBackend>,
        meta: &Meta,
        block_size: usize,
        heads: usize,
        max_visible: usize,
        k: usize,
    ) {
        let (bs, rate, epb) = (
            block_size as i32,
            keys.rate as i32,
            keys.entries_per_block as i32,
        );
        let (hi, di, mv, ki) = (heads as i32, keys.dim as i32, max_visible as i32, k as i32);
        assert!(
            heads * keys.dim * 4 <= INDEX_SMEM_BYTES
                && keys.dim <= INDEX_MAX_HEAD_DIM
                && keys.dim.is_multiple_of(4),
            "the indexer's shape is checked when the model loads"
        );
        let score_scale = (keys.dim as f32).powf(-0.5);
        let weight_scale = (heads as f32).powf(-0.5);
        if max_visible > 0 {
            // SAFETY: scores holds num_rows·max_visible values, q num_rows·heads·dim,
            // head_weights num_rows·heads.
            check(
                unsafe {
                    self.stream
                        .launch_builder(&self.ds().index_scores)
                        .arg(&mut *scores)
                        .arg(q)
                        .arg(head_weights)
                        .arg(&keys.entries)
                        .arg(&meta.rows)
                        .arg(&meta.seqs)
                        .arg(&meta.tables)
                        .arg(&bs)
                        .arg(&rate)
                        .arg(&epb)
                        .arg(&hi)
                        .arg(&di)
                        .arg(&score_scale)
                        .arg(&weight_scale)
                        .arg(&mv)
                        .launch(LaunchConfig {
                            shared_mem_bytes: index_smem_bytes(heads, keys.dim) as u32,
                            ..blocks(meta.num_rows, max_visible.div_ceil(IX_ENTRIES), 256)
                        })
                },
                "dsv4_index_scores",
            );
        }
        let mut scratch = self.alloc_i32s(2 * meta.num_rows * max_visible.max(1));
        // SAFETY: sel holds num_rows·k values, scores and scratch num_rows·max_visible and
        // 2·num_rows·max_visible.
        check(
            unsafe {
                self.stream
                    .launch_builder(&self.ds().topk)
                    .arg(sel)
                    .arg(&mut *scores)
                    .arg(&mut scratch)
                    .arg(&meta.rows)
                    .arg(&rate)
                    .arg(&mv)
                    .arg(&ki)
                    .launch(blocks(meta.num_rows, 1, 256))
            },
            "dsv4_topk",
        );
    }
}
