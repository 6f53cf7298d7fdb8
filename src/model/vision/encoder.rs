//! Qwen2.5-VL's vision transformer on any backend (the host in f32, the GPU): patches
//! embedded (the Conv3d whose stride is its kernel is a matmul over a flattened patch),
//! 2-D RoPE over (row, column), blocks attending within windows of merged patches except
//! the full-attention ones, and the merger folding each 2×2 patch group into one
//! language-model token. Patches enter in window order (each embeds alone) and the rows
//! leave in the image's.

use serde_json::Value;

use super::VisionError;
use super::preprocess::ImagePatches;
use super::windows::{rope_table, window_order};
use crate::kernels::cpu::CpuBackend;
use crate::kernels::{Backend, HostData, HostMatrix};
use crate::model::loader::TensorSource;

/// `vision_config` of a Qwen2.5-VL `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    pub depth: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub spatial_merge_size: usize,
    pub window_size: usize,
    pub fullatt_block_indexes: Vec<usize>,
    pub out_hidden_size: usize,
    pub rope_theta: f64,
}

const NORM_EPS: f32 = 1e-6;

impl VisionConfig {
    pub fn from_hf_json(json: &Value) -> Result<VisionConfig, VisionError> {
        let v = &json["vision_config"];
        let bad = |m: String| VisionError::Config(format!("config.json vision_config: {m}"));
        if !v.is_object() {
            return Err(bad("missing".into()));
        }
        let int = |k: &str, default: Option<usize>| -> Result<usize, VisionError> {
            match v[k].as_u64() {
                Some(n) => Ok(n as usize),
                None => default.ok_or_else(|| bad(format!("missing integer `{k}`"))),
            }
        };
        if let Some(act) = v["hidden_act"].as_str().filter(|a| *a != "silu") {
            return Err(bad(format!("hidden_act `{act}` is not built (silu)")));
        }
        let cfg = VisionConfig {
            depth: int("depth", None)?,
            hidden_size: int("hidden_size", None)?,
            intermediate_size: int("intermediate_size", None)?,
            num_heads: int("num_heads", None)?,
            patch_size: int("patch_size", Some(14))?,
            temporal_patch_size: int("temporal_patch_size", Some(2))?,
            spatial_merge_size: int("spatial_merge_size", Some(2))?,
            window_size: int("window_size", Some(112))?,
            fullatt_block_indexes: v["fullatt_block_indexes"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|x| x.as_u64())
                        .map(|x| x as usize)
                        .collect()
                })
                .unwrap_or_default(),
            out_hidden_size: int("out_hidden_size", None)?,
            rope_theta: v["rope_parameters"]["rope_theta"]
                .as_f64()
                .or_else(|| v["rope_theta"].as_f64())
                .unwrap_or(10_000.0),
        };
        let head_dim = cfg.hidden_size / cfg.num_heads.max(1);
        if cfg.num_heads == 0
            || !cfg.hidden_size.is_multiple_of(cfg.num_heads)
            || !head_dim.is_multiple_of(4)
            || head_dim > 128
        {
            return Err(bad(format!(
                "hidden_size {} over {} heads is not a head size divisible by 4, at most 128",
                cfg.hidden_size, cfg.num_heads
            )));
        }
        let unit = cfg.spatial_merge_size * cfg.patch_size;
        if cfg.spatial_merge_size == 0
            || cfg.window_size < unit
            || !cfg.window_size.is_multiple_of(unit)
        {
            return Err(bad(format!(
                "window_size {} is not a multiple of merge × patch ({unit})",
                cfg.window_size
            )));
        }
        if cfg.hidden_size > 1 << 16 || cfg.intermediate_size > 1 << 18 || cfg.depth > 1024 {
            return Err(bad("sizes beyond any released encoder".into()));
        }
        Ok(cfg)
    }

    fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    /// Values of one patch (3 × temporal patch × patch²).
    pub fn patch_len(&self) -> usize {
        3 * self.temporal_patch_size * self.patch_size * self.patch_size
    }
}

/// A projection: `x · wᵀ + bias`.
struct Linear<B: Backend> {
    w: B::Matrix,
    bias: Option<B::Buf>,
}

impl<B: Backend> Linear<B> {
    fn apply(&self, backend: &B, x: &B::Buf, rows: usize, out: &mut B::Buf) {
        backend.matmul(x, rows, &self.w, self.bias.as_ref(), out);
    }
}

struct Block<B: Backend> {
    norm1: B::Buf,
    norm2: B::Buf,
    qkv: Linear<B>,
    proj: Linear<B>,
    /// The gate's and the up projection's rows stacked, as `Backend::silu_mul` reads them.
    gate_up: Linear<B>,
    down: Linear<B>,
}

