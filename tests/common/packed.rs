//! Packed weight matrices made on the host for the GPU's packed-weight tests: random GGML
//! blocks, FP8 with a scale grid, MXFP4, and the product over their dequantization.

use troupe::kernels::fp4::Mxfp4Matrix;
use troupe::kernels::fp8::{Fp8Matrix, f32_to_e4m3};
use troupe::kernels::quant::GgmlType;
use troupe::kernels::{HostData, HostMatrix};
use troupe::sampling::splitmix64;

pub fn bytes(seed: u64, n: usize) -> Vec<u8> {
    (0..n as u64)
        .map(|i| splitmix64(seed ^ splitmix64(i)) as u8)
        .collect()
}

/// Random blocks of `t` with sane f16 scales (random bytes there could be NaN).
pub fn ggml(t: GgmlType, rows: usize, cols: usize, seed: u64) -> HostMatrix {
    let (len, size) = (t.block_len(), t.block_bytes());
    let mut b = bytes(seed, rows * cols / len * size);
    let scale_at: &[usize] = match t {
        GgmlType::Q4_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q4K => &[0, 2],
        GgmlType::Q6K => &[208],
        other => panic!("{other:?}"),
    };
    for (i, block) in b.chunks_exact_mut(size).enumerate() {
        for (j, &at) in scale_at.iter().enumerate() {
            let v = 0.01 + 0.02 * ((i * 7 + j * 3) % 11) as f32;
            block[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
        }
    }
    HostMatrix {
        rows,
        cols,
        data: HostData::Quantized {
            ggml_type: t,
            bytes: b,
        },
    }
}

pub fn fp8(rows: usize, cols: usize, block: (usize, usize), seed: u64) -> HostMatrix {
    let b: Vec<u8> = super::uniform(seed, rows * cols)
        .into_iter()
        .map(|v| f32_to_e4m3(v * 400.0))
        .collect();
    let grid = (rows.div_ceil(block.0), cols.div_ceil(block.1));
    let scales = super::uniform(seed + 1, grid.0 * grid.1)
        .into_iter()
        .map(|v| 1e-3 * (1.5 + v))
        .collect();
    let m = Fp8Matrix::unscaled(b, cols)
        .with_scales(scales, grid, block)
        .unwrap();
    HostMatrix {
        rows,
        cols,
        data: HostData::Fp8(m),
    }
}

/// Random MXFP4: any E2M1 codes, exponents around 2^-6.
pub fn mxfp4(rows: usize, cols: usize, seed: u64) -> HostMatrix {
    let scales: Vec<f32> = bytes(seed + 1, rows * cols / 32)
        .into_iter()
        .map(|b| 2f32.powi(-8 + (b % 5) as i32))
        .collect();
    HostMatrix {
        rows,
        cols,
        data: HostData::Mxfp4(
            Mxfp4Matrix::new(bytes(seed, rows * cols / 2), &scales, cols).unwrap(),
        ),
    }
}

/// `x · wᵀ` in f64 over the dequantized weights.
pub fn reference(w: &HostMatrix, x: &[f32], m: usize) -> Vec<f32> {
    let dense = w.data.clone().into_f32(w.rows * w.cols);
    let mut out = vec![0f32; m * w.rows];
    for i in 0..m {
        for n in 0..w.rows {
            let row = &dense[n * w.cols..(n + 1) * w.cols];
            let xr = &x[i * w.cols..(i + 1) * w.cols];
            out[i * w.rows + n] = row
                .iter()
                .zip(xr)
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum::<f64>() as f32;
        }
    }
    out
}
