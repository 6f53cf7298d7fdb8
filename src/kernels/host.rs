//! Weights in host memory as a checkpoint stores them, before a backend places them:
//! dense floats, GGML blocks, FP8 with its scale grid, or random (`--dummy-weights`).

use std::ops::Range;

use super::fp4::{self, Mxfp4Matrix};
use super::fp8::{Fp8Matrix, Quantization};
use super::quant;

/// Tensor data in host memory, as the checkpoint stores it.
#[derive(Clone)]
pub enum HostData {
    F32(Vec<f32>),
    /// bf16 as the checkpoint stores it: a backend that keeps bf16 weights uploads it as
    /// it is, with no f32 round trip on the host.
    Bf16(Vec<half::bf16>),
    /// Whole GGML blocks, each row of the tensor a whole number of them.
    Quantized {
        ggml_type: quant::GgmlType,
        bytes: Vec<u8>,
    },
    /// FP8 e4m3 with its scale grid (HF block scales, per-channel, per-tensor).
    Fp8(Fp8Matrix),
    /// MXFP4: E2M1 pairs and an E8M0 exponent per 32 values (DeepSeek-V4's routed experts).
    Mxfp4(Mxfp4Matrix),
    /// Dense values (`cols` wide) that the backend stores as per-channel FP8
    /// (`--quantization fp8`): a device backend quantizes them where they land, so dummy
    /// weights never materialise on the host either.
    ToFp8 {
        cols: usize,
        dense: Box<HostData>,
    },
    /// Row blocks of different quantized formats stacked (a Q4_K_M file's q/k in Q4_K and
    /// v in Q6_K): a backend keeps each part in its format or dequantizes them all.
    Stacked(Vec<HostMatrix>),
    /// `--dummy-weights` for MXFP4 experts: `Mxfp4Matrix::random(rows, cols, seed)`, made
    /// where it lives by a device backend.
    RandomMxfp4 {
        seed: u64,
    },
    /// `--dummy-weights`: element i is `random_weight(seed, i, mean, half_width)`. A device
    /// backend makes them where they live, so no host memory or disk holds the model.
    Random {
        seed: u64,
        mean: f32,
        half_width: f32,
    },
}

/// Uniform in `mean ± half_width` from (seed, index); the CUDA kernel computes the same.
pub fn random_weight(seed: u64, index: u64, mean: f32, half_width: f32) -> f32 {
    let h = crate::sampling::splitmix64(seed ^ crate::sampling::splitmix64(index));
    let u = (h >> 40) as f32 / (1u64 << 24) as f32;
    mean + (2.0 * u - 1.0) * half_width
}

impl HostData {
    pub fn into_f32(self, num_elements: usize) -> Vec<f32> {
        match self {
            HostData::F32(v) => v,
            HostData::Bf16(v) => v.into_iter().map(half::bf16::to_f32).collect(),
            HostData::Quantized { ggml_type, bytes } => {
                let mut out = vec![0f32; num_elements];
                quant::dequantize(ggml_type, &bytes, &mut out);
                out
            }
            HostData::Fp8(m) => m.to_f32(),
            HostData::Mxfp4(m) => m.to_f32(),
            HostData::RandomMxfp4 { seed } => {
                let cols = fp4::MXFP4_GROUP;
                // Rows of one group: the values depend only on the byte index.
                Mxfp4Matrix::random(num_elements / cols, cols, seed).to_f32()
            }
            HostData::ToFp8 { cols, dense } => {
                let random = matches!(*dense, HostData::Random { .. });
                let mut values = dense.into_f32(num_elements);
                if random {
                    // A device makes dummy weights in bf16 before quantizing them.
                    values
                        .iter_mut()
                        .for_each(|v| *v = half::bf16::from_f32(*v).to_f32());
                }
                Fp8Matrix::quantize_rows(&values, cols).to_f32()
            }
            HostData::Stacked(parts) => parts
                .into_iter()
                .flat_map(|p| p.data.into_f32(p.rows * p.cols))
                .collect(),
            HostData::Random {
                seed,
                mean,
                half_width,
            } => (0..num_elements as u64)
                .map(|i| random_weight(seed, i, mean, half_width))
                .collect(),
        }
    }
}

/// A weight matrix as loaded from a checkpoint, before it is placed on a device.
/// Row-major `[rows, cols]`: one row per output feature. A backend keeps quantized
/// formats it has kernels for and dequantizes the rest.
#[derive(Clone)]
pub struct HostMatrix {
    pub rows: usize,
    pub cols: usize,
    pub data: HostData,
}

impl HostMatrix {
    /// This matrix stored as `quantization` says, where it is dense (packed formats stay).
    pub fn quantized(self, quantization: Option<Quantization>) -> HostMatrix {
        match (quantization, self.data) {
            (
                Some(Quantization::Fp8),
                d @ (HostData::F32(_) | HostData::Bf16(_) | HostData::Random { .. }),
            ) => HostMatrix {
                data: HostData::ToFp8 {
                    cols: self.cols,
                    dense: Box::new(d),
                },
                ..self
            },
            (_, data) => HostMatrix { data, ..self },
        }
    }

