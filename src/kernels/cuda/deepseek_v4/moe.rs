//! DeepSeek-V4's routed experts on the device (`kernels-cuda/moe.cu`): the router's
//! choice is grouped by expert into tiles without a read-back, and each tile runs against
//! its expert's weights as stored, found through a table of device addresses made at load.

use cudarc::driver::{
    CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use half::bf16;

use super::super::weights::{PackedFormat, Store};
use super::super::{CudaBackend, CudaMatrix, check};
use super::blocks;
use crate::kernels::deepseek_v4::{DsV4KernelError, ExpertMatrices, ExpertOwners};

/// `moe.cu`'s weight formats.
const MOE_BF16: usize = 0;
const MOE_MXFP4: usize = 1;

/// Rows of a tile for few pairs an expert, and for many (`moe.cu`'s `few`/`many` shapes),
/// and the output features of each block.
const FEW_ROWS: usize = 16;
const MANY_ROWS: usize = 64;
const FEW_FEATURES: usize = 16;
const MANY_FEATURES: usize = 128;

/// The GEMV path (`moe_gemv_mma.cu`): K a multiple of this (a chunk of 16 blocks), the
/// widest input row, warps a block, and its dynamic shared memory (MG_SMEM_BYTES): the
/// input row as f16, two stages of 16 rows × 272 bytes a warp, 16 bytes of slack.
const GEMV_RUN: usize = 512;
const GEMV_MAX_K: usize = 8192;
const GEMV_WARPS: usize = 4;
const fn gemv_smem_bytes(k: usize) -> usize {
    2 * k + GEMV_WARPS * 2 * 16 * 272 + 16
}
/// The GEMV path while experts number at least this many a pair (V4-Flash: batches up to 10).
const GEMV_EXPERTS_PER_PAIR: usize = 4;

/// The align launch's grouping of pairs into tiles of one expert each.
struct Tiles<'a> {
    sorted: &'a CudaSlice<i32>,
    tile_expert: &'a CudaSlice<i32>,
    num_tiles: &'a CudaSlice<i32>,
    max_tiles: usize,
}

/// A layer's routed experts as the grouped kernels read them.
pub struct CudaExperts {
    gate: CudaSlice<u64>,
    up: CudaSlice<u64>,
    down: CudaSlice<u64>,
    /// `moe.cu`'s format of gate and up, and of down.
    formats: [usize; 2],
    num_experts: usize,
    inter: usize,
    hidden: usize,
}

/// The grouped kernels of one format: `[up, down]` for few rows, then for many.
pub struct MoeFunctions {
    pub align: CudaFunction,
    pub gemm: [[CudaFunction; 4]; 2],
    /// MXFP4 experts for decode-sized steps, on the tensor cores: `[up, down]`.
    pub gemv: [CudaFunction; 2],
    /// MXFP4 experts, many rows a tile, both K multiples of `PIPE_K`: `[up, down]`
    /// (`moe_pipe.cu`; bf16 rows in, the up pass's out).
    pub pipe: [CudaFunction; 2],
}

/// `moe_pipe.cu`'s K chunk (MP_KC), tile rows (MP_BM), threads, output features a block
/// (`[up, down]`: 64 features' gate and up rows, or 128), and shared bytes
/// (MP_SMEM_BYTES): three stages of 128 bf16 rows of MP_KC + 8 and 128 weight rows' 68
/// bytes, two buffers of 128 decoded weight rows.
const PIPE_K: usize = 128;
const PIPE_ROWS: usize = 128;
const PIPE_THREADS: u32 = 512;
const PIPE_FEATURES: [usize; 2] = [64, 128];
const PIPE_SMEM_BYTES: usize =
    3 * (PIPE_ROWS * (PIPE_K + 8) * 2 + 128 * 68) + 2 * 128 * (PIPE_K + 8) * 2;

