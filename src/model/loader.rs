//! Where weights come from: a GGUF file or an HF directory of safetensors (single or
//! sharded), both memory-mapped. Each source answers by transformers' tensor names and
//! hands out row-major f32 data, so the model code never sees a file format.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use super::config::Arch;
use super::gguf::GgufFile;
use crate::error::{Result, TroupeError};
use crate::kernels::HostData;
use crate::kernels::fp8::Fp8Matrix;
use crate::kernels::quant::GgmlType;

/// A tensor in host memory: row-major, outermost dimension first.
pub struct HostTensor {
    pub dims: Vec<usize>,
    pub data: HostData,
    /// The checkpoint's element type where it is not implied by `data`: FP8 and packed
    /// FP4 weights and their E8M0 / U8 scales arrive as f32 values (exact) and the model
    /// needs to know which they were.
    pub stored: Stored,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    AsData,
    /// FP8 e4m3fn, decoded.
    F8E4M3,
    /// Power-of-two exponents (E8M0), decoded to 2^(e-127).
    F8E8M0,
    /// Raw bytes as integers: `I8` / `U8` tensors (packed FP4 weights, E8M0 scale bytes).
    I8,
    U8,
}

impl HostTensor {
    pub fn num_elements(&self) -> usize {
        self.dims.iter().product()
    }
    pub fn into_f32(self) -> Vec<f32> {
        let n = self.num_elements();
        self.data.into_f32(n)
    }
}

pub trait TensorSource {
    /// The tensor named as transformers names it, or `None` when the checkpoint lacks it.
    fn tensor(&self, hf_name: &str) -> Result<Option<HostTensor>>;
}

/// transformers' name → llama.cpp's GGUF name.
fn gguf_name(hf_name: &str) -> Option<String> {
    let fixed = match hf_name {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = hf_name.strip_prefix("model.layers.")?;
    let (layer, suffix) = rest.split_once('.')?;
    let mapped = match suffix {
        "input_layernorm.weight" => "attn_norm.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.q_proj.bias" => "attn_q.bias",
        "self_attn.k_proj.bias" => "attn_k.bias",
        "self_attn.v_proj.bias" => "attn_v.bias",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "self_attn.q_norm.weight" => "attn_q_norm.weight",
        "self_attn.k_norm.weight" => "attn_k_norm.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        _ => return None,
    };
    Some(format!("blk.{layer}.{mapped}"))
}

pub struct GgufSource<'a> {
    pub gguf: &'a GgufFile,
    pub arch: Arch,
    pub num_heads: usize,
    pub num_kv_heads: usize,
}

