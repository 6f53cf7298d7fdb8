//! The `troupe generate` contract scripts depend on: JSON output shape, and bad input
//! answered by one clear error line with exit code 2, never a panic.

mod common;

use common::cli::{assert_clear_error, tiny, troupe};

use std::path::{Path, PathBuf};
use std::process::Output;

/// A file in this process's scratch directory, which every test of the file shares (so it
/// is created, never emptied, here).
fn scratch(name: &str, contents: &[u8]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("troupe-cli-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, contents).unwrap();
    p
}

#[test]
fn json_output_has_the_documented_fields_in_input_order() {
    let file = scratch(
        "prompts.jsonl",
        b"{\"prompt_ids\":[5,6,7],\"max_tokens\":4}\n{\"prompt\":\"hello world\",\"max_tokens\":2,\"temperature\":0.8,\"seed\":3}\n",
    );
    let out = troupe(&[
        "generate",
        "--model",
        &tiny("tiny-qwen2"),
        "--prompts-file",
        file.to_str().unwrap(),
        "--json",
        "--top-logprobs",
        "3",
    ]);
    let lines = common::cli::json_lines(&out);
    assert_eq!(lines.len(), 2);
    assert_eq!(common::ids(&lines[0]["prompt_ids"]), vec![5, 6, 7]);
    for l in &lines {
        let n = l["token_ids"].as_array().unwrap().len();
        assert!(["stop", "length"].contains(&l["finish_reason"].as_str().unwrap()));
        assert!(l["text"].is_string());
        let lp = l["top_logprobs"].as_array().unwrap();
        assert_eq!(lp.len(), n, "one top_logprobs entry per generated token");
        assert!(lp.iter().all(|e| e.as_array().unwrap().len() == 3));
    }
    assert!(lines[0]["token_ids"].as_array().unwrap().len() <= 4);
}

#[test]
fn seeded_sampling_repeats_and_different_seeds_differ() {
    let run = |seed: &str| {
        let out = troupe(&[
            "generate",
            "--model",
            &tiny("tiny-llama"),
            "--prompt-ids",
            "3,4,5",
            "--max-tokens",
            "24",
            "--temperature",
            "1.0",
            "--seed",
            seed,
            "--json",
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    assert_eq!(run("7"), run("7"));
    assert_ne!(run("7"), run("8"));
}

#[test]
fn missing_model_file_is_named() {
    assert_clear_error(
        &troupe(&[
            "generate",
            "--model",
            "/nonexistent/model.gguf",
            "--prompt",
            "hi",
        ]),
        "/nonexistent/model.gguf",
    );
}

#[test]
fn corrupt_gguf_is_named() {
    let f = scratch("corrupt.gguf", b"GGUF\x03\x00\x00\x00garbage");
    assert_clear_error(
        &troupe(&["generate", "--model", f.to_str().unwrap(), "--prompt", "hi"]),
        "not a valid GGUF file",
    );
    let f = scratch("notgguf.gguf", b"this is text");
    assert_clear_error(
        &troupe(&["generate", "--model", f.to_str().unwrap(), "--prompt", "hi"]),
        "bad magic",
    );
}

#[test]
fn unknown_architecture_is_named() {
    let dir = common::scratch_dir("cli-arch");
    std::fs::write(
        dir.join("config.json"),
        br#"{"architectures":["GPTNeoXForCausalLM"]}"#,
    )
    .unwrap();
    assert_clear_error(
        &troupe(&[
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt-ids",
            "1",
        ]),
        "unsupported architecture `GPTNeoXForCausalLM`",
    );
}

#[test]
fn prompt_longer_than_the_context_is_named() {
    // tiny-llama's context is 512 tokens.
    let ids: Vec<String> = (0..600).map(|i| (i % 300).to_string()).collect();
    let out = troupe(&[
        "generate",
        "--model",
        &tiny("tiny-llama"),
        "--prompt-ids",
        &ids.join(","),
    ]);
    assert_clear_error(&out, "600 tokens but the model context is 512");
}

#[test]
fn malformed_jsonl_line_is_named() {
    let f = scratch(
        "bad.jsonl",
        b"{\"prompt_ids\":[1,2]}\n{\"prompt_ids\": [1,\n",
    );
    let out = troupe(&[
        "generate",
        "--model",
        &tiny("tiny-llama"),
        "--prompts-file",
        f.to_str().unwrap(),
    ]);
    assert_clear_error(&out, "line 2");
}

#[test]
fn bad_values_are_named() {
    let m = tiny("tiny-llama");
    assert_clear_error(
        &troupe(&[
            "generate",
            "--model",
            &m,
            "--prompt-ids",
            "1,2",
            "--temperature",
            "-1",
        ]),
        "temperature",
    );
    assert_clear_error(
        &troupe(&["generate", "--model", &m, "--prompt-ids", "1,99999"]),
        "token id 99999",
    );
    assert_clear_error(
        &troupe(&[
            "generate",
            "--model",
            &m,
            "--prompts-file",
            "/nonexistent/p.jsonl",
        ]),
        "/nonexistent/p.jsonl",
    );
    assert_clear_error(
        &troupe(&["generate", "--model", &m]),
        "nothing to generate from",
    );
}

#[test]
fn text_prompt_on_a_tokenizerless_checkpoint_asks_for_ids() {
    let dir = common::scratch_dir("cli-notok");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(common::goldens().join("tiny-llama").join(f), dir.join(f)).unwrap();
    }
    assert_clear_error(
        &troupe(&[
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt",
            "hi",
        ]),
        "--prompt-ids",
    );
    let ok = troupe(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt-ids",
        "1,2,3",
        "--max-tokens",
        "3",
    ]);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
}

#[test]
fn jsonl_sampling_fields_reach_the_sampler_and_bad_ones_are_named() {
    // A +100 bias on one token makes greedy decoding pick it every time.
    let file = scratch(
        "bias.jsonl",
        b"{\"prompt_ids\":[5,6,7],\"max_tokens\":5,\"logit_bias\":{\"42\":100},\"stop_token_ids\":[999]}\n",
    );
    let out = troupe(&[
        "generate",
        "--model",
        &tiny("tiny-llama"),
        "--prompts-file",
        file.to_str().unwrap(),
        "--json",
        "--ignore-eos",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(common::ids(&line["token_ids"]), vec![42; 5]);
    assert!(line["seed"].is_u64(), "the seed is reported: {line}");
    let bad = scratch(
        "badbias.jsonl",
        b"{\"prompt_ids\":[5],\"logit_bias\":{\"x\":1}}\n",
    );
    let out = troupe(&[
        "generate",
        "--model",
        &tiny("tiny-llama"),
        "--prompts-file",
        bad.to_str().unwrap(),
    ]);
    assert_clear_error(&out, "logit_bias key `x`");
    // A bad prompt is named by its line of the file (blank lines counted), as the file's
    // own parse errors are: prompts once counted from 0, lines from 1.
    let third = scratch(
        "third.jsonl",
        b"{\"prompt_ids\":[5]}\n\n{\"prompt_ids\":[5],\"temperature\":-2}\n",
    );
    let out = troupe(&[
        "generate",
        "--model",
        &tiny("tiny-llama"),
        "--prompts-file",
        third.to_str().unwrap(),
    ]);
    assert_clear_error(&out, "third.jsonl line 3: temperature");
    let far = scratch(
        "far.jsonl",
        b"{\"prompt_ids\":[5]}\n{\"prompt_ids\":[99999999]}\n",
    );
    let out = troupe(&[
        "generate",
        "--model",
        &tiny("tiny-llama"),
        "--prompts-file",
        far.to_str().unwrap(),
    ]);
    assert_clear_error(&out, "far.jsonl line 2 is outside");
    let out = troupe(&[
        "generate",
        "--model",
        &tiny("tiny-llama"),
        "--prompt-ids",
        "5",
        "--min-p",
        "1.5",
    ]);
    assert_clear_error(&out, "min_p");
}

#[test]
fn dummy_weights_run_the_configs_shape_reproducibly_without_reading_the_checkpoint() {
    let dir = common::scratch_dir("dummy");
    // Only the config: the checkpoint's tensors are not there to read.
    std::fs::copy(
        Path::new(&tiny("tiny-qwen3")).join("config.json"),
        dir.join("config.json"),
    )
    .unwrap();
    let run = |model: &str, dummy: bool| {
        let mut args = vec![
            "generate",
            "--model",
            model,
            "--prompt-ids",
            "5,6,7,8",
            "--max-tokens",
            "12",
            "--ignore-eos",
            "--json",
        ];
        if dummy {
            args.push("--dummy-weights");
        }
        let out = troupe(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["token_ids"].clone()
    };
    let a = run(dir.to_str().unwrap(), true);
    assert_eq!(a.as_array().unwrap().len(), 12);
    assert_eq!(
        a,
        run(dir.to_str().unwrap(), true),
        "the same seeds, the same weights"
    );
    assert_ne!(
        a,
        run(&tiny("tiny-qwen3"), false),
        "not the checkpoint's weights"
    );
    let err = troupe(&[
        "generate",
        "--model",
        &tiny("tiny-llama.gguf"),
        "--dummy-weights",
        "--prompt-ids",
        "1",
    ]);
    assert_clear_error(&err, "config.json");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn stats_go_to_stderr_or_to_a_file() {
    let model = tiny("tiny-llama");
    let file = scratch("stats.json", b"");
    let args = |stats: &[&str]| {
        let mut a = vec![
            "generate",
            "--model",
            &model,
            "--prompt-ids",
            "5,6,7,8",
            "--max-tokens",
            "9",
            "--ignore-eos",
            "--json",
            "--stats",
        ];
        a.extend_from_slice(stats);
        troupe(&a)
    };
    let to_file = args(&[file.to_str().unwrap()]);
    assert!(
        to_file.status.success(),
        "{}",
        String::from_utf8_lossy(&to_file.stderr)
    );
    let read = || -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap()
    };
    let s = read();
    assert_eq!(s["output_tokens"], 9);
    assert!(s["steps"].as_u64().unwrap() >= 9, "{s}");
    assert!(s["elapsed_s"].as_f64().unwrap() > 0.0, "{s}");
    // Two tokens a step: the four-token prompt takes two steps instead of one.
    assert!(
        args(&[file.to_str().unwrap(), "--max-num-batched-tokens", "2"])
            .status
            .success()
    );
    assert_eq!(
        read()["steps"].as_u64(),
        Some(s["steps"].as_u64().unwrap() + 1)
    );
    assert_clear_error(
        &args(&["--max-num-batched-tokens", "0"]),
        "--max-num-batched-tokens",
    );
    assert_clear_error(&args(&["--max-num-seqs", "0"]), "--max-num-seqs");
    // Without a file: the same object, last on stderr; other flags may follow `--stats`.
    let to_stderr = args(&["--no-zos"]);
    let stderr = String::from_utf8_lossy(&to_stderr.stderr);
    let line = stderr
        .lines()
        .rfind(|l| l.starts_with('{'))
        .expect("a JSON line");
    let s: serde_json::Value = serde_json::from_str(line).unwrap();
    assert_eq!(s["output_tokens"], 9);
    let unwritable = args(&["/nonexistent-dir/stats.json"]);
    assert_clear_error(&unwritable, "--stats /nonexistent-dir/stats.json");
}

#[test]
fn tensor_parallel_ranks_generate_the_same_tokens_and_bad_sizes_are_named() {
    let model = tiny("tiny-llama");
    let run = |tp: &str| {
        troupe(&[
            "generate",
            "--model",
            &model,
            "--prompt-ids",
            "5,6,7,8",
            "--max-tokens",
            "12",
            "--ignore-eos",
            "--json",
            "--stats",
            "-",
            "--tp",
            tp,
        ])
    };
    let (one, two) = (run("1"), run("2"));
    assert!(
        two.status.success(),
        "{}",
        String::from_utf8_lossy(&two.stderr)
    );
    let tokens = |o: &Output| {
        let v: serde_json::Value =
            serde_json::from_str(String::from_utf8_lossy(&o.stdout).lines().next().unwrap())
                .unwrap();
        v["token_ids"].clone()
    };
    assert_eq!(tokens(&one), tokens(&two));
    assert!(
        String::from_utf8_lossy(&two.stderr).contains("\"tensor_parallel_size\":2"),
        "{}",
        String::from_utf8_lossy(&two.stderr)
    );
    assert_clear_error(&run("3"), "does not divide the model's 4 attention heads");
    assert_clear_error(&run("0"), "at least 1");
}

#[test]
fn rust_log_turns_on_the_engines_log_and_stderr_is_quiet_without_it() {
    let model = tiny("tiny-llama");
    let run = |log: Option<&str>| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_troupe"));
        cmd.args(["generate", "--model", &model, "--prompt-ids", "1,2,3"])
            .args(["--max-tokens", "2", "--json"])
            .env_remove("RUST_LOG");
        if let Some(filter) = log {
            cmd.env("RUST_LOG", filter);
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success());
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    assert_eq!(run(None), "");
    let logged = run(Some("troupe=debug"));
    assert!(logged.contains("step launching"), "{logged}");
    assert!(logged.contains("sampled tokens published"), "{logged}");
}
