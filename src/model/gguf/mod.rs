//! GGUF container reader: header, metadata, tensor infos, alignment, memory-mapped data.
//!
//! The file is mapped once; tensors are borrowed slices of the map, so loading costs no
//! copy until a tensor is dequantized. Every offset and size is checked against the file
//! length before use: a truncated or corrupt file gives an error, never a panic.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::error::{Result, TroupeError};
use crate::kernels::quant::GgmlType;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// No real file has more; a larger count means a corrupt header, not a big model.
const MAX_COUNT: u64 = 1 << 24;

#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    Str(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v as u64),
            MetaValue::U16(v) => Some(v as u64),
            MetaValue::U32(v) => Some(v as u64),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) if v >= 0 => Some(v as u64),
            MetaValue::I16(v) if v >= 0 => Some(v as u64),
            MetaValue::I32(v) if v >= 0 => Some(v as u64),
            MetaValue::I64(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v as f64),
            MetaValue::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// GGML order: `dims[0]` is the contiguous (innermost) dimension.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Absolute byte offset of the tensor data in the file.
    pub offset: usize,
    pub num_bytes: usize,
}

impl TensorInfo {
    pub fn num_elements(&self) -> usize {
        self.dims.iter().product::<u64>() as usize
    }
}

pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: HashMap<String, MetaValue>,
    pub tensors: Vec<TensorInfo>,
    mmap: Mmap,
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], String> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        match end {
            Some(end) => {
                let s = &self.bytes[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(format!(
                "truncated: needs {n} bytes at offset {} but the file has {}",
                self.pos,
                self.bytes.len()
            )),
        }
    }
    fn array<const N: usize>(&mut self) -> std::result::Result<[u8; N], String> {
        Ok(self.take(N)?.try_into().expect("take returned N bytes"))
    }
    fn u32(&mut self) -> std::result::Result<u32, String> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> std::result::Result<u64, String> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn count(&mut self, what: &str) -> std::result::Result<u64, String> {
        let n = self.u64()?;
        if n > MAX_COUNT {
            return Err(format!("{what} count {n} is implausibly large"));
        }
        Ok(n)
    }
    fn string(&mut self) -> std::result::Result<String, String> {
        let len = self.u64()?;
        if len > self.bytes.len() as u64 {
            return Err(format!("string length {len} exceeds the file size"));
        }
        let raw = self.take(len as usize)?;
        // Some vocabularies hold invalid UTF-8 pieces; keep them rather than fail.
        Ok(String::from_utf8_lossy(raw).into_owned())
    }
    fn value(&mut self, value_type: u32, depth: u32) -> std::result::Result<MetaValue, String> {
        Ok(match value_type {
            0 => MetaValue::U8(self.array::<1>()?[0]),
            1 => MetaValue::I8(self.array::<1>()?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.array()?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array()?)),
            4 => MetaValue::U32(self.u32()?),
            5 => MetaValue::I32(i32::from_le_bytes(self.array()?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array()?)),
            7 => MetaValue::Bool(self.array::<1>()?[0] != 0),
            8 => MetaValue::Str(self.string()?),
            9 => {
                if depth > 2 {
                    return Err("metadata arrays nested too deeply".into());
                }
                let item_type = self.u32()?;
                let n = self.count("array")?;
                // Every item takes at least this many of the file's bytes: a count the
                // rest of the file cannot hold is refused before anything is reserved
                // (found by fuzzing: nested arrays reserved 256 MiB from a 490 KiB file).
                let min_item_bytes: u64 = match item_type {
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    _ => 1,
                };
                let left = (self.bytes.len() - self.pos) as u64;
                if n.saturating_mul(min_item_bytes) > left {
                    return Err(format!(
                        "an array of {n} items cannot fit in the {left} bytes left of the file"
                    ));
                }
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(item_type, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(self.u64()?),
            11 => MetaValue::I64(i64::from_le_bytes(self.array()?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array()?)),
            other => return Err(format!("unknown metadata value type {other}")),
        })
    }
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| TroupeError::io(path, e))?;
        // SAFETY: the map is read-only and lives as long as `GgufFile`; a model file that
        // another process truncates while we run is outside what we defend against.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| TroupeError::io(path, e))?;
        Self::parse(path, mmap).map_err(|reason| TroupeError::Gguf {
            path: path.to_path_buf(),
            reason,
        })
    }

    fn parse(path: &Path, mmap: Mmap) -> std::result::Result<Self, String> {
        let mut cur = Cursor {
            bytes: &mmap,
            pos: 0,
        };
        if cur
            .take(4)
            .map_err(|_| "file is shorter than the GGUF magic".to_string())?
            != MAGIC
        {
            return Err("bad magic (expected `GGUF`)".into());
        }
        let version = cur.u32()?;
        if !(2..=3).contains(&version) {
            return Err(format!(
                "unsupported GGUF version {version} (supported: 2, 3)"
            ));
        }
        let tensor_count = cur.count("tensor")?;
        let kv_count = cur.count("metadata")?;
        let mut metadata = HashMap::new();
        for _ in 0..kv_count {
            let key = cur.string()?;
            let value_type = cur.u32()?;
            let value = cur
                .value(value_type, 0)
                .map_err(|e| format!("metadata `{key}`: {e}"))?;
            metadata.insert(key, value);
        }
        let mut raw_infos = Vec::with_capacity(tensor_count as usize);
        for _ in 0..tensor_count {
            let name = cur.string()?;
            let n_dims = cur.u32()?;
            if n_dims == 0 || n_dims > 4 {
                return Err(format!(
                    "tensor `{name}` has {n_dims} dimensions (1 to 4 allowed)"
                ));
            }
            let dims = (0..n_dims)
                .map(|_| cur.u64())
                .collect::<std::result::Result<Vec<_>, _>>()?;
            let type_id = cur.u32()?;
            let rel_offset = cur.u64()?;
            raw_infos.push((name, dims, type_id, rel_offset));
        }
        let alignment = metadata
            .get("general.alignment")
            .and_then(MetaValue::as_u64)
            .unwrap_or(DEFAULT_ALIGNMENT);
        if alignment == 0 || !alignment.is_power_of_two() {
            return Err(format!(
                "general.alignment {alignment} is not a power of two"
            ));
        }
        let data_start = (cur.pos as u64).div_ceil(alignment) * alignment;
        let mut tensors = Vec::with_capacity(raw_infos.len());
        for (name, dims, type_id, rel_offset) in raw_infos {
            let ggml_type = GgmlType::from_id(type_id)
                .ok_or_else(|| format!("tensor `{name}` has unsupported type id {type_id}"))?;
            let num_elements = dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| format!("tensor `{name}` shape {dims:?} overflows"))?;
            if num_elements % ggml_type.block_len() as u64 != 0 {
                return Err(format!(
                    "tensor `{name}` has {num_elements} elements, not a multiple of the {ggml_type:?} block"
                ));
            }
            // Checked: a shape whose byte count wraps would pass the file-size check below
            // and size an allocation of the unwrapped count later (found by fuzzing).
            let num_bytes = (num_elements / ggml_type.block_len() as u64)
                .checked_mul(ggml_type.block_bytes() as u64)
                .ok_or_else(|| format!("tensor `{name}` shape {dims:?} overflows"))?;
            let offset = data_start
                .checked_add(rel_offset)
                .ok_or_else(|| format!("tensor `{name}` offset {rel_offset} overflows"))?;
            if offset % alignment != 0 {
                return Err(format!(
                    "tensor `{name}` data at {offset} is not {alignment}-aligned"
                ));
            }
            if offset
                .checked_add(num_bytes)
                .is_none_or(|end| end > mmap.len() as u64)
            {
                return Err(format!(
                    "tensor `{name}` data ({num_bytes} bytes at {offset}) runs past the end of the file ({} bytes)",
                    mmap.len()
                ));
            }
            tensors.push(TensorInfo {
                name,
                dims,
                ggml_type,
                offset: offset as usize,
                num_bytes: num_bytes as usize,
            });
        }
        Ok(GgufFile {
            path: path.to_path_buf(),
            version,
            metadata,
            tensors,
            mmap,
        })
    }

    pub fn meta(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    pub fn meta_u64(&self, key: &str) -> Option<u64> {
        self.meta(key).and_then(MetaValue::as_u64)
    }

    pub fn meta_f64(&self, key: &str) -> Option<f64> {
        self.meta(key).and_then(MetaValue::as_f64)
    }

    pub fn meta_str(&self, key: &str) -> Option<&str> {
        self.meta(key).and_then(MetaValue::as_str)
    }

    pub fn require_u64(&self, key: &str) -> Result<u64> {
        self.meta_u64(key).ok_or_else(|| TroupeError::Gguf {
            path: self.path.clone(),
            reason: format!("missing integer metadata `{key}`"),
        })
    }

    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        // Bounds were checked in `parse`.
        &self.mmap[info.offset..info.offset + info.num_bytes]
    }

    /// A tensor's bytes copied out of the mapping a few MiB at a time, each run's file
    /// pages dropped once copied (`release`'s reason): the copy and the pages it came from
    /// are never both resident beyond one run, where a whole-tensor copy held both (30 MB
    /// for a 49k-vocabulary Q8_0 embedding, at the end of the load: the peak).
    pub fn copy_out(&self, info: &TensorInfo) -> Vec<u8> {
        const RUN_BYTES: usize = 4 << 20;
        let mut out = Vec::with_capacity(info.num_bytes);
        let mut at = info.offset;
        let end = info.offset + info.num_bytes;
        while at < end {
            let next = (at + RUN_BYTES).min(end);
            out.extend_from_slice(&self.mmap[at..next]);
            self.release_range(at, next);
            at = next;
        }
        out
    }

    /// Drops the file pages of a tensor already copied out, so the mapping does not keep
    /// a second copy of the weights resident while the rest loads (peak RSS ≈ the file,
    /// not twice it). A later read faults the same bytes in again from the file.
    pub fn release(&self, info: &TensorInfo) {
        self.release_range(info.offset, info.offset + info.num_bytes);
    }

    /// Drops the whole pages inside `[start, end)` of the file.
    fn release_range(&self, start: usize, end: usize) {
        const PAGE: usize = 4096;
        let (start, end) = (start.div_ceil(PAGE) * PAGE, end / PAGE * PAGE);
        if end > start {
            // SAFETY: the mapping is private and read-only, so no writes are discarded:
            // dropped pages read back the file's bytes unchanged.
            let _ = unsafe {
                self.mmap.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    start,
                    end - start,
                )
            };
        }
    }
}

#[cfg(test)]
mod tests;