impl GgufSource<'_> {
    fn load_raw(&self, name: &str) -> Result<Option<HostTensor>> {
        let Some(info) = self.gguf.tensor_info(name) else {
            return Ok(None);
        };
        let bytes = self.gguf.tensor_bytes(info);
        let data = match info.ggml_type {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
                let mut v = vec![0f32; info.num_elements()];
                crate::kernels::quant::dequantize(info.ggml_type, bytes, &mut v);
                HostData::F32(v)
            }
            ggml_type => HostData::Quantized {
                ggml_type,
                bytes: self.gguf.copy_out(info),
            },
        };
        self.gguf.release(info);
        let dims = info.dims.iter().rev().map(|&d| d as usize).collect();
        Ok(Some(HostTensor {
            dims,
            data,
            stored: Stored::AsData,
        }))
    }

    /// llama.cpp's converter permutes Llama's q/k rows so its kernels can rotate adjacent
    /// pairs; undo it so every source uses the half-split rotation transformers uses.
    /// Rows are whole blocks in every format, so the permutation moves bytes.
    fn unpermute_rows(t: &mut HostTensor, num_heads: usize, name: &str) -> Result<()> {
        let rows = t.dims.first().copied().unwrap_or(0);
        // Found by fuzzing: a tensor of no rows divided by zero here. The shape must be
        // whole heads of even size before bytes move.
        let bytes_len = match &t.data {
            HostData::F32(v) => v.len() * 4,
            HostData::Bf16(v) => v.len() * 2,
            HostData::Quantized { bytes, .. } => bytes.len(),
            _ => 0,
        };
        if num_heads == 0
            || rows == 0
            || !rows.is_multiple_of(num_heads)
            || !(rows / num_heads).is_multiple_of(2)
            || !bytes_len.is_multiple_of(rows)
        {
            return Err(TroupeError::Tensor {
                name: name.to_string(),
                reason: format!(
                    "{rows} rows are not {num_heads} heads of an even size ({bytes_len} bytes)"
                ),
            });
        }
        let head_dim = rows / num_heads;
        let half = head_dim / 2;
        let permute = |data: &mut [u8]| {
            let row_bytes = data.len() / rows;
            let src = data.to_vec();
            for h in 0..num_heads {
                for i in 0..half {
                    for j in 0..2 {
                        let from = h * head_dim + 2 * i + j;
                        let to = h * head_dim + j * half + i;
                        data[to * row_bytes..(to + 1) * row_bytes]
                            .copy_from_slice(&src[from * row_bytes..(from + 1) * row_bytes]);
                    }
                }
            }
        };
        match &mut t.data {
            HostData::F32(v) => {
                let mut bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                permute(&mut bytes);
                *v = bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                    .collect();
            }
            HostData::Quantized { bytes, .. } => permute(bytes),
            HostData::Bf16(v) => {
                let mut bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                permute(&mut bytes);
                *v = bytes
                    .chunks_exact(2)
                    .map(|b| bf16::from_le_bytes([b[0], b[1]]))
                    .collect();
            }
            // A permutation of random values is random values.
            HostData::Random { .. } | HostData::RandomMxfp4 { .. } => {}
            HostData::Stacked(_)
            | HostData::Fp8(_)
            | HostData::Mxfp4(_)
            | HostData::ToFp8 { .. } => {
                unreachable!("a GGUF tensor is never stacked, FP8 or MXFP4")
            }
        }
        Ok(())
    }

    /// Llama 3's frequency factors, stored by llama.cpp as a tensor.
    pub fn rope_freq_factors(&self) -> Result<Option<Vec<f32>>> {
        Ok(self
            .load_raw("rope_freqs.weight")?
            .map(HostTensor::into_f32))
    }
}

impl TensorSource for GgufSource<'_> {
    fn tensor(&self, hf_name: &str) -> Result<Option<HostTensor>> {
        let Some(name) = gguf_name(hf_name) else {
            return Ok(None);
        };
        let Some(mut t) = self.load_raw(&name)? else {
            return Ok(None);
        };
        if self.arch == Arch::Llama {
            if name.ends_with("attn_q.weight") || name.ends_with("attn_q.bias") {
                Self::unpermute_rows(&mut t, self.num_heads, &name)?;
            } else if name.ends_with("attn_k.weight") || name.ends_with("attn_k.bias") {
                Self::unpermute_rows(&mut t, self.num_kv_heads, &name)?;
            }
        }
        Ok(Some(t))
    }
}

pub struct SafetensorsSource {
    maps: Vec<(PathBuf, Mmap)>,
    /// Tensor name as asked for → index into `maps` and the name in that file.
    index: HashMap<String, (usize, String)>,
}