/// The encoder's weights on `backend`; by default the host's, in f32.
pub struct VisionEncoder<B: Backend = CpuBackend> {
    pub cfg: VisionConfig,
    backend: B,
    patch_embed: B::Matrix,
    blocks: Vec<Block<B>>,
    merger_norm: B::Buf,
    merger_fc1: Linear<B>,
    merger_fc2: Linear<B>,
    inv_freqs: Vec<f32>,
}

/// `visual.` in the hub's checkpoints, `model.visual.` as transformers 5 saves them.
const PREFIXES: [&str; 2] = ["visual.", "model.visual."];

impl VisionEncoder {
    /// The encoder on the host, its activations exact f32 as transformers' reference runs.
    pub fn load(cfg: VisionConfig, src: &dyn TensorSource) -> Result<VisionEncoder, VisionError> {
        let host = CpuBackend {
            exact_activations: true,
            ..CpuBackend::default()
        };
        VisionEncoder::load_on(cfg, src, host)
    }
}

impl<B: Backend> VisionEncoder<B> {
    pub fn load_on(
        cfg: VisionConfig,
        src: &dyn TensorSource,
        backend: B,
    ) -> Result<VisionEncoder<B>, VisionError> {
        let prefix = PREFIXES
            .iter()
            .find(|p| matches!(src.tensor(&format!("{p}merger.ln_q.weight")), Ok(Some(_))))
            .ok_or_else(|| VisionError::Weights("no `visual.merger.ln_q.weight`".into()))?;
        let get = |name: &str, dims: &[usize]| -> Result<Vec<f32>, VisionError> {
            let full = format!("{prefix}{name}");
            let t = src
                .tensor(&full)
                .map_err(|e| VisionError::Weights(e.to_string()))?
                .ok_or_else(|| VisionError::Weights(format!("missing `{full}`")))?;
            if t.dims != dims {
                return Err(VisionError::Weights(format!(
                    "`{full}` is {:?}, expected {dims:?}",
                    t.dims
                )));
            }
            Ok(t.into_f32())
        };
        let b = &backend;
        let matrix = |rows: usize, cols: usize, data: Vec<f32>| {
            let data = HostData::F32(data);
            b.upload_matrix(HostMatrix { rows, cols, data })
        };
        // Several checkpoint projections stacked by rows (q/k/v come stacked already).
        let stacked = |names: &[&str], n: usize, k: usize| -> Result<Linear<B>, VisionError> {
            let (mut w, mut bias) = (Vec::new(), Vec::new());
            for name in names {
                w.extend(get(&format!("{name}.weight"), &[n, k])?);
                bias.extend(get(&format!("{name}.bias"), &[n])?);
            }
            Ok(Linear {
                w: matrix(n * names.len(), k, w),
                bias: Some(b.upload(&bias)),
            })
        };
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let (p, t) = (cfg.patch_size, cfg.temporal_patch_size);
        let patch_embed = matrix(
            h,
            cfg.patch_len(),
            get("patch_embed.proj.weight", &[h, 3, t, p, p])?,
        );
        let blocks = (0..cfg.depth)
            .map(|l| {
                let n = |s: &str| format!("blocks.{l}.{s}");
                Ok(Block {
                    norm1: b.upload(&get(&n("norm1.weight"), &[h])?),
                    norm2: b.upload(&get(&n("norm2.weight"), &[h])?),
                    qkv: stacked(&[&n("attn.qkv")], 3 * h, h)?,
                    proj: stacked(&[&n("attn.proj")], h, h)?,
                    gate_up: stacked(&[&n("mlp.gate_proj"), &n("mlp.up_proj")], i, h)?,
                    down: stacked(&[&n("mlp.down_proj")], h, i)?,
                })
            })
            .collect::<Result<Vec<_>, VisionError>>()?;
        let m2 = cfg.spatial_merge_size * cfg.spatial_merge_size;
        // The axial RoPE's frequencies: a quarter of the head for rows, a quarter for columns.
        let spatial = cfg.head_dim() / 2;
        let inv_freqs = (0..spatial / 2)
            .map(|j| {
                let exponent = (2 * j) as f32 / spatial as f32;
                (1.0 / cfg.rope_theta.powf(f64::from(exponent))) as f32
            })
            .collect();
        Ok(VisionEncoder {
            merger_norm: b.upload(&get("merger.ln_q.weight", &[h])?),
            merger_fc1: stacked(&["merger.mlp.0"], h * m2, h * m2)?,
            merger_fc2: stacked(&["merger.mlp.2"], cfg.out_hidden_size, h * m2)?,
            patch_embed,
            blocks,
            inv_freqs,
            cfg,
            backend,
        })
    }

