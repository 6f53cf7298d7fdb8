//! FP8 and packed-FP4 weights as DeepSeek-V4 checkpoints ship them, dequantized to f32
//! on the host: `X.weight` (FP8 e4m3, or two E2M1 values per I8/U8 byte) beside a scale
//! grid `X.weight_scale_inv` (or `X.scale`; f32, bf16, E8M0, or U8 exponents). The
//! grid's shape gives the block: 128×128 for dense FP8, 1×32 for MXFP4 experts.

use crate::error::{Result, TroupeError};
use crate::kernels::HostData;
use crate::kernels::fp4::{MXFP4_GROUP, Mxfp4Matrix, e8m0_scale};
use crate::model::loader::{HostTensor, Stored, TensorSource};

const FP4_E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// The `[rows, cols]` weight `name.weight` as the checkpoint ships it: FP8 with its block
/// scales, MXFP4 with power-of-two group scales (each kept packed by a backend with kernels
/// for it, dequantized exactly by the others), or its values — dequantized here where the
/// scales fit neither packed layout.
pub fn linear_data(
    src: &dyn TensorSource,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<HostData> {
    if let Some(packed) = packed(src, name, rows, cols)? {
        return Ok(packed);
    }
    linear(src, name, rows, cols).map(HostData::F32)
}

/// FP8 or MXFP4 `name.weight` kept as stored, or `None` for any other layout.
fn packed(
    src: &dyn TensorSource,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<Option<HostData>> {
    let weight_name = format!("{name}.weight");
    let (Some(weight), Some(scale)) = (src.tensor(&weight_name)?, scale_of(src, name)?) else {
        return Ok(None);
    };
    let grid = match scale.dims.as_slice() {
        [] | [1] => (1, 1),
        [r, c] => (*r, *c),
        _ => return Ok(None),
    };
    let scales: Vec<f32> = scale_values(scale);
    let bad = |reason: String| TroupeError::Tensor {
        name: weight_name.clone(),
        reason,
    };
    match (weight.stored, weight.data) {
        (Stored::F8E4M3, HostData::Fp8(m))
            if weight.dims == [rows, cols]
                && grid.0 > 0
                && grid.1 > 0
                && rows.is_multiple_of(grid.0)
                && cols.is_multiple_of(grid.1) =>
        {
            let block = (rows / grid.0, cols / grid.1);
            m.with_scales(scales, grid, block)
                .map(|m| Some(HostData::Fp8(m)))
                .map_err(bad)
        }
        (Stored::I8 | Stored::U8, data)
            if weight.dims == [rows, cols / 2] && grid == (rows, cols / MXFP4_GROUP) =>
        {
            let bytes: Vec<u8> = data
                .into_f32(rows * cols / 2)
                .into_iter()
                .map(|v| v as i32 as u8)
                .collect();
            // Scales that are not powers of two are not MXFP4: dequantized instead.
            Ok(Mxfp4Matrix::new(bytes, &scales, cols)
                .ok()
                .map(HostData::Mxfp4))
        }
        _ => Ok(None),
    }
}

fn scale_of(src: &dyn TensorSource, name: &str) -> Result<Option<HostTensor>> {
    match src.tensor(&format!("{name}.weight_scale_inv"))? {
        Some(s) => Ok(Some(s)),
        None => src.tensor(&format!("{name}.scale")),
    }
}

/// A scale grid's values; U8 grids hold E8M0 exponents.
fn scale_values(scale: HostTensor) -> Vec<f32> {
    let exponents = scale.stored == Stored::U8;
    scale
        .into_f32()
        .into_iter()
        .map(|s| if exponents { e8m0_scale(s as u8) } else { s })
        .collect()
}

/// The `[rows, cols]` weight `name.weight`'s values, dequantized when it comes with scales.
pub fn linear(src: &dyn TensorSource, name: &str, rows: usize, cols: usize) -> Result<Vec<f32>> {
    let weight_name = format!("{name}.weight");
    let bad = |reason: String| TroupeError::Tensor {
        name: weight_name.clone(),
        reason,
    };
    let weight = src
        .tensor(&weight_name)?
        .ok_or_else(|| bad("missing from the checkpoint".into()))?;
    let scale = match src.tensor(&format!("{name}.weight_scale_inv"))? {
        Some(s) => Some(s),
        None => src.tensor(&format!("{name}.scale"))?,
    };
    let w = match scale {
        None if weight.dims == [rows, cols] && weight.stored == Stored::AsData => weight.into_f32(),
        None => {
            return Err(bad(format!(
                "shape {:?} stored as {:?} without a scale tensor, expected [{rows}, {cols}] floats",
                weight.dims, weight.stored
            )));
        }
        Some(scale) => dequantize(weight, scale, rows, cols).map_err(bad)?,
    };
    Ok(w)
}

fn dequantize(
    weight: HostTensor,
    scale: HostTensor,
    rows: usize,
    cols: usize,
) -> Result<Vec<f32>, String> {
    let (dims, stored) = (weight.dims.clone(), weight.stored);
    let mut w = match stored {
        Stored::I8 | Stored::U8 if dims == [rows, cols / 2] && cols.is_multiple_of(2) => {
            // Two E2M1 values per byte, the low nibble first.
            weight
                .into_f32()
                .into_iter()
                .flat_map(|v| {
                    let byte = v as i32 as u8;
                    [
                        FP4_E2M1[(byte & 0xF) as usize],
                        FP4_E2M1[(byte >> 4) as usize],
                    ]
                })
                .collect()
        }
        _ if dims == [rows, cols] && stored != Stored::I8 && stored != Stored::U8 => {
            weight.into_f32()
        }
        _ => {
            return Err(format!(
                "shape {dims:?} stored as {stored:?} is neither [{rows}, {cols}] FP8 nor [{rows}, {}] packed FP4",
                cols / 2
            ));
        }
    };
    let (grid_rows, grid_cols) = match scale.dims.as_slice() {
        [] | [1] => (1, 1),
        [r, c] => (*r, *c),
        other => return Err(format!("scale grid of shape {other:?}")),
    };
    if grid_rows == 0
        || grid_cols == 0
        || !rows.is_multiple_of(grid_rows)
        || !cols.is_multiple_of(grid_cols)
    {
        return Err(format!(
            "[{rows}, {cols}] does not divide into a {grid_rows}×{grid_cols} scale grid"
        ));
    }
    let scales = scale_values(scale);
    let (block_rows, block_cols) = (rows / grid_rows, cols / grid_cols);
    for (i, row) in w.chunks_exact_mut(cols).enumerate() {
        for (j, v) in row.iter_mut().enumerate() {
            *v *= scales[(i / block_rows) * grid_cols + j / block_cols];
        }
    }
    Ok(w)
}