impl MoeFunctions {
    pub fn load(
        f: impl Fn(&str) -> Result<CudaFunction, super::CudaError>,
    ) -> Result<Self, super::CudaError> {
        let set = |fmt: &str| -> Result<[CudaFunction; 4], super::CudaError> {
            Ok([
                f(&format!("moe_up_{fmt}_few"))?,
                f(&format!("moe_down_{fmt}_few"))?,
                f(&format!("moe_up_{fmt}_many"))?,
                f(&format!("moe_down_{fmt}_many"))?,
            ])
        };
        Ok(MoeFunctions {
            align: f("moe_align")?,
            gemm: [set("bf16")?, set("mxfp4")?],
            gemv: {
                let (up, down) = (f("moe_gemv_mma_up_mxfp4")?, f("moe_gemv_mma_down_mxfp4")?);
                let opt_in = super::super::module::opt_in_smem;
                opt_in(
                    &up,
                    gemv_smem_bytes(GEMV_MAX_K),
                    "dsv4_moe_gemv_mma_up_mxfp4",
                )?;
                opt_in(
                    &down,
                    gemv_smem_bytes(GEMV_MAX_K),
                    "dsv4_moe_gemv_mma_down_mxfp4",
                )?;
                [up, down]
            },
            pipe: {
                let (up, down) = (f("moe_up_mxfp4_pipe")?, f("moe_down_mxfp4_pipe")?);
                let opt_in = super::super::module::opt_in_smem;
                opt_in(&up, PIPE_SMEM_BYTES, "dsv4_moe_up_mxfp4_pipe")?;
                opt_in(&down, PIPE_SMEM_BYTES, "dsv4_moe_down_mxfp4_pipe")?;
                [up, down]
            },
        })
    }
}

fn format_of(m: &CudaMatrix) -> Option<usize> {
    match &m.store {
        Store::Bf16(_) => Some(MOE_BF16),
        Store::Packed(parts) => match parts.as_slice() {
            [p] if p.format == PackedFormat::Mxfp4 => Some(MOE_MXFP4),
            _ => None,
        },
    }
}

impl CudaBackend {
    pub(super) fn expert_table(
        &self,
        experts: &ExpertMatrices<'_, CudaBackend>,
    ) -> Result<CudaExperts, DsV4KernelError> {
        let refuse = |reason: String| DsV4KernelError::Unavailable {
            device: "CUDA",
            reason,
        };
        let first = experts
            .first()
            .ok_or_else(|| refuse("a MoE layer without routed experts".into()))?;
        let (inter, hidden) = (first[0].rows, first[0].cols);
        // Gate and up go through one kernel (one format); down through its own.
        let up_format = format_of(first[0]);
        let down_format = format_of(first[2]);
        for (e, mats) in experts.iter().enumerate() {
            let wanted = [
                (up_format, inter, hidden),
                (up_format, inter, hidden),
                (down_format, hidden, inter),
            ];
            for (m, (format, rows, cols)) in mats.iter().zip(wanted) {
                if format.is_none() || format_of(m) != format || (m.rows, m.cols) != (rows, cols) {
                    return Err(refuse(format!(
                        "routed expert {e}'s weights are not bf16 or MXFP4 of expert 0's \
                         formats and shapes"
                    )));
                }
            }
        }
        // The kernels read activations and bf16 weights 8 values at a time (MXFP4 comes
        // in 32-column blocks already).
        if !inter.is_multiple_of(8) || !hidden.is_multiple_of(8) {
            return Err(refuse(format!(
                "routed experts of {inter} × {hidden}: both sides must be multiples of 8"
            )));
        }
        let table = |pick: usize| -> Vec<u64> {
            experts
                .iter()
                .map(|mats| match &mats[pick].store {
                    Store::Bf16(w) => w.device_ptr(&self.stream).0,
                    Store::Packed(parts) => parts[0].bytes.device_ptr(&self.stream).0,
                })
                .collect()
        };
        let upload = |v: Vec<u64>| check(self.stream.clone_htod(&v), "upload");
        Ok(CudaExperts {
            gate: upload(table(0)),
            up: upload(table(1)),
            down: upload(table(2)),
            formats: [
                up_format.unwrap_or(MOE_BF16),
                down_format.unwrap_or(MOE_BF16),
            ],
            num_experts: experts.len(),
            inter,
            hidden,
        })
    }