    /// The language model's input rows for one image: `(tokens, out_hidden_size)`.
    pub fn encode(&self, image: &ImagePatches) -> Vec<f32> {
        self.encode_pixels(&image.values, image.grid)
    }

    /// `encode` of the processor's rows `values` for a `grid` of patches.
    pub fn encode_pixels(&self, values: &[f32], grid: [usize; 3]) -> Vec<f32> {
        self.encode_batch(&[(values, grid)]).remove(0)
    }

    /// Several images' rows from one pass (each image's attention its own): the encoder's
    /// batch, its GEMMs as tall as the images together.
    pub fn encode_batch(&self, images: &[(&[f32], [usize; 3])]) -> Vec<Vec<f32>> {
        let (b, c) = (&self.backend, &self.cfg);
        let pl = c.patch_len();
        let (h, i, heads, hd) = (
            c.hidden_size,
            c.intermediate_size,
            c.num_heads,
            c.head_dim(),
        );
        let m = c.spatial_merge_size;
        let unit = m * m;
        // Patches in window order, image after image (merge groups stay whole; each patch
        // embeds alone), with each image's windows and its whole as segments.
        let (mut ordered, mut table, mut orders) = (Vec::new(), Vec::new(), Vec::new());
        let (mut windows, mut wholes) = (vec![0], vec![0]);
        for &(values, grid) in images {
            let n = grid.iter().product::<usize>();
            assert_eq!(values.len(), n * pl, "patches of another shape");
            let base = *wholes.last().expect("a bound");
            let order = window_order(grid, m, c.window_size / m / c.patch_size);
            for &group in &order.groups {
                ordered.extend_from_slice(&values[group * unit * pl..][..unit * pl]);
            }
            table.extend(rope_table(grid, m, &order.groups, &self.inv_freqs));
            windows.extend(order.bounds[1..].iter().map(|w| base + w));
            wholes.push(base + n);
            orders.push(order);
        }
        let n = *wholes.last().expect("a bound");
        let mut x = b.alloc(n * h);
        b.matmul(&b.upload(&ordered), n, &self.patch_embed, None, &mut x);
        let table = b.upload(&table);
        let positions: Vec<u32> = (0..n as u32).collect();
        let [mut normed, mut q, mut k, mut v, mut attn, mut out] = [(); 6].map(|_| b.alloc(n * h));
        let (mut qkv, mut gate_up, mut act) =
            (b.alloc(n * 3 * h), b.alloc(n * 2 * i), b.alloc(n * i));
        for (l, block) in self.blocks.iter().enumerate() {
            let bounds = match c.fullatt_block_indexes.contains(&l) {
                true => &wholes,
                false => &windows,
            };
            b.rms_norm(&x, &block.norm1, NORM_EPS, n, h, &mut normed);
            block.qkv.apply(b, &normed, n, &mut qkv);
            b.copy_columns(&qkv, 3 * h, 0, h, n, &mut q);
            b.copy_columns(&qkv, 3 * h, h, h, n, &mut k);
            b.copy_columns(&qkv, 3 * h, 2 * h, h, n, &mut v);
            b.rope(&mut q, &positions, heads, hd, &table);
            b.rope(&mut k, &positions, heads, hd, &table);
            b.segment_attention(&q, &k, &v, bounds, heads, hd, &mut attn);
            block.proj.apply(b, &attn, n, &mut out);
            b.add(&mut x, &out, n * h);
            b.rms_norm(&x, &block.norm2, NORM_EPS, n, h, &mut normed);
            block.gate_up.apply(b, &normed, n, &mut gate_up);
            b.silu_mul(&gate_up, n, i, &mut act);
            block.down.apply(b, &act, n, &mut out);
            b.add(&mut x, &out, n * h);
        }
        // The merger reads each merge group's rows as one.
        let (groups, d) = (n / unit, c.out_hidden_size);
        b.rms_norm(&x, &self.merger_norm, NORM_EPS, n, h, &mut normed);
        let mut hidden = b.alloc(n * h);
        self.merger_fc1.apply(b, &normed, groups, &mut hidden);
        b.gelu(&mut hidden, n * h);
        let mut merged = b.alloc(groups * d);
        self.merger_fc2.apply(b, &hidden, groups, &mut merged);
        let rows = b.download(&merged, groups * d);
        // Each image's rows, back from window order to the image's.
        (orders.iter().zip(&wholes))
            .map(|(order, &base)| {
                let first = base / unit;
                let mut tokens = vec![0f32; order.groups.len() * d];
                for (src, &group) in order.groups.iter().enumerate() {
                    tokens[group * d..][..d].copy_from_slice(&rows[(first + src) * d..][..d]);
                }
                tokens
            })
            .collect()
    }
}
