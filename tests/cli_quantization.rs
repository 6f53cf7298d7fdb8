//! `--quantization` and FP8 checkpoints from the command line: the flag takes effect (the
//! tokens are transformers' on torch's per-channel e4m3 of the same weights), and what it
//! cannot do is refused by name — an unknown method, a DeepSeek-V4 checkpoint (FP8 as
//! shipped), a GPTQ checkpoint.

mod common;

use common::cli::{assert_clear_error, tiny, token_ids, troupe};

fn generate(model: &str, prompt: &[u32], max_tokens: usize, extra: &[&str]) -> Vec<u32> {
    let ids: Vec<String> = prompt.iter().map(u32::to_string).collect();
    let ids = ids.join(",");
    let max = max_tokens.to_string();
    let mut args = vec![
        "generate",
        "--model",
        model,
        "--prompt-ids",
        &ids,
        "--max-tokens",
        &max,
        "--temperature",
        "0",
        "--ignore-eos",
        "--exact-activations",
        "--json",
    ];
    args.extend_from_slice(extra);
    let out = troupe(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    token_ids(&out)
}

#[test]
fn quantization_fp8_gives_transformers_tokens_on_the_quantized_weights() {
    let reference = common::read_json("fp8/tiny-llama-quantized.reference.json");
    let case = &reference["cases"][0];
    let prompt = common::ids(&case["prompt_ids"]);
    let want = common::ids(&case["greedy"]);
    let quantized = generate(
        &tiny("tiny-llama"),
        &prompt,
        want.len(),
        &["--quantization", "fp8"],
    );
    assert_eq!(quantized, want);
    // And the flag is what made them: over 3 prompts, the dense model's tokens differ.
    let differs = reference["cases"].as_array().unwrap().iter().any(|c| {
        let want = common::ids(&c["greedy"]);
        generate(
            &tiny("tiny-llama"),
            &common::ids(&c["prompt_ids"]),
            want.len(),
            &[],
        ) != want
    });
    assert!(
        differs,
        "the same tokens with and without --quantization: is it in effect?"
    );
}

#[test]
fn an_fp8_checkpoint_runs_from_the_command_line() {
    let reference = common::read_json("fp8/tiny-fp8-block/reference.json");
    let case = &reference["cases"][1];
    let want = common::ids(&case["greedy"]);
    let got = generate(
        &tiny("fp8/tiny-fp8-block"),
        &common::ids(&case["prompt_ids"]),
        want.len(),
        &[],
    );
    assert_eq!(got, want);
}

#[test]
fn what_quantization_cannot_do_is_refused_by_name() {
    let unknown = troupe(&[
        "generate",
        "--model",
        &tiny("tiny-llama"),
        "--prompt-ids",
        "1",
        "--quantization",
        "int4",
    ]);
    assert!(!unknown.status.success());
    let err = String::from_utf8_lossy(&unknown.stderr);
    assert!(err.contains("int4"), "{err}");
    assert_clear_error(
        &troupe(&[
            "generate",
            "--model",
            &tiny("tiny-dsv4-a"),
            "--prompt-ids",
            "1",
            "--quantization",
            "fp8",
        ]),
        "--quantization is for dense checkpoints",
    );
    // A packed GGUF's projections stay as its blocks: FP8 would not apply, so it is
    // refused, not ignored; a dense (F32) GGUF takes it.
    assert_clear_error(
        &troupe(&[
            "generate",
            "--model",
            &tiny("tiny-llama-q4_0.gguf"),
            "--prompt-ids",
            "1",
            "--quantization",
            "fp8",
        ]),
        "already packed",
    );
    let dense = troupe(&[
        "generate",
        "--model",
        &tiny("tiny-llama.gguf"),
        "--prompt-ids",
        "1",
        "--max-tokens",
        "2",
        "--quantization",
        "fp8",
    ]);
    assert!(
        dense.status.success(),
        "{}",
        String::from_utf8_lossy(&dense.stderr)
    );
    // A GPTQ config: its integer tensors are not read as floats.
    let files = [
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ];
    let dir = common::golden_copy("tiny-llama", &files, "gptq");
    let mut config = common::read_json("tiny-llama/config.json");
    config["quantization_config"] = serde_json::json!({"quant_method": "gptq", "bits": 4});
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    assert_clear_error(
        &troupe(&[
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt-ids",
            "1",
        ]),
        "quantization method `gptq` is not supported",
    );
    std::fs::remove_dir_all(&dir).ok();
}