impl SafetensorsSource {
    pub fn open_dir(dir: &Path) -> Result<Self> {
        let single = dir.join("model.safetensors");
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if single.exists() {
            vec![single]
        } else if index_path.exists() {
            let text = std::fs::read_to_string(&index_path)
                .map_err(|e| TroupeError::io(&index_path, e))?;
            let json: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| TroupeError::ModelFormat {
                    path: index_path.clone(),
                    reason: format!("invalid JSON: {e}"),
                })?;
            let map = json["weight_map"]
                .as_object()
                .ok_or_else(|| TroupeError::ModelFormat {
                    path: index_path.clone(),
                    reason: "no `weight_map` object".into(),
                })?;
            let mut shards = Vec::with_capacity(map.len());
            for file in map.values() {
                // A shard is a file of this directory: a name that climbs out of it
                // (`../`, an absolute path) would read whatever it names.
                let name = file.as_str().filter(|f| {
                    let mut parts = Path::new(f).components();
                    matches!(parts.next(), Some(std::path::Component::Normal(_)))
                        && parts.next().is_none()
                });
                let Some(name) = name else {
                    return Err(TroupeError::ModelFormat {
                        path: index_path.clone(),
                        reason: format!("shard {file} is not a file name of the model's directory"),
                    });
                };
                shards.push(dir.join(name));
            }
            shards.sort();
            shards.dedup();
            shards
        } else {
            return Err(TroupeError::ModelFormat {
                path: dir.to_path_buf(),
                reason: "no model.safetensors or model.safetensors.index.json".into(),
            });
        };
        let mut maps = Vec::new();
        let mut index = HashMap::new();
        for path in files {
            let file = File::open(&path).map_err(|e| TroupeError::io(&path, e))?;
            // SAFETY: read-only map held for the lifetime of the source.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|e| TroupeError::io(&path, e))?;
            let st = SafeTensors::deserialize(&mmap).map_err(|e| TroupeError::ModelFormat {
                path: path.clone(),
                reason: format!("invalid safetensors: {e}"),
            })?;
            for name in st.names() {
                // transformers 5 saves a vision-language model's language half under
                // `model.language_model.`; the hub's files and the loader say `model.`.
                if let Some(rest) = name.strip_prefix("model.language_model.") {
                    index.insert(format!("model.{rest}"), (maps.len(), name.to_string()));
                }
                index.insert(name.to_string(), (maps.len(), name.to_string()));
            }
            maps.push((path, mmap));
        }
        Ok(SafetensorsSource { maps, index })
    }
}

impl TensorSource for SafetensorsSource {
    fn tensor(&self, hf_name: &str) -> Result<Option<HostTensor>> {
        let Some((i, stored_name)) = self.index.get(hf_name) else {
            return Ok(None);
        };
        let (i, hf_name) = (*i, stored_name.as_str());
        let (path, mmap) = &self.maps[i];
        let bad = |reason: String| TroupeError::ModelFormat {
            path: path.clone(),
            reason,
        };
        let st = SafeTensors::deserialize(mmap).map_err(|e| bad(e.to_string()))?;
        let view = st.tensor(hf_name).map_err(|e| bad(e.to_string()))?;
        let bytes = view.data();
        if view.dtype() == Dtype::BF16 {
            return Ok(Some(HostTensor {
                dims: view.shape().to_vec(),
                stored: Stored::AsData,
                data: HostData::Bf16(
                    bytes
                        .chunks_exact(2)
                        .map(|b| bf16::from_le_bytes([b[0], b[1]]))
                        .collect(),
                ),
            }));
        }
        if view.dtype() == Dtype::F8_E4M3 {
            // Kept as bytes: the model attaches the scale grid, and a backend with FP8
            // kernels keeps it packed.
            let cols = view.shape().last().copied().unwrap_or(1);
            return Ok(Some(HostTensor {
                dims: view.shape().to_vec(),
                stored: Stored::F8E4M3,
                data: HostData::Fp8(Fp8Matrix::unscaled(bytes.to_vec(), cols)),
            }));
        }
        let data: Vec<f32> = match view.dtype() {
            Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect(),
            Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            // Index tables (DeepSeek-V4's token → expert map): small integers, exact in f32.
            Dtype::I64 => bytes
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as f32)
                .collect(),
            Dtype::I32 => bytes
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes(b.try_into().unwrap()) as f32)
                .collect(),
            Dtype::F8_E8M0 => bytes.iter().map(|&b| e8m0_to_f32(b)).collect(),
            Dtype::I8 => bytes.iter().map(|&b| b as i8 as f32).collect(),
            Dtype::U8 => bytes.iter().map(|&b| b as f32).collect(),
            other => {
                return Err(bad(format!(
                    "tensor `{hf_name}` has unsupported dtype {other:?}"
                )));
            }
        };
        let stored = match view.dtype() {
            Dtype::F8_E8M0 => Stored::F8E8M0,
            Dtype::I8 => Stored::I8,
            Dtype::U8 => Stored::U8,
            _ => Stored::AsData,
        };
        Ok(Some(HostTensor {
            dims: view.shape().to_vec(),
            data: HostData::F32(data),
            stored,
        }))
    }
}