    /// `dsv4_routed_experts`: align, then gate·up with SwiGLU into `h`, then down into `ys`.
    pub(super) fn routed_experts(
        &self,
        ys: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        chosen: &CudaSlice<u32>,
        t: &CudaExperts,
        owners: Option<&ExpertOwners<'_, CudaBackend>>,
        counts: &mut CudaSlice<u32>,
        counts_at: usize,
        (tokens, k, limit): (usize, usize, f32),
    ) {
        let pairs = tokens * k;
        if pairs == 0 {
            return;
        }
        let e = t.num_experts;
        // Decode-sized steps stream each pair's weights through the GEMV, which needs no
        // grouping: while pairs are a fraction of the experts, few share one, so reading
        // an expert once per pair costs little, and the tiles' barriers cost more.
        let gemv = !self.batch_invariant
            && owners.is_none()
            && t.formats == [MOE_MXFP4, MOE_MXFP4]
            && GEMV_EXPERTS_PER_PAIR * pairs <= e
            && [t.inter, t.hidden]
                .iter()
                .all(|&k| k.is_multiple_of(GEMV_RUN) && k <= GEMV_MAX_K);
        if gemv {
            self.routed_experts_gemv(
                ys,
                x,
                chosen,
                t,
                &mut counts.slice_mut(counts_at..counts_at + e),
                (tokens, k, limit),
            );
            return;
        }
        // The invariant mode always takes the few-row shape (f32-accurate activations, the
        // same sums whatever the batch); else many rows once experts average 16 pairs.
        let many = !self.batch_invariant && pairs >= 16 * e;
        // Many rows of MXFP4 experts take the pipelined kernel where both K suit its chunks.
        let pipe = many
            && t.formats == [MOE_MXFP4, MOE_MXFP4]
            && [t.hidden, t.inter]
                .iter()
                .all(|&k| k > 0 && k.is_multiple_of(PIPE_K));
        let (bm, bn) = if pipe {
            (PIPE_ROWS, 0)
        } else if many {
            (MANY_ROWS, MANY_FEATURES)
        } else {
            (FEW_ROWS, FEW_FEATURES)
        };
        let max_tiles = pairs.div_ceil(bm) + pairs.min(e);
        let mut tile_expert = self.alloc_i32s(max_tiles);
        let mut sorted = self.alloc_i32s(max_tiles * bm);
        let mut num_tiles = self.alloc_i32s(1);
        let ds = self.ds();
        if owners.is_some() {
            check(self.stream.memset_zeros(ys), "memset");
        }
        let null = 0u64;
        let (pi, ki, ei, bmi) = (pairs as i32, k as i32, e as i32, bm as i32);
        let (replicas, rank) = owners.map_or((0, 0), |o| (o.replicas as i32, o.rank as i32));
        let mut counts_view = counts.slice_mut(counts_at..counts_at + e);
        // SAFETY: chosen holds `pairs` expert ids below e; owners (when given) e·(1 +
        // replicas) entries; counts e from counts_at; tile_expert and sorted are sized for
        // the most tiles `pairs` can make.
        let mut launch = self.stream.launch_builder(&ds.moe.align);
        launch.arg(chosen).arg(&pi).arg(&ki).arg(&ei);
        match owners {
            Some(o) => launch.arg(o.table),
            None => launch.arg(&null),
        };
        launch
            .arg(&replicas)
            .arg(&rank)
            .arg(&mut counts_view)
            .arg(&bmi)
            .arg(&mut tile_expert)
            .arg(&mut sorted)
            .arg(&mut num_tiles);
        check(
            unsafe { launch.launch(blocks(1, 1, 1024)) },
            "dsv4_moe_align",
        );
        let tiles = Tiles {
            sorted: &sorted,
            tile_expert: &tile_expert,
            num_tiles: &num_tiles,
            max_tiles,
        };
        if pipe {
            self.routed_experts_pipe(ys, x, t, &tiles, (tokens, k, limit));
            return;
        }

        let shape = if many { 2 } else { 0 };
        let pass = |pass: usize| &ds.moe.gemm[t.formats[pass]][shape + pass];
        let up = pass(0);
        let down = pass(1);
        let mut h = self.alloc_written(pairs * t.inter);
        let (inter, hidden) = (t.inter as i32, t.hidden as i32);
        let gemm = |f: &CudaFunction,
                    out: &mut CudaSlice<f32>,
                    input: &CudaSlice<f32>,
                    x_div: i32,
                    w: (&CudaSlice<u64>, &CudaSlice<u64>),
                    (n, kk): (i32, i32),
                    name: &str| {
            // SAFETY: input holds rows of kk values (pairs / x_div of them), out pairs rows
            // of n; the tables address e matrices of n × kk in the kernel's format.
            check(
                unsafe {
                    self.stream
                        .launch_builder(f)
                        .arg(out)
                        .arg(input)
                        .arg(&x_div)
                        .arg(&sorted)
                        .arg(&tile_expert)
                        .arg(&num_tiles)
                        .arg(w.0)
                        .arg(w.1)
                        .arg(&n)
                        .arg(&kk)
                        .arg(&limit)
                        .launch(blocks((n as usize).div_ceil(bn), max_tiles, 128))
                },
                name,
            );
        };
        gemm(
            up,
            &mut h,
            x,
            ki,
            (&t.gate, &t.up),
            (inter, hidden),
            "dsv4_moe_up",
        );
        gemm(
            down,
            ys,
            &h,
            1,
            (&t.down, &t.down),
            (hidden, inter),
            "dsv4_moe_down",
        );
    }

