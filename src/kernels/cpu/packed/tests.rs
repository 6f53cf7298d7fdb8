use super::formats::f16_at;
use super::*;

#[test]
fn the_inline_f16_conversion_is_exact_for_every_bit_pattern() {
    for h in 0..=u16::MAX {
        let want = half::f16::from_bits(h).to_f32();
        let got = f16_at(&h.to_le_bytes(), 0);
        assert!(
            got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
            "{h:#06x}: {got} vs {want}"
        );
    }
}

/// Byte offsets of each format's f16 scale fields: random bytes there would make
/// infinities or absurd magnitudes; every other byte stays random (MXFP4's E8M0 exponent
/// too, but within 2^±6: see `random_row`).
const F16_FIELDS: [(GgmlType, &[usize]); 13] = [
    (GgmlType::Q4_0, &[0]),
    (GgmlType::Q4_1, &[0, 2]),
    (GgmlType::Q5_0, &[0]),
    (GgmlType::Q5_1, &[0, 2]),
    (GgmlType::Q8_0, &[0]),
    (GgmlType::Q2K, &[80, 82]),
    (GgmlType::Q3K, &[108]),
    (GgmlType::Q4K, &[0, 2]),
    (GgmlType::Q5K, &[0, 2]),
    (GgmlType::Q6K, &[208]),
    (GgmlType::IQ4NL, &[0]),
    (GgmlType::IQ4XS, &[0]),
    (GgmlType::MXFP4, &[]),
];

fn random_row(ty: GgmlType, blocks: usize, seed: u64) -> Vec<u8> {
    let bits = |i: usize| crate::sampling::splitmix64(seed ^ crate::sampling::splitmix64(i as u64));
    let mut bytes: Vec<u8> = (0..blocks * ty.block_bytes())
        .map(|i| bits(i) as u8)
        .collect();
    let offsets = F16_FIELDS.iter().find(|(t, _)| *t == ty).unwrap().1;
    for (b, blk) in bytes.chunks_exact_mut(ty.block_bytes()).enumerate() {
        if ty == GgmlType::MXFP4 {
            blk[0] = 121 + (bits(2_000_000 + b) % 13) as u8;
        }
        for (f, &off) in offsets.iter().enumerate() {
            let u = (bits(1_000_000 + 7 * b + f) >> 40) as f32 / (1u64 << 24) as f32;
            let v = 0.001 + 0.05 * u;
            blk[off..off + 2]
                .copy_from_slice(&half::f16::from_f32(if f == 0 { v } else { -v }).to_le_bytes());
        }
    }
    bytes
}

