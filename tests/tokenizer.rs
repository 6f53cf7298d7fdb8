//! Tokenizers built from GGUF metadata against independent references: transformers for
//! SmolLM2's byte-level BPE, sentencepiece for a SentencePiece BPE vocabulary.

mod common;

use troupe::model::gguf::GgufFile;
use troupe::model::tokenizer::Tokenizer;

#[test]
fn smollm2_gguf_tokenizer_matches_transformers() {
    let gguf = GgufFile::open(&common::smollm2_path()).unwrap();
    let tok = Tokenizer::from_gguf(&gguf).unwrap();
    let golden = common::read_json("tokenizer_smollm2.json");
    let mut failures = Vec::new();
    for case in golden["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let want = common::ids(&case["ids"]);
        let got = tok.encode(text).unwrap();
        if got != want {
            failures.push(format!("{text:?}: got {got:?}, want {want:?}"));
        }
    }
    for case in golden["decode"].as_array().unwrap() {
        let got = tok.decode(&common::ids(&case["ids"]), false).unwrap();
        let want = case["text"].as_str().unwrap();
        if got != want {
            failures.push(format!("decode: got {got:?}, want {want:?}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn sentencepiece_gguf_tokenizer_matches_sentencepiece() {
    let gguf = GgufFile::open(&common::goldens().join("spm_tiny.gguf")).unwrap();
    let tok = Tokenizer::from_gguf(&gguf).unwrap();
    let golden = common::read_json("tokenizer_spm.json");
    assert_eq!(tok.bos_id, Some(golden["bos_id"].as_u64().unwrap() as u32));
    let mut failures = Vec::new();
    for case in golden["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let want = common::ids(&case["ids"]);
        // sentencepiece reads `<s>` in text as characters, like our plain encoding.
        let got = tok.encode_plain(text).unwrap();
        if got != want {
            failures.push(format!("{text:?}: got {got:?}, want {want:?}"));
        }
    }
    let unk = golden["unk_id"].as_u64().unwrap() as u32;
    for case in golden["decode"].as_array().unwrap() {
        let ids = common::ids(&case["ids"]);
        if ids.contains(&unk) {
            continue; // sentencepiece renders unk as " ⁇ ", a display choice, not the vocabulary's
        }
        let got = tok.decode(&ids, true).unwrap();
        let want = case["text"].as_str().unwrap();
        if got != want {
            failures.push(format!("decode {ids:?}: got {got:?}, want {want:?}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn plain_encoding_does_not_produce_special_ids() {
    let gguf = GgufFile::open(&common::smollm2_path()).unwrap();
    let tok = Tokenizer::from_gguf(&gguf).unwrap();
    let im_start = tok.token_to_id("<|im_start|>").unwrap();
    assert!(
        tok.encode("<|im_start|>system")
            .unwrap()
            .contains(&im_start)
    );
    let plain = tok.encode_plain("<|im_start|>system").unwrap();
    assert!(!plain.contains(&im_start), "{plain:?}");
    assert_eq!(tok.decode(&plain, false).unwrap(), "<|im_start|>system");
}