/// `--dummy-weights`: every tensor the config implies, as seeded random values (norm
/// weights around 1, the rest around 0); nothing is read from disk.
pub struct DummySource {
    pub config: super::config::ModelConfig,
}

impl DummySource {
    fn dims(&self, name: &str) -> Option<Vec<usize>> {
        let c = &self.config;
        let (h, q, kv, ff) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let leaf = name.rsplit_once(".layers.").map_or(name, |(_, rest)| {
            rest.split_once('.').map_or(rest, |(_, leaf)| leaf)
        });
        Some(match (name, leaf) {
            ("model.embed_tokens.weight", _) => vec![c.vocab_size, h],
            ("lm_head.weight", _) if !c.tie_word_embeddings => vec![c.vocab_size, h],
            ("lm_head.weight", _) => return None,
            ("model.norm.weight", _) => vec![h],
            (_, "input_layernorm.weight" | "post_attention_layernorm.weight") => vec![h],
            (_, "self_attn.q_proj.weight") => vec![q, h],
            (_, "self_attn.k_proj.weight" | "self_attn.v_proj.weight") => vec![kv, h],
            (_, "self_attn.o_proj.weight") => vec![h, q],
            (_, "self_attn.q_proj.bias") if c.attention_bias => vec![q],
            (_, "self_attn.k_proj.bias" | "self_attn.v_proj.bias") if c.attention_bias => {
                vec![kv]
            }
            (_, "self_attn.q_norm.weight" | "self_attn.k_norm.weight")
                if c.arch == super::config::Arch::Qwen3 =>
            {
                vec![c.head_dim]
            }
            (_, "mlp.gate_proj.weight" | "mlp.up_proj.weight") => vec![ff, h],
            (_, "mlp.down_proj.weight") => vec![h, ff],
            _ => return None,
        })
    }
}

impl TensorSource for DummySource {
    fn tensor(&self, hf_name: &str) -> Result<Option<HostTensor>> {
        let Some(dims) = self.dims(hf_name) else {
            return Ok(None);
        };
        let seed = hf_name
            .bytes()
            .fold(0x7e57_u64, |h, b| crate::sampling::splitmix64(h ^ b as u64));
        let is_norm = hf_name.ends_with("norm.weight");
        // Uniform with std 0.02 (as transformers' initializer_range) for projections.
        let (mean, half_width) = if is_norm {
            (1.0, 0.05)
        } else {
            (0.0, 0.02 * 3f32.sqrt())
        };
        Ok(Some(HostTensor {
            stored: Stored::AsData,
            dims,
            data: HostData::Random {
                seed,
                mean,
                half_width,
            },
        }))
    }
}

/// An E8M0 scale: 2^(b - 127); 0xFF is NaN.
pub fn e8m0_to_f32(b: u8) -> f32 {
    if b == 0xFF {
        f32::NAN
    } else {
        2f32.powi(b as i32 - 127)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by fuzzing: a q projection of no rows divided by zero while its rows were
    /// unpermuted; rows that are not whole heads of even size are refused too, naming the
    /// tensor, and a well-shaped one still moves.
    #[test]
    fn rows_that_are_not_whole_heads_are_refused() {
        let tensor = |rows: usize, cols: usize| HostTensor {
            dims: vec![rows, cols],
            data: HostData::F32((0..rows * cols).map(|i| i as f32).collect()),
            stored: Stored::AsData,
        };
        for (rows, heads) in [(0, 2), (6, 4), (6, 2), (8, 0)] {
            let err =
                GgufSource::unpermute_rows(&mut tensor(rows, 3), heads, "blk.0.attn_q.weight")
                    .unwrap_err()
                    .to_string();
            assert!(err.contains("blk.0.attn_q.weight"), "{rows}x{heads}: {err}");
        }
        let mut t = tensor(4, 1);
        GgufSource::unpermute_rows(&mut t, 1, "q").unwrap();
        // One head of 4: rows (0, 1, 2, 3) interleaved back to halves (0, 2, 1, 3).
        assert!(matches!(&t.data, HostData::F32(v) if v == &[0.0, 2.0, 1.0, 3.0]));
    }
}