    /// The rows `rows` and columns `cols` of this matrix (a tensor-parallel rank's shard).
    /// Quantized blocks stay packed when the columns cut between blocks, and are
    /// dequantized when a cut falls inside one; random weights get a stream of their own.
    pub fn sliced(self, rows: Range<usize>, cols: Range<usize>) -> HostMatrix {
        assert!(
            rows.end <= self.rows && cols.end <= self.cols,
            "slice {rows:?} x {cols:?} of a {} x {} matrix",
            self.rows,
            self.cols
        );
        if rows == (0..self.rows) && cols == (0..self.cols) {
            return self;
        }
        let (num_rows, num_cols) = (rows.len(), cols.len());
        fn take<T: Copy>(
            v: &[T],
            width: usize,
            rows: &Range<usize>,
            cols: &Range<usize>,
        ) -> Vec<T> {
            rows.clone()
                .flat_map(|r| {
                    v[r * width + cols.start..r * width + cols.end]
                        .iter()
                        .copied()
                })
                .collect()
        }
        let data = match self.data {
            HostData::F32(v) => HostData::F32(take(&v, self.cols, &rows, &cols)),
            HostData::Bf16(v) => HostData::Bf16(take(&v, self.cols, &rows, &cols)),
            HostData::Quantized { ggml_type, bytes } => {
                let block = ggml_type.block_len();
                if cols.start.is_multiple_of(block) && cols.end.is_multiple_of(block) {
                    let row_bytes = bytes.len() / self.rows;
                    let per = ggml_type.block_bytes();
                    let byte_cols = cols.start / block * per..cols.end / block * per;
                    HostData::Quantized {
                        ggml_type,
                        bytes: take(&bytes, row_bytes, &rows, &byte_cols),
                    }
                } else {
                    let n = self.rows * self.cols;
                    let all = HostData::Quantized { ggml_type, bytes }.into_f32(n);
                    HostData::F32(take(&all, self.cols, &rows, &cols))
                }
            }
            HostData::Fp8(m) => match m.sliced(rows.clone(), cols.clone()) {
                Some(s) => HostData::Fp8(s),
                None => HostData::F32(take(&m.to_f32(), self.cols, &rows, &cols)),
            },
            HostData::ToFp8 { cols: width, dense } => {
                let inner = HostMatrix {
                    rows: self.rows,
                    cols: width,
                    data: *dense,
                };
                HostData::ToFp8 {
                    cols: num_cols,
                    dense: Box::new(inner.sliced(rows.clone(), cols.clone()).data),
                }
            }
            // Experts are never sharded by columns: a slice of MXFP4 goes dense.
            data @ (HostData::Stacked(_) | HostData::Mxfp4(_) | HostData::RandomMxfp4 { .. }) => {
                let all = data.into_f32(self.rows * self.cols);
                HostData::F32(take(&all, self.cols, &rows, &cols))
            }
            HostData::Random {
                seed,
                mean,
                half_width,
            } => HostData::Random {
                seed: crate::sampling::splitmix64(
                    seed ^ crate::sampling::splitmix64(
                        (rows.start * self.cols + cols.start) as u64,
                    ),
                ),
                mean,
                half_width,
            },
        };
        HostMatrix {
            rows: num_rows,
            cols: num_cols,
            data,
        }
    }