    /// `routed_experts` through `moe_pipe.cu` over tiles of `PIPE_ROWS`: the rows made bf16
    /// once, gate·up with SwiGLU into bf16 `h`, then down into `ys`.
    fn routed_experts_pipe(
        &self,
        ys: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        t: &CudaExperts,
        tiles: &Tiles<'_>,
        (tokens, k, limit): (usize, usize, f32),
    ) {
        let ds = self.ds();
        // SAFETY: bf16 has no invalid bit patterns; the up pass writes every row of h the
        // down pass reads (rows of pairs no tile holds are read by no one).
        let mut h = check(
            unsafe { self.stream.alloc::<bf16>((tokens * k * t.inter).max(1)) },
            "alloc",
        );
        // The rows as bf16 in the GEMMs' shared scratch, held until both passes are queued.
        let xb = self.to_bf16(x.device_ptr(&self.stream).0, tokens * t.hidden);
        let h_ptr = h.device_ptr_mut(&self.stream).0;
        let xb_ptr = xb
            .as_ref()
            .expect("converted above")
            .device_ptr(&self.stream)
            .0;
        let ys_ptr = ys.device_ptr_mut(&self.stream).0;
        let passes = [
            (
                h_ptr,
                xb_ptr,
                k as i32,
                (&t.gate, &t.up),
                (t.inter, t.hidden),
                "dsv4_moe_up_mxfp4_pipe",
            ),
            (
                ys_ptr,
                h_ptr,
                1,
                (&t.down, &t.down),
                (t.hidden, t.inter),
                "dsv4_moe_down_mxfp4_pipe",
            ),
        ];
        for (pass, (out, input, x_div, w, (n, kk), name)) in passes.into_iter().enumerate() {
            let (ni, ki) = (n as i32, kk as i32);
            // SAFETY: input holds rows of kk bf16 (pairs / x_div of them), out pairs rows
            // of n (bf16 for the up pass, f32 for down); the tables address e MXFP4
            // matrices of n × kk; the tiles come from the align launch before.
            check(
                unsafe {
                    self.stream
                        .launch_builder(&ds.moe.pipe[pass])
                        .arg(&out)
                        .arg(&input)
                        .arg(&x_div)
                        .arg(tiles.sorted)
                        .arg(tiles.tile_expert)
                        .arg(tiles.num_tiles)
                        .arg(w.0)
                        .arg(w.1)
                        .arg(&ni)
                        .arg(&ki)
                        .arg(&limit)
                        .launch(LaunchConfig {
                            shared_mem_bytes: PIPE_SMEM_BYTES as u32,
                            ..blocks(
                                n.div_ceil(PIPE_FEATURES[pass]),
                                tiles.max_tiles,
                                PIPE_THREADS,
                            )
                        })
                },
                name,
            );
        }
    }