fn activations(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    (0..rows * cols)
        .map(|i| {
            let h = crate::sampling::splitmix64(seed ^ crate::sampling::splitmix64(i as u64));
            // Mostly small values with an occasional large one, as in a real hidden state.
            let u = (h >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            if h.is_multiple_of(17) { 8.0 * u } else { u }
        })
        .collect()
}

/// One weight row's dot with `R` activation rows on `path`.
fn dot_on<const R: usize>(ty: GgmlType, path: CpuPath, w: &[u8], xs: [Q8Row<'_>; R]) -> [f32; R] {
    let mut out = [[0f32; R]; 1];
    row_dot_on::<R>(ty, path).unwrap()(w, xs, &mut out);
    out[0]
}

fn paths() -> Vec<CpuPath> {
    [CpuPath::Scalar, CpuPath::Avx2, CpuPath::Avx512Vnni]
        .into_iter()
        .filter(|&p| p == CpuPath::Scalar || p <= cpu_path())
        .collect()
}

/// Every format against the `gguf`-checked dequantization, on generated rows of 1 to 5
/// blocks: the integer dot must equal the dequantized weights times the 8-bit-rounded
/// activations to float rounding, and the true product to within the bound that the
/// activations' rounding allows (`Σ |w| · d / 2`).
#[test]
fn every_format_matches_its_dequantization_within_the_activation_rounding() {
    for (ty, _) in F16_FIELDS {
        for blocks in 1..=5 {
            let cols = blocks * ty.block_len();
            let w = random_row(ty, blocks, 11 * blocks as u64 + ty.block_bytes() as u64);
            let mut w_f32 = vec![0f32; cols];
            crate::kernels::quant::dequantize(ty, &w, &mut w_f32);
            let x = activations(1, cols, blocks as u64);
            let mut act = Q8Act::default();
            act.quantize(&x, 1, cols);
            let row = act.row(0);
            let got = dot_on::<1>(ty, CpuPath::Scalar, &w, [row])[0] as f64;
            let (mut rounded, mut exact, mut magnitude, mut bound) = (0f64, 0f64, 0f64, 0f64);
            for i in 0..cols {
                let d = row.scales[i / ACT_GROUP] as f64;
                let x_rounded = d * row.quants[i] as f64;
                rounded += w_f32[i] as f64 * x_rounded;
                exact += w_f32[i] as f64 * x[i] as f64;
                magnitude += (w_f32[i] as f64 * x_rounded).abs();
                bound += (w_f32[i] as f64).abs() * d / 2.0;
            }
            assert!(
                (got - rounded).abs() <= 1e-5 * magnitude + 1e-6,
                "{ty:?}, {blocks} blocks: {got} vs dequantized {rounded}"
            );
            assert!(
                (got - exact).abs() <= bound * 1.001 + 1e-5 * magnitude,
                "{ty:?}, {blocks} blocks: {got} vs f32 {exact}, bound {bound}"
            );
        }
    }
}

/// Each vector path this CPU has gives the scalar kernel's bits, and a row's result does
/// not depend on the rows beside it (1 to 4 blocks; one, two, four and eight rows a call).
#[test]
fn every_path_gives_the_same_bits_whatever_shares_the_call() {
    for ((ty, _), blocks) in F16_FIELDS.iter().flat_map(|f| (1..=4).map(move |b| (f, b))) {
        let ty = *ty;
        let cols = blocks * ty.block_len();
        let w = random_row(ty, blocks, 5);
        let x = activations(8, cols, 9);
        let mut act = Q8Act::default();
        act.quantize(&x, 8, cols);
        let rows: [_; 8] = std::array::from_fn(|i| act.row(i));
        let want = dot_on::<8>(ty, CpuPath::Scalar, &w, rows);
        for path in paths() {
            let eight = dot_on::<8>(ty, path, &w, rows);
            let four = dot_on::<4>(ty, path, &w, [rows[4], rows[5], rows[6], rows[7]]);
            let alone = dot_on::<1>(ty, path, &w, [rows[2]])[0];
            let two = dot_on::<2>(ty, path, &w, [rows[6], rows[1]]);
            assert_eq!(
                [two[0].to_bits(), two[1].to_bits()],
                [want[6].to_bits(), want[1].to_bits()],
                "{ty:?} {path:?} {blocks} blocks, rows 6 and 1 as two"
            );
            for i in 0..8 {
                assert_eq!(
                    eight[i].to_bits(),
                    want[i].to_bits(),
                    "{ty:?} {path:?} row {i} of 8"
                );
            }
            for i in 0..4 {
                assert_eq!(
                    four[i].to_bits(),
                    want[4 + i].to_bits(),
                    "{ty:?} {path:?} row {} of 4",
                    4 + i
                );
            }
            assert_eq!(
                alone.to_bits(),
                want[2].to_bits(),
                "{ty:?} {path:?} {blocks} blocks alone"
            );
        }
    }
}

#[test]
fn activation_rounding_is_half_to_even_and_zero_rows_stay_zero() {
    let mut act = Q8Act::default();
    // max 127 makes d = 1, so the quants are the values rounded: 2.5 -> 2, 3.5 -> 4.
    let mut x = vec![0f32; 64];
    x[0] = 127.0;
    x[1] = 2.5;
    x[2] = 3.5;
    x[3] = -2.5;
    act.quantize(&x, 2, 32);
    let r = act.row(0);
    assert_eq!(&r.quants[..4], &[127, 2, 4, -2]);
    assert_eq!(r.sums[0], 131.0);
    let zero = act.row(1);
    assert!(zero.quants.iter().all(|&q| q == 0) && zero.scales[0] == 0.0);
}

/// A run of weight rows in one call (decode pairs them: two chains per call) gives each
/// row the bits it gets alone, on every path.
#[test]
fn a_run_of_weight_rows_gives_each_row_its_lone_bits() {
    for (ty, _) in F16_FIELDS {
        let (blocks, rows) = (2, 5);
        let cols = blocks * ty.block_len();
        let w: Vec<u8> = (0..rows)
            .flat_map(|r| random_row(ty, blocks, 40 + r))
            .collect();
        let x = activations(1, cols, 3);
        let mut act = Q8Act::default();
        act.quantize(&x, 1, cols);
        let row_bytes = w.len() / rows as usize;
        for path in paths() {
            let mut out = vec![[0f32; 1]; rows as usize];
            row_dot_on::<1>(ty, path).unwrap()(&w, [act.row(0)], &mut out);
            for (r, got) in out.iter().enumerate() {
                let alone = dot_on::<1>(
                    ty,
                    CpuPath::Scalar,
                    &w[r * row_bytes..(r + 1) * row_bytes],
                    [act.row(0)],
                );
                assert_eq!(
                    got[0].to_bits(),
                    alone[0].to_bits(),
                    "{ty:?} {path:?} row {r}"
                );
            }
        }
    }
}

/// MXFP4's wide kernel (two blocks a step, two weight rows at once) against the narrow
/// kernel and the scalar path, bit for bit: odd and even block counts (the odd block goes
/// through the narrow step), odd and even runs of weight rows (the last odd row alone),
/// one to three activation rows, exponents down to the subnormal scales.
#[cfg(target_arch = "x86_64")]
#[test]
fn mxfp4s_wide_kernel_gives_the_narrow_kernels_bits() {
    if cpu_path() < CpuPath::Avx512Vnni || !mxfp4_x86::has_vbmi() {
        eprintln!("no AVX-512 VBMI here: the wide MXFP4 kernel is not taken on this CPU");
        return;
    }
    fn check<const R: usize>(blocks: usize, rows: usize, seed: u64) {
        let ty = GgmlType::MXFP4;
        let cols = blocks * ty.block_len();
        let mut w: Vec<u8> = (0..rows as u64)
            .flat_map(|r| random_row(ty, blocks, seed * 31 + r))
            .collect();
        // A few exponents at the bottom of the range, where the half scale is subnormal.
        for (i, blk) in w.chunks_exact_mut(ty.block_bytes()).enumerate() {
            if i % 7 == 3 {
                blk[0] = (i % 3) as u8;
            }
        }
        let x = activations(R, cols, seed);
        let mut act = Q8Act::default();
        act.quantize(&x, R, cols);
        let xs: [Q8Row<'_>; R] = std::array::from_fn(|i| act.row(i));
        let (mut wide, mut narrow) = (vec![[0f32; R]; rows], vec![[0f32; R]; rows]);
        mxfp4_x86::dot_mxfp4_on::<R>(true, &w, xs, &mut wide);
        mxfp4_x86::dot_mxfp4_on::<R>(false, &w, xs, &mut narrow);
        let row_bytes = w.len() / rows;
        for r in 0..rows {
            let scalar = dot_on::<R>(
                ty,
                CpuPath::Scalar,
                &w[r * row_bytes..(r + 1) * row_bytes],
                xs,
            );
            for i in 0..R {
                let what = format!("{blocks} blocks, row {r} of {rows}, activation {i} of {R}");
                assert!(wide[r][i] != 0.0, "{what}: zero");
                assert_eq!(
                    wide[r][i].to_bits(),
                    narrow[r][i].to_bits(),
                    "{what}: wide vs narrow"
                );
                assert_eq!(
                    wide[r][i].to_bits(),
                    scalar[i].to_bits(),
                    "{what}: wide vs scalar"
                );
            }
        }
    }
    for blocks in 1..=9 {
        for rows in 1..=5 {
            let seed = (blocks * 10 + rows) as u64;
            check::<1>(blocks, rows, seed);
            check::<2>(blocks, rows, seed + 1000);
            check::<3>(blocks, rows, seed + 2000);
        }
    }
}
