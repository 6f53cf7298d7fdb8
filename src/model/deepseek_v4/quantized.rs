//! FP8 and packed-FP4 weights as DeepSeek-V4 checkpoints ship them, dequantized to f32
//! on the host: `X.weight` (FP8 e4m3, or two E2M1 values per I8/U8 byte) beside a scale
//! grid `X.weight_scale_inv` (or `X.scale`; f32, bf16, E8M0, or U8 exponents). The
//! grid's shape gives the block: 128×128 for dense FP8, 1×32 for MXFP4 experts.

use crate::error::{Result, TroupeError};
use crate::model::loader::{HostTensor, Stored, TensorSource};

const FP4_E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

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
    let exponents = scale.stored == Stored::U8;
    let scales: Vec<f32> = scale
        .into_f32()
        .into_iter()
        .map(|s| {
            if exponents {
                2f32.powi(s as i32 - 127)
            } else {
                s
            }
        })
        .collect();
    let (block_rows, block_cols) = (rows / grid_rows, cols / grid_cols);
    for (i, row) in w.chunks_exact_mut(cols).enumerate() {
        for (j, v) in row.iter_mut().enumerate() {
            *v *= scales[(i / block_rows) * grid_cols + j / block_cols];
        }
    }
    Ok(w)
}
