//! The `troupe` binary as the CLI tests run it, and the one shape of a clear error.
#![allow(dead_code)]

use std::process::{Command, Output};

pub fn troupe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_troupe"))
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .output()
        .expect("the troupe binary runs")
}

/// A golden checkpoint's path as an argument.
pub fn tiny(name: &str) -> String {
    super::goldens().join(name).display().to_string()
}

/// Exit code 2, one `error:` line that contains `needle`, and no panic.
pub fn assert_clear_error(out: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    assert!(
        !stderr.contains("panicked"),
        "panic reached the user: {stderr}"
    );
    assert!(stderr.starts_with("error"), "stderr: {stderr}");
    assert!(stderr.contains(needle), "expected {needle:?} in: {stderr}");
}

/// The token ids of a successful run's first JSON line.
pub fn token_ids(out: &Output) -> Vec<u32> {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let first = out.stdout.split(|&b| b == b'\n').next().unwrap_or_default();
    let line: serde_json::Value = serde_json::from_slice(first).unwrap();
    super::ids(&line["token_ids"])
}

/// A successful run's JSON lines (`--json`), in order.
pub fn json_lines(out: &Output) -> Vec<serde_json::Value> {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}