    /// Stacks matrices with equal `cols` (q/k/v, gate/up) into one, so one kernel launch
    /// does the work of several. Keeps a shared quantized format (FP8 where the blocks line up); quantized parts of mixed
    /// formats stay apart as `Stacked`; anything else goes f32.
    pub fn concat_rows(parts: Vec<HostMatrix>) -> HostMatrix {
        let cols = parts[0].cols;
        let rows = parts.iter().map(|p| p.rows).sum();
        assert!(
            parts.iter().all(|p| p.cols == cols),
            "concat_rows needs equal widths"
        );
        // Random parts stay random (one stream for the stack), so dummy weights never
        // materialise on the host.
        if let HostData::Random {
            seed,
            mean,
            half_width,
        } = parts[0].data
            && parts
                .iter()
                .all(|p| matches!(p.data, HostData::Random { .. }))
        {
            return HostMatrix {
                rows,
                cols,
                data: HostData::Random {
                    seed: crate::sampling::splitmix64(seed ^ rows as u64),
                    mean,
                    half_width,
                },
            };
        }
        if parts
            .iter()
            .all(|p| matches!(p.data, HostData::ToFp8 { .. }))
        {
            let dense = parts
                .into_iter()
                .map(|p| HostMatrix {
                    rows: p.rows,
                    cols,
                    data: match p.data {
                        HostData::ToFp8 { dense, .. } => *dense,
                        _ => unreachable!("every part is to be quantized"),
                    },
                })
                .collect();
            return HostMatrix {
                rows,
                cols,
                data: HostData::ToFp8 {
                    cols,
                    dense: Box::new(HostMatrix::concat_rows(dense).data),
                },
            };
        }
        let fp8: Vec<&Fp8Matrix> = parts
            .iter()
            .filter_map(|p| match &p.data {
                HostData::Fp8(m) => Some(m),
                _ => None,
            })
            .collect();
        if fp8.len() == parts.len()
            && let Some(m) = Fp8Matrix::concat(&fp8)
        {
            return HostMatrix {
                rows,
                cols,
                data: HostData::Fp8(m),
            };
        }
        let shared_type = match &parts[0].data {
            HostData::Quantized { ggml_type, .. } => Some(*ggml_type),
            _ => None,
        };
        let same = parts.iter().all(|p| match &p.data {
            HostData::Quantized { ggml_type, .. } => Some(*ggml_type) == shared_type,
            _ => shared_type.is_none(),
        });
        if parts.iter().all(|p| matches!(p.data, HostData::Bf16(_))) {
            let data = parts
                .into_iter()
                .flat_map(|p| match p.data {
                    HostData::Bf16(v) => v,
                    _ => unreachable!("every part is bf16"),
                })
                .collect();
            return HostMatrix {
                rows,
                cols,
                data: HostData::Bf16(data),
            };
        }
        let data = match shared_type {
            Some(ggml_type) if same => HostData::Quantized {
                ggml_type,
                bytes: parts
                    .into_iter()
                    .flat_map(|p| match p.data {
                        HostData::Quantized { bytes, .. } => bytes,
                        _ => unreachable!("all parts share the quantized type"),
                    })
                    .collect(),
            },
            _ if parts
                .iter()
                .all(|p| matches!(p.data, HostData::Quantized { .. } | HostData::Fp8(_))) =>
            {
                HostData::Stacked(parts)
            }
            _ => HostData::F32(
                parts
                    .into_iter()
                    .flat_map(|p| p.data.into_f32(p.rows * p.cols))
                    .collect(),
            ),
        };
        HostMatrix { rows, cols, data }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Q8_0 matrix whose element (r, c) is `r * 100 + c - 50` (scale 1).
    fn q8_matrix(rows: usize, cols: usize) -> (HostMatrix, Vec<f32>) {
        let mut bytes = Vec::new();
        let mut want = Vec::new();
        for r in 0..rows {
            for block in 0..cols / 32 {
                bytes.extend(half::f16::from_f32(1.0).to_le_bytes());
                for i in 0..32 {
                    let v = (r * 3 + block * 32 + i) as i32 - 50;
                    bytes.push(v as i8 as u8);
                    want.push(v as f32);
                }
            }
        }
        let ggml_type = quant::GgmlType::Q8_0;
        let m = HostMatrix {
            rows,
            cols,
            data: HostData::Quantized { ggml_type, bytes },
        };
        (m, want)
    }

    fn values(m: HostMatrix) -> Vec<f32> {
        let n = m.rows * m.cols;
        m.data.into_f32(n)
    }

    fn expected(all: &[f32], width: usize, rows: Range<usize>, cols: Range<usize>) -> Vec<f32> {
        rows.flat_map(|r| all[r * width + cols.start..r * width + cols.end].to_vec())
            .collect()
    }

    #[test]
    fn shards_hold_exactly_their_rows_and_columns() {
        let all: Vec<f32> = (0..6 * 4).map(|i| i as f32).collect();
        let m = HostMatrix {
            rows: 6,
            cols: 4,
            data: HostData::F32(all.clone()),
        };
        let s = m.sliced(2..4, 1..3);
        assert_eq!((s.rows, s.cols), (2, 2));
        assert_eq!(values(s), vec![9.0, 10.0, 13.0, 14.0]);
        let bf: Vec<half::bf16> = all.iter().map(|&v| half::bf16::from_f32(v)).collect();
        let m = HostMatrix {
            rows: 6,
            cols: 4,
            data: HostData::Bf16(bf),
        };
        assert_eq!(values(m.sliced(5..6, 0..4)), vec![20.0, 21.0, 22.0, 23.0]);
    }

    #[test]
    fn quantized_shards_stay_packed_on_block_boundaries_and_dequantize_inside_them() {
        let (m, all) = q8_matrix(3, 128);
        let s = m.sliced(1..3, 64..128);
        assert!(matches!(s.data, HostData::Quantized { .. }));
        assert_eq!(values(s), expected(&all, 128, 1..3, 64..128));
        let (m, all) = q8_matrix(3, 128);
        let s = m.sliced(0..3, 16..48);
        assert!(matches!(s.data, HostData::F32(_)));
        assert_eq!(values(s), expected(&all, 128, 0..3, 16..48));
    }
}
