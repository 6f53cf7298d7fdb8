//! Qwen2.5-VL's vision transformer on the host, in f32: patches embedded (the Conv3d whose
//! stride is its kernel is a matmul over a flattened patch), 2-D RoPE over (row, column),
//! blocks attending within windows of merged patches except the full-attention ones, and
//! the merger folding each 2×2 patch group into one language-model token.

use rayon::prelude::*;
use serde_json::Value;

use super::VisionError;
use super::preprocess::ImagePatches;
use crate::kernels::cpu::CpuMatrix;
use crate::kernels::cpu::matmul::{gemm_f32, matmul};
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
        {
            return Err(bad(format!(
                "hidden_size {} over {} heads is not a head size divisible by 4",
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

    fn patch_len(&self) -> usize {
        3 * self.temporal_patch_size * self.patch_size * self.patch_size
    }
}

struct Linear {
    w: CpuMatrix,
    bias: Option<Vec<f32>>,
}

impl Linear {
    fn apply(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let n = self.w.rows();
        let mut out = vec![0f32; rows * n];
        matmul(x, rows, &self.w, &mut out, false);
        if let Some(b) = &self.bias {
            out.chunks_exact_mut(n)
                .for_each(|r| r.iter_mut().zip(b).for_each(|(o, b)| *o += b));
        }
        out
    }
}

struct Block {
    norm1: Vec<f32>,
    norm2: Vec<f32>,
    qkv: Linear,
    proj: Linear,
    gate: Linear,
    up: Linear,
    down: Linear,
}

pub struct VisionEncoder {
    pub cfg: VisionConfig,
    patch_embed: Linear,
    blocks: Vec<Block>,
    merger_norm: Vec<f32>,
    merger_fc1: Linear,
    merger_fc2: Linear,
    inv_freqs: Vec<f32>,
}

/// `visual.` in the hub's checkpoints, `model.visual.` as transformers 5 saves them.
const PREFIXES: [&str; 2] = ["visual.", "model.visual."];

impl VisionEncoder {
    pub fn load(cfg: VisionConfig, src: &dyn TensorSource) -> Result<VisionEncoder, VisionError> {
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
        let linear = |name: &str, n: usize, k: usize, bias: bool| -> Result<Linear, VisionError> {
            Ok(Linear {
                w: CpuMatrix::F32 {
                    rows: n,
                    cols: k,
                    data: get(&format!("{name}.weight"), &[n, k])?,
                },
                bias: bias
                    .then(|| get(&format!("{name}.bias"), &[n]))
                    .transpose()?,
            })
        };
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let (p, t) = (cfg.patch_size, cfg.temporal_patch_size);
        let patch_embed = Linear {
            w: CpuMatrix::F32 {
                rows: h,
                cols: cfg.patch_len(),
                data: get("patch_embed.proj.weight", &[h, 3, t, p, p])?,
            },
            bias: None,
        };
        let blocks = (0..cfg.depth)
            .map(|b| {
                let n = |s: &str| format!("blocks.{b}.{s}");
                Ok(Block {
                    norm1: get(&n("norm1.weight"), &[h])?,
                    norm2: get(&n("norm2.weight"), &[h])?,
                    qkv: linear(&n("attn.qkv"), 3 * h, h, true)?,
                    proj: linear(&n("attn.proj"), h, h, true)?,
                    gate: linear(&n("mlp.gate_proj"), i, h, true)?,
                    up: linear(&n("mlp.up_proj"), i, h, true)?,
                    down: linear(&n("mlp.down_proj"), h, i, true)?,
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
            merger_norm: get("merger.ln_q.weight", &[h])?,
            merger_fc1: linear("merger.mlp.0", h * m2, h * m2, true)?,
            merger_fc2: linear("merger.mlp.2", cfg.out_hidden_size, h * m2, true)?,
            patch_embed,
            blocks,
            inv_freqs,
            cfg,
        })
    }

    /// The language model's input rows for one image: `(tokens, out_hidden_size)`.
    pub fn encode(&self, image: &ImagePatches) -> Vec<f32> {
        self.encode_pixels(&image.values, image.grid)
    }

    /// `encode` of the processor's rows `values` for a `grid` of patches.
    pub fn encode_pixels(&self, values: &[f32], grid: [usize; 3]) -> Vec<f32> {
        let c = &self.cfg;
        let [gt, gh, gw] = grid;
        let n = gt * gh * gw;
        assert_eq!(values.len(), n * c.patch_len(), "patches of another shape");
        let (h, hd, m) = (c.hidden_size, c.head_dim(), c.spatial_merge_size);
        let unit = m * m;
        let order = window_order(grid, m, c.window_size / m / c.patch_size);
        // Patches, and their rotary rows, in window order (merge groups stay whole).
        let embedded = self.patch_embed.apply(values, n);
        let mut x = vec![0f32; n * h];
        for (dst, &group) in order.groups.iter().enumerate() {
            x[dst * unit * h..][..unit * h]
                .copy_from_slice(&embedded[group * unit * h..][..unit * h]);
        }
        let rope = self.rope_rows(grid, &order.groups);
        let full = vec![0, n];
        for (b, block) in self.blocks.iter().enumerate() {
            let bounds = if c.fullatt_block_indexes.contains(&b) {
                &full
            } else {
                &order.bounds
            };
            let normed = rms_norm(&x, &block.norm1, h);
            let qkv = block.qkv.apply(&normed, n);
            let attn = attention(&qkv, n, c.num_heads, hd, &rope, bounds);
            let out = block.proj.apply(&attn, n);
            x.iter_mut().zip(&out).for_each(|(x, o)| *x += o);
            let normed = rms_norm(&x, &block.norm2, h);
            let mut gate = block.gate.apply(&normed, n);
            let up = block.up.apply(&normed, n);
            gate.iter_mut()
                .zip(&up)
                .for_each(|(g, u)| *g = *g / (1.0 + (-*g).exp()) * u);
            let out = block.down.apply(&gate, n);
            x.iter_mut().zip(&out).for_each(|(x, o)| *x += o);
        }
        let merged = rms_norm(&x, &self.merger_norm, h);
        let mut hidden = self.merger_fc1.apply(&merged, n / unit);
        hidden.iter_mut().for_each(|v| *v = gelu(*v));
        let out = self.merger_fc2.apply(&hidden, n / unit);
        // Back from window order to the image's.
        let d = c.out_hidden_size;
        let mut tokens = vec![0f32; out.len()];
        for (src, &group) in order.groups.iter().enumerate() {
            tokens[group * d..][..d].copy_from_slice(&out[src * d..][..d]);
        }
        tokens
    }

    /// Per patch (in window order) the head's cos and sin: the first half of the
    /// frequencies turn with the patch's row, the second with its column, repeated over
    /// both halves of the head as `rotate_half` pairs them.
    fn rope_rows(&self, [gt, gh, gw]: [usize; 3], groups: &[usize]) -> Vec<(Vec<f32>, Vec<f32>)> {
        let m = self.cfg.spatial_merge_size;
        let per_frame = gh * gw / (m * m);
        let mut rows = Vec::with_capacity(gt * gh * gw);
        for &group in groups {
            let g = group % per_frame;
            let (bh, bw) = (g / (gw / m), g % (gw / m));
            for (mh, mw) in (0..m).flat_map(|a| (0..m).map(move |b| (a, b))) {
                let (r, col) = ((bh * m + mh) as f32, (bw * m + mw) as f32);
                let angles: Vec<f32> = self
                    .inv_freqs
                    .iter()
                    .map(|f| r * f)
                    .chain(self.inv_freqs.iter().map(|f| col * f))
                    .collect();
                let cos: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
                let sin: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
                rows.push((cos, sin));
            }
        }
        rows
    }
}

/// The merge groups of an image in window order (each window's groups row-major,
/// windows row-major, frame after frame), and the windows' bounds in patches.
struct WindowOrder {
    groups: Vec<usize>,
    bounds: Vec<usize>,
}

fn window_order([gt, gh, gw]: [usize; 3], merge: usize, window: usize) -> WindowOrder {
    let (lh, lw) = (gh / merge, gw / merge);
    let mut groups = Vec::with_capacity(gt * lh * lw);
    let mut bounds = vec![0];
    for t in 0..gt {
        for wy in (0..lh).step_by(window) {
            for wx in (0..lw).step_by(window) {
                for y in wy..(wy + window).min(lh) {
                    for x in wx..(wx + window).min(lw) {
                        groups.push(t * lh * lw + y * lw + x);
                    }
                }
                bounds.push(groups.len() * merge * merge);
            }
        }
    }
    WindowOrder { groups, bounds }
}

fn rms_norm(x: &[f32], w: &[f32], width: usize) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    out.par_chunks_exact_mut(width)
        .zip(x.par_chunks_exact(width))
        .for_each(|(o, r)| {
            let ms = r.iter().map(|v| v * v).sum::<f32>() / width as f32;
            let inv = 1.0 / (ms + NORM_EPS).sqrt();
            o.iter_mut()
                .zip(r.iter().zip(w))
                .for_each(|(o, (v, w))| *o = w * (v * inv));
        });
    out
}

/// GELU as `nn.GELU()` computes it: with the error function, not the tanh fit.
fn gelu(x: f32) -> f32 {
    let x = f64::from(x);
    (0.5 * x * (1.0 + libm::erf(x / std::f64::consts::SQRT_2))) as f32
}

/// Non-causal attention of each window (`bounds`) over itself, after RoPE on q and k;
/// `qkv` rows are `[q heads | k heads | v heads]`.
fn attention(
    qkv: &[f32],
    n: usize,
    heads: usize,
    hd: usize,
    rope: &[(Vec<f32>, Vec<f32>)],
    bounds: &[usize],
) -> Vec<f32> {
    let h = heads * hd;
    let half = hd / 2;
    let rotate = |v: &[f32], (cos, sin): &(Vec<f32>, Vec<f32>)| -> Vec<f32> {
        (0..hd)
            .map(|d| {
                let (c, s) = (cos[d % half], sin[d % half]);
                let rot = if d < half { -v[d + half] } else { v[d - half] };
                v[d] * c + rot * s
            })
            .collect()
    };
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0f32; n * h];
    let windows: Vec<(usize, usize)> = bounds.windows(2).map(|w| (w[0], w[1])).collect();
    let results: Vec<(usize, Vec<f32>)> = windows
        .par_iter()
        .flat_map_iter(|&(lo, hi)| (0..heads).map(move |head| (lo, hi, head)))
        .map(|(lo, hi, head)| {
            let q: Vec<Vec<f32>> = (lo..hi)
                .map(|t| rotate(&qkv[t * 3 * h + head * hd..][..hd], &rope[t]))
                .collect();
            let k: Vec<Vec<f32>> = (lo..hi)
                .map(|t| rotate(&qkv[t * 3 * h + h + head * hd..][..hd], &rope[t]))
                .collect();
            let len = hi - lo;
            let (q, k): (Vec<f32>, Vec<f32>) = (q.concat(), k.concat());
            // V transposed: the second GEMM's weight rows are V's columns.
            let mut vt = vec![0f32; hd * len];
            for j in 0..len {
                let v = &qkv[(lo + j) * 3 * h + 2 * h + head * hd..][..hd];
                for (d, &x) in v.iter().enumerate() {
                    vt[d * len + j] = x;
                }
            }
            // Scores and the weighted values as GEMMs on this thread (the pool is busy
            // with the other windows and heads).
            let mut scores = vec![0f32; len * len];
            // SAFETY: `scores` holds len × len, `q` and `k` len × hd each.
            unsafe { gemm_f32(&q, len, &k, len, hd, len, scores.as_mut_ptr(), 1) };
            for row in scores.chunks_exact_mut(len) {
                let max = row.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s * scale));
                let mut total = 0f32;
                row.iter_mut().for_each(|s| {
                    *s = (*s * scale - max).exp();
                    total += *s;
                });
                row.iter_mut().for_each(|s| *s /= total);
            }
            let mut block = vec![0f32; len * hd];
            // SAFETY: `block` holds len × hd, `scores` len × len, `vt` hd × len.
            unsafe { gemm_f32(&scores, len, &vt, hd, len, hd, block.as_mut_ptr(), 1) };
            (lo * h + head * hd, block)
        })
        .collect();
    for (start, block) in results {
        for (i, row) in block.chunks_exact(hd).enumerate() {
            out[start + i * h..][..hd].copy_from_slice(row);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_order_covers_every_group_once() {
        for grid in [[1, 4, 4], [1, 10, 6], [1, 18, 34], [2, 8, 8]] {
            let order = window_order(grid, 2, 4);
            let mut seen = order.groups.clone();
            seen.sort_unstable();
            assert_eq!(
                seen,
                (0..grid.iter().product::<usize>() / 4).collect::<Vec<_>>()
            );
            assert_eq!(
                *order.bounds.last().unwrap(),
                grid.iter().product::<usize>()
            );
            assert!(
                order
                    .bounds
                    .windows(2)
                    .all(|w| w[1] > w[0] && w[1] - w[0] <= 64)
            );
        }
    }
}
