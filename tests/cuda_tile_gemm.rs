//! The tensor-core tile GEMM (`kernels-cuda/mma_tile.cu`) on the GPU against f32 products
//! on the host of the same weights' exact values. DeepSeek-V4's routed experts (`moe.cu`:
//! routing grouped on the device, MXFP4 or bf16 weights): generated shapes and routings,
//! one token to past the switch to many-row tiles, both modes, the per-expert counts,
//! expert-parallel owners, and the invariant mode's rows equal bit for bit whatever the
//! batch. The batch-invariant dense GEMM (`invariant_mma.cu`), bf16 and FP8 weights:
//! generated shapes and FP8 blocks, and a row's bits the same alone and in batches of one
//! and of several row tiles. Needs a GPU: it runs on the device machine
//! (`scripts/gpu-tests.sh`); CI compiles it.
#![cfg(feature = "cuda")]

mod common;

use common::Rng;
use half::bf16;
use troupe::kernels::cuda::CudaBackend;
use troupe::kernels::deepseek_v4::{DsV4Kernels, DsV4Shape, ExpertOwners};
use troupe::kernels::fp4::Mxfp4Matrix;
use troupe::kernels::fp8::{Fp8Matrix, e4m3_to_f32, f32_to_e4m3};
use troupe::kernels::{Backend, HostData, HostMatrix};

const LIMIT: f32 = 7.0;