    /// `routed_experts` as a GEMV a pair (`moe_gemv_mma.cu`): gate·up with
    /// SwiGLU into `h`, then down into `ys`; the up pass counts the pairs.
    fn routed_experts_gemv(
        &self,
        ys: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        chosen: &CudaSlice<u32>,
        t: &CudaExperts,
        counts: &mut cudarc::driver::CudaViewMut<'_, u32>,
        (tokens, k, limit): (usize, usize, f32),
    ) {
        let pairs = tokens * k;
        let ds = self.ds();
        let mut h = self.alloc_written(pairs * t.inter);
        // 16 rows a warp; the up pass's are 8 gate rows and their up rows.
        let features_per_block = |swiglu: bool| GEMV_WARPS * if swiglu { 8 } else { 16 };
        let (counts_ptr, _guard) = counts.device_ptr_mut(&self.stream);
        let gemv = |f: &CudaFunction,
                    out: &mut CudaSlice<f32>,
                    input: &CudaSlice<f32>,
                    x_div: i32,
                    w: (&CudaSlice<u64>, &CudaSlice<u64>),
                    counts: u64,
                    (n, kk, swiglu): (usize, usize, bool),
                    name: &str| {
            let (ni, ki) = (n as i32, kk as i32);
            // SAFETY: input holds rows of kk values (pairs / x_div of them), out pairs rows of
            // n; chosen `pairs` expert ids below the tables' length; the tables address MXFP4
            // matrices of n × kk, kk a multiple of 512 and at most 8192 (checked by the
            // caller); counts is null or holds the experts.
            check(
                unsafe {
                    self.stream
                        .launch_builder(f)
                        .arg(out)
                        .arg(input)
                        .arg(&x_div)
                        .arg(chosen)
                        .arg(w.0)
                        .arg(w.1)
                        .arg(&counts)
                        .arg(&ni)
                        .arg(&ki)
                        .arg(&limit)
                        .launch(LaunchConfig {
                            shared_mem_bytes: gemv_smem_bytes(kk) as u32,
                            ..blocks(
                                n.div_ceil(features_per_block(swiglu)),
                                pairs,
                                (32 * GEMV_WARPS) as u32,
                            )
                        })
                },
                name,
            );
        };
        let up = (t.inter, t.hidden, true);
        let (gate_up, down) = ((&t.gate, &t.up), (&t.down, &t.down));
        gemv(
            &ds.moe.gemv[0],
            &mut h,
            x,
            k as i32,
            gate_up,
            counts_ptr,
            up,
            "dsv4_moe_gemv_up",
        );
        let down_shape = (t.hidden, t.inter, false);
        gemv(
            &ds.moe.gemv[1],
            ys,
            &h,
            1,
            down,
            0,
            down_shape,
            "dsv4_moe_gemv_down",
        );
    }
}
