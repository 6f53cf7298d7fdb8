//! Every GGML block format against `gguf.quants.dequantize` (goldens by scripts/make_goldens.py).

mod common;

use troupe::kernels::quant::{GgmlType, dequantize};

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn dequantization_matches_the_gguf_package() {
    let golden = common::read_json("quants.json");
    let mut seen = Vec::new();
    for case in golden.as_array().unwrap() {
        let name = case["type"].as_str().unwrap();
        let ty = GgmlType::from_name(name).unwrap_or_else(|| panic!("unknown type {name}"));
        let raw = hex(case["raw_hex"].as_str().unwrap());
        let want = common::floats(&case["values"]);
        let mut got = vec![f32::NAN; want.len()];
        dequantize(ty, &raw, &mut got);
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            // Exact but for the order of f32 products within a block.
            assert!(
                (g - w).abs() <= 1e-6 * scale,
                "{name} element {i}: {g} vs {w}"
            );
        }
        seen.push(name.to_string());
    }
    for name in [
        "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
        "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
    ] {
        assert!(seen.iter().any(|s| s == name), "no golden for {name}");
    }
}

/// e4m3 rounding (ties to even, saturation past 448) against torch's `to(float8_e4m3fn)`
/// on values across its range (scripts/make_fp8_goldens.py).
#[test]
fn e4m3_rounding_matches_torch() {
    use troupe::kernels::fp8::f32_to_e4m3;
    let golden = common::read_json("fp8/e4m3.json");
    let values = common::floats(&golden["values"]);
    let want = common::ids(&golden["bytes"]);
    assert!(values.len() > 400);
    for (v, w) in values.iter().zip(&want) {
        assert_eq!(f32_to_e4m3(*v) as u32, *w, "{v}");
    }
}