/// A `[rows, cols]` matrix as the device takes it and its exact values on the host.
fn matrix(rng: &mut Rng, rows: usize, cols: usize, mxfp4: bool) -> (HostMatrix, Vec<f32>) {
    if mxfp4 {
        let m = Mxfp4Matrix {
            bytes: (0..rows * cols / 2).map(|_| rng.next() as u8).collect(),
            // Scales 2^-10 .. 2^-3: the values a trained expert's blocks carry.
            exponents: (0..rows * cols / 32)
                .map(|_| 117 + rng.below(8) as u8)
                .collect(),
            cols,
        };
        let values = m.to_f32();
        let data = HostData::Mxfp4(m);
        (HostMatrix { rows, cols, data }, values)
    } else {
        let scale = (cols as f32).powf(-0.5);
        let values: Vec<f32> = (0..rows * cols)
            .map(|_| bf16::from_f32(rng.uniform() * scale).to_f32())
            .collect();
        let data = HostData::F32(values.clone());
        (HostMatrix { rows, cols, data }, values)
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn dot(w: &[f32], x: &[f32]) -> f32 {
    w.iter().zip(x).map(|(a, b)| a * b).sum()
}

struct Case {
    experts: usize,
    k: usize,
    hidden: usize,
    inter: usize,
    mxfp4: bool,
}

struct Run {
    ys: Vec<f32>,
    counts: Vec<u32>,
}

/// The experts of `case` on `b`, and host products of `tokens` generated rows.
struct Setup {
    host: Vec<[Vec<f32>; 3]>,
    device: Vec<[troupe::kernels::cuda::CudaMatrix; 3]>,
}

fn setup(b: &CudaBackend, case: &Case, rng: &mut Rng) -> Setup {
    let (d, i) = (case.hidden, case.inter);
    let mut host = Vec::new();
    let mut device = Vec::new();
    for _ in 0..case.experts {
        let (g, gv) = matrix(rng, i, d, case.mxfp4);
        let (u, uv) = matrix(rng, i, d, case.mxfp4);
        // MXFP4 needs 32-column blocks: down stays bf16 otherwise (as the loader keeps it).
        let (w, wv) = matrix(rng, d, i, case.mxfp4 && i.is_multiple_of(32));
        host.push([gv, uv, wv]);
        device.push([b.upload_matrix(g), b.upload_matrix(u), b.upload_matrix(w)]);
    }
    Setup { host, device }
}

fn run(
    b: &CudaBackend,
    s: &Setup,
    case: &Case,
    x: &[f32],
    chosen: &[u32],
    owners: Option<(&[u32], usize, usize)>,
) -> Run {
    let tokens = x.len() / case.hidden;
    let mats: Vec<[&troupe::kernels::cuda::CudaMatrix; 3]> =
        s.device.iter().map(|[g, u, w]| [g, u, w]).collect();
    let table = b.dsv4_expert_table(&mats).expect("a table");
    let ids = b.upload_ids(chosen);
    let mut counts = b.alloc_ids(case.experts + 3);
    let mut ys = b.scratch(tokens * case.k * case.hidden);
    let owner_ids = owners.map(|(t, _, _)| b.upload_ids(t));
    let owners = owners
        .zip(owner_ids.as_ref())
        .map(|((_, replicas, rank), table)| ExpertOwners {
            table,
            replicas,
            rank,
        });
    // Counts land past an offset, as a layer's do in the model's `[layers, experts]`.
    b.dsv4_routed_experts(
        &mut ys,
        &b.upload(x),
        &ids,
        &mats,
        &table,
        owners.as_ref(),
        &mut counts,
        3,
        tokens,
        case.k,
        LIMIT,
    );
    Run {
        ys: b.download(&ys, tokens * case.k * case.hidden),
        counts: b.download_ids(&counts, case.experts + 3),
    }
}

/// The pair's product on the host in f32.
fn reference(s: &Setup, case: &Case, x: &[f32], e: usize) -> Vec<f32> {
    let (d, i) = (case.hidden, case.inter);
    let [g, u, w] = &s.host[e];
    let h: Vec<f32> = (0..i)
        .map(|r| {
            let gv = dot(&g[r * d..(r + 1) * d], x).min(LIMIT);
            let uv = dot(&u[r * d..(r + 1) * d], x).clamp(-LIMIT, LIMIT);
            silu(gv) * uv
        })
        .collect();
    (0..d).map(|r| dot(&w[r * i..(r + 1) * i], &h)).collect()
}

fn routing(rng: &mut Rng, case: &Case, tokens: usize) -> Vec<u32> {
    let mut chosen = Vec::with_capacity(tokens * case.k);
    for _ in 0..tokens {
        let mut picked: Vec<u32> = Vec::new();
        while picked.len() < case.k {
            let e = rng.below(case.experts) as u32;
            if !picked.contains(&e) {
                picked.push(e);
            }
        }
        chosen.extend(picked);
    }
    chosen
}

fn backend(invariant: bool, case: &Case) -> CudaBackend {
    let b = CudaBackend::new(0, invariant, false).expect("a GPU");
    b.dsv4_prepare(&DsV4Shape {
        hc_mult: 1,
        num_routed_experts: case.experts,
        num_experts_per_tok: case.k,
        head_dim: 64,
        index_width: 64,
        index_head_dim: 64,
    })
    .expect("the kernels");
    b
}

/// Relative to the row's largest value: bf16 activations (default mode past 16 pairs an
/// expert) round each product at 2^-9; f32-accurate ones only sum in a different order.
fn check(got: &[f32], want: &[f32], tol: f32, what: &str) {
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    for (c, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= tol * scale,
            "{what}: column {c}: {a} vs {b} (row max {scale})"
        );
    }
}

fn cases(rng: &mut Rng) -> Vec<Case> {
    let mut out = Vec::new();
    for n in 0..6 {
        let mxfp4 = n % 2 == 0;
        let unit = if mxfp4 { 32 } else { 8 };
        // Hidden (gate and up's columns) must suit the format; inter decides down's.
        let experts = [4, 8, 16, 64, 40, 128][n];
        out.push(Case {
            experts,
            k: 1 + rng.below(6.min(experts)),
            // Past a 512-column chunk now and then, with a partial one after it.
            hidden: unit * (1 + rng.below(if n == 3 { 40 } else { 12 })),
            inter: 8 * (1 + rng.below(48)),
            mxfp4,
        });
    }
    // Both sides multiples of 512: MXFP4 weights staged through shared memory, and for a
    // decode-sized batch (a pair for every 4 experts or fewer) the GEMV a pair on the
    // tensor cores, K in chunks of 512 (1 to 16 of them).
    out.push(Case {
        experts: 32,
        k: 4,
        hidden: 1024,
        inter: 512,
        mxfp4: true,
    });
    // The pipelined many-row kernel (both K multiples of 128, from one chunk up), then
    // many rows where hidden (32 past a multiple of 128) keeps them on the tile GEMM.
    out.push(Case {
        experts: 16,
        k: 1 + rng.below(4),
        hidden: 128 * (1 + rng.below(12)),
        inter: 128 * (1 + rng.below(8)),
        mxfp4: true,
    });
    out.push(Case {
        experts: 16,
        k: 1 + rng.below(4),
        hidden: 128 * rng.below(12) + 32,
        inter: 128 * (1 + rng.below(8)),
        mxfp4: true,
    });
    // Eight experts keep the host's matrices small (at most 8 × 8192 × 512 × 3 values); k at
    // most experts / 4 keeps one token on the GEMV.
    let gemv = |rng: &mut Rng, hidden: usize| Case {
        experts: 8,
        k: 1 + rng.below(2),
        hidden,
        inter: 512 * (1 + rng.below(if hidden > 4096 { 1 } else { 2 })),
        mxfp4: true,
    };
    let hidden = 512 * (1 + rng.below(16));
    out.push(gemv(rng, hidden));
    // 6 lanes a row: 5 rows a warp, an odd count, of which the up pass uses 4.
    out.push(gemv(rng, 3072));
    out
}

#[test]
fn grouped_experts_match_host_products_on_generated_shapes_and_routings() {
    let mut rng = Rng(0x05ee_d0e4);
    for case in cases(&mut rng) {
        for invariant in [false, true] {
            let b = backend(invariant, &case);
            let s = setup(&b, &case, &mut rng);
            // One token, a decode batch, enough pairs for many-row tiles, and (few experts)
            // enough to fill whole 64-row tiles and start more.
            let many = (16 * case.experts).div_ceil(case.k) + 3;
            let full = (80 * case.experts).div_ceil(case.k);
            let mut batches = vec![1, 1 + rng.below(40), many];
            if case.experts <= 16 {
                batches.push(full);
            }
            for tokens in batches {
                let x: Vec<f32> = (0..tokens * case.hidden).map(|_| rng.uniform()).collect();
                let chosen = routing(&mut rng, &case, tokens);
                let out = run(&b, &s, &case, &x, &chosen, None);
                let bf16_acts = !invariant && tokens * case.k >= 16 * case.experts;
                // The GEMV a pair (MXFP4, a pair for every 4 experts or fewer, both sides
                // multiples of 512) takes its input as f16 on the tensor cores.
                let f16_acts = !invariant
                    && case.mxfp4
                    && 4 * tokens * case.k <= case.experts
                    && case.hidden.is_multiple_of(512)
                    && case.inter.is_multiple_of(512);
                let tol = if bf16_acts {
                    2e-2
                } else if f16_acts {
                    // f16 rounding of the input (3 bits finer than bf16's), which the up
                    // pass's SwiGLU clamp can amplify; a misplaced value errs by ~1.
                    1e-2
                } else {
                    1e-4
                };
                let d = case.hidden;
                // Every pair of a small batch; a sample of the large one.
                for pair in (0..tokens * case.k).step_by(1 + tokens / 40) {
                    let want = reference(
                        &s,
                        &case,
                        &x[pair / case.k * d..][..d],
                        chosen[pair] as usize,
                    );
                    let what = format!(
                        "{} experts k {} {}×{} {}, {tokens} tokens, invariant {invariant}, pair {pair}",
                        case.experts,
                        case.k,
                        case.inter,
                        case.hidden,
                        if case.mxfp4 { "MXFP4" } else { "bf16" }
                    );
                    check(&out.ys[pair * d..(pair + 1) * d], &want, tol, &what);
                }
                let mut counts = vec![0u32; case.experts + 3];
                chosen.iter().for_each(|&e| counts[3 + e as usize] += 1);
                assert_eq!(out.counts, counts, "{tokens} tokens");
            }
        }
    }
}

#[test]
fn the_invariant_mode_gives_a_token_the_same_bits_alone_and_in_any_batch() {
    let mut rng = Rng(0x1a7);
    for mxfp4 in [true, false] {
        let case = Case {
            experts: 16,
            k: 4,
            hidden: 256,
            inter: 128,
            mxfp4,
        };
        let b = backend(true, &case);
        let s = setup(&b, &case, &mut rng);
        let d = case.hidden;
        let alone_x: Vec<f32> = (0..d).map(|_| rng.uniform()).collect();
        let alone_chosen = routing(&mut rng, &case, 1);
        let alone = run(&b, &s, &case, &alone_x, &alone_chosen, None);
        for tokens in [2, 9, 100] {
            // The token sits at a generated place among others sharing its experts.
            let at = rng.below(tokens);
            let mut x: Vec<f32> = (0..tokens * d).map(|_| rng.uniform()).collect();
            x[at * d..(at + 1) * d].copy_from_slice(&alone_x);
            let mut chosen = routing(&mut rng, &case, tokens);
            chosen[at * case.k..(at + 1) * case.k].copy_from_slice(&alone_chosen);
            let out = run(&b, &s, &case, &x, &chosen, None);
            let rows = &out.ys[at * case.k * d..(at + 1) * case.k * d];
            assert!(
                rows.iter()
                    .zip(&alone.ys)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "MXFP4 {mxfp4}: token {at} of {tokens} differs from the same token alone"
            );
        }
    }
}

#[test]
fn pairs_another_rank_owns_are_zero_rows_and_still_counted() {
    let mut rng = Rng(0xe9);
    let case = Case {
        experts: 8,
        k: 3,
        hidden: 64,
        inter: 32,
        mxfp4: true,
    };
    let b = backend(false, &case);
    let s = setup(&b, &case, &mut rng);
    // Two ranks; experts 0 and 5 replicated on both (a token goes to replica token % 2).
    let replicas = 2;
    let mut table = Vec::new();
    for e in 0..case.experts {
        match e {
            0 | 5 => table.extend([2, 0, 1]),
            _ => table.extend([1, (e * 2 / case.experts) as u32, 0]),
        }
    }
    let tokens = 30;
    let d = case.hidden;
    let x: Vec<f32> = (0..tokens * d).map(|_| rng.uniform()).collect();
    let chosen = routing(&mut rng, &case, tokens);
    let out = run(&b, &s, &case, &x, &chosen, Some((&table, replicas, 1)));
    let mut owned = 0;
    for (pair, &e) in chosen.iter().enumerate() {
        let (e, token) = (e as usize, pair / case.k);
        let entry = &table[e * 3..e * 3 + 3];
        let mine = entry[1 + token % entry[0] as usize] == 1;
        let got = &out.ys[pair * d..(pair + 1) * d];
        if mine {
            owned += 1;
            check(
                got,
                &reference(&s, &case, &x[token * d..][..d], e),
                1e-4,
                "owned pair",
            );
        } else {
            assert!(got.iter().all(|&v| v == 0.0), "pair {pair} of another rank");
        }
    }
    assert!(owned > 0 && owned < tokens * case.k, "{owned} owned");
    assert_eq!(
        out.counts[3..].iter().sum::<u32>() as usize,
        tokens * case.k
    );
}

#[test]
fn the_invariant_dense_gemm_is_exact_to_f32_and_gives_a_row_the_same_bits_in_any_batch() {
    let mut rng = Rng(0xde75e);
    let b = CudaBackend::new(0, true, false).expect("a GPU");
    for case in 0..7 {
        // The last: few features over many columns (mHC's mix shape), K split 8 or 16 ways.
        let (n, k) = if case == 6 {
            (1 + rng.below(40), 8 * (1024 + rng.below(1024)))
        } else {
            (1 + rng.below(300), 8 * (1 + rng.below(200)))
        };
        let (w, values) = matrix(&mut rng, n, k, false);
        invariant_rows(&b, &mut rng, w, &values);
    }
}

/// FP8 weights (DeepSeek-V4's dense projections) read as stored: the sums of their bf16
/// dequantized values, whatever the block shape (a lane's 8 columns inside one block or
/// not), and a row's bits the same in any batch.
#[test]
fn the_invariant_gemm_on_fp8_weights_sums_their_dequantized_values_the_same_in_any_batch() {
    let mut rng = Rng(0xf8f8);
    let b = CudaBackend::new(0, true, false).expect("a GPU");
    for case in 0..8 {
        let (n, k) = (1 + rng.below(400), 8 * (1 + rng.below(300)));
        let block = match case % 4 {
            0 => (128, 128),
            1 => (1, k),
            2 => (1 + rng.below(40), 8 * (1 + rng.below(20))),
            _ => (1 + rng.below(40), 1 + rng.below(60)),
        };
        let grid = (n.div_ceil(block.0), k.div_ceil(block.1));
        let bytes: Vec<u8> = (0..n * k)
            .map(|_| f32_to_e4m3((rng.uniform() - 0.5) * 800.0))
            .collect();
        let scales: Vec<f32> = (0..grid.0 * grid.1)
            .map(|_| 1e-3 * (0.5 + rng.uniform()))
            .collect();
        let values: Vec<f32> = (0..n * k)
            .map(|i| {
                let (r, c) = (i / k, i % k);
                let s = scales[(r / block.0) * grid.1 + c / block.1];
                bf16::from_f32(e4m3_to_f32(bytes[i]) * s).to_f32()
            })
            .collect();
        let m = Fp8Matrix::unscaled(bytes, k)
            .with_scales(scales, grid, block)
            .expect("scales fit the grid");
        let data = HostData::Fp8(m);
        invariant_rows(
            &b,
            &mut rng,
            HostMatrix {
                rows: n,
                cols: k,
                data,
            },
            &values,
        );
    }
}

/// `w` (exact values `values`) on the invariant backend `b`: one row tile, then several;
/// sampled rows within 1e-4 of the f32 sums, and one row's bits the same in each batch.
fn invariant_rows(b: &CudaBackend, rng: &mut Rng, w: HostMatrix, values: &[f32]) {
    let (n, k) = (w.rows, w.cols);
    let w = b.upload_matrix(w);
    let alone: Vec<f32> = (0..k).map(|_| rng.uniform()).collect();
    let mut first = None;
    for m in [1, 1 + rng.below(16), 17 + rng.below(200)] {
        let mut x: Vec<f32> = (0..m * k).map(|_| rng.uniform()).collect();
        let at = rng.below(m);
        x[at * k..(at + 1) * k].copy_from_slice(&alone);
        let mut out = b.alloc(m * n);
        b.matmul(&b.upload(&x), m, &w, None, &mut out);
        let got = b.download(&out, m * n);
        for r in (0..m).step_by(1 + m / 20) {
            let want: Vec<f32> = (0..n)
                .map(|c| dot(&values[c * k..(c + 1) * k], &x[r * k..(r + 1) * k]))
                .collect();
            check(
                &got[r * n..(r + 1) * n],
                &want,
                1e-4,
                &format!("{m}×{k} · {n}ᵀ row {r}"),
            );
        }
        let row: Vec<u32> = got[at * n..(at + 1) * n]
            .iter()
            .map(|v| v.to_bits())
            .collect();
        match &first {
            None => first = Some(row),
            Some(f) => assert_eq!(&row, f, "{n}×{k}: the row at {at} of {m} differs"),
        }
    }
}
