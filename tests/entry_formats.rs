//! DeepSeek-V4's cache entry formats against `scripts/entry_formats_golden.py`, which
//! quantizes generated rows by the seed's rules with ml_dtypes' casts (e4m3fn, e2m1fn,
//! bf16): the same bytes, and the same values back.

mod common;

use troupe::kernels::entry_format::EntryFormat;

fn f32s(hex: &str) -> Vec<f32> {
    (0..hex.len() / 8)
        .map(|i| {
            let word = u32::from_str_radix(&hex[8 * i..8 * i + 8], 16).unwrap();
            f32::from_le_bytes(word.swap_bytes().to_le_bytes())
        })
        .collect()
}

fn bytes(hex: &str) -> Vec<u8> {
    (0..hex.len() / 2)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}

#[test]
fn every_format_encodes_and_decodes_as_the_reference() {
    let cases: serde_json::Value = common::read_json("entry_formats.json");
    let cases = cases.as_array().unwrap();
    assert!(cases.len() >= 20);
    for (i, case) in cases.iter().enumerate() {
        let format = match case["format"].as_str().unwrap() {
            "Fp8" => EntryFormat::Fp8,
            "Fp4" => EntryFormat::Fp4,
            "Mxfp4" => EntryFormat::Mxfp4,
            "Bf16" => EntryFormat::Bf16,
            other => panic!("unknown format {other}"),
        };
        let values = f32s(case["values"].as_str().unwrap());
        let want = bytes(case["bytes"].as_str().unwrap());
        let dim = values.len();
        assert_eq!(
            format.bytes(dim),
            want.len(),
            "case {i}: {format:?} of {dim}"
        );
        let mut got = vec![0u8; want.len()];
        format.encode(&values, &mut got);
        assert_eq!(
            got, want,
            "case {i}: {format:?} of {dim} encodes differently"
        );
        let mut back = vec![0f32; dim];
        format.decode(&want, &mut back);
        let decoded = f32s(case["decoded"].as_str().unwrap());
        for (j, (a, b)) in back.iter().zip(&decoded).enumerate() {
            assert!(
                a.to_bits() == b.to_bits() || a == b,
                "case {i}: {format:?} value {j} decodes to {a}, the reference to {b}"
            );
        }
    }
}
