use clap::{CommandFactory, Parser};

use super::{Cli, Command};

/// Flags of other tools that troupe's messages quote (cargo's, pip's, NVRTC's).
const OTHER_TOOLS: [&str; 6] = [
    "--features",
    "--release",
    "--no-deps",
    "--quiet",
    "--gpu-architecture",
    "--std",
];

fn long_flags(cmd: &clap::Command, out: &mut std::collections::BTreeSet<String>) {
    for arg in cmd.get_arguments() {
        out.extend(arg.get_long().map(|l| format!("--{l}")));
    }
    for sub in cmd.get_subcommands() {
        long_flags(sub, out);
    }
}

/// The `--flag`s of a line: `--` after a non-word character (or at the start), then a
/// lowercase letter, letters, digits and dashes.
fn flags_in(line: &str) -> Vec<&str> {
    let word = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c == b'-';
    let b = line.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(at) = line[i..].find("--").map(|p| p + i) {
        let starts = at == 0 || !word(b[at - 1]);
        let mut end = at + 2;
        if starts && b.get(end).is_some_and(u8::is_ascii_lowercase) {
            while b
                .get(end)
                .is_some_and(|&c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
            {
                end += 1;
            }
            out.push(&line[at..end]);
        }
        i = end.max(at + 2);
    }
    out
}

fn undescribed(cmd: &clap::Command, path: &str, out: &mut Vec<String>) {
    for arg in cmd.get_arguments().filter(|a| !a.is_hide_set()) {
        let id = arg.get_id().as_str();
        if id != "help" && id != "version" && arg.get_help().is_none() {
            out.push(format!("{path} {}", arg.get_long().unwrap_or(id)));
        }
    }
    for sub in cmd.get_subcommands() {
        undescribed(sub, &format!("{path} {}", sub.get_name()), out);
    }
}

/// Every option of every command says what it does in `--help` (`--prompt`,
/// `--max-tokens`, `--host`, `--port`, ... had a bare line).
#[test]
fn every_option_has_a_description() {
    let mut missing = Vec::new();
    undescribed(&Cli::command(), "troupe", &mut missing);
    assert!(missing.is_empty(), "options without help: {missing:#?}");
}

/// Every `--flag` the code writes outside comments (its errors and hints above all) is
/// one a troupe command takes, or another tool's: a message never sends a user to a flag
/// that does not exist.
#[test]
fn every_flag_a_message_names_exists() {
    let mut known = std::collections::BTreeSet::new();
    long_flags(&Cli::command(), &mut known);
    known.extend(OTHER_TOOLS.map(String::from));
    // clap's own.
    known.extend(["--help", "--version"].map(String::from));
    let mut unknown = Vec::new();
    let mut stack = vec![std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            for (n, line) in text.lines().enumerate() {
                if line.trim_start().starts_with("//") {
                    continue;
                }
                for f in flags_in(line) {
                    if !known.contains(f) {
                        unknown.push(format!("{}:{}: {f}", path.display(), n + 1));
                    }
                }
            }
        }
    }
    assert!(known.contains("--kv-cache-mib"), "the flags were read");
    assert!(unknown.is_empty(), "flags no command takes: {unknown:#?}");
}

/// `--stop A B` as the README writes it, and the flag repeated, both give every string.
#[test]
fn stop_takes_several_strings_either_way() {
    for args in [&["--stop", "A", "B"][..], &["--stop", "A", "--stop", "B"]] {
        let line = [&["troupe", "generate", "--prompt", "x"][..], args].concat();
        let cli = Cli::try_parse_from(line).unwrap_or_else(|e| panic!("{args:?}: {e}"));
        let Command::Generate(g) = cli.command else {
            panic!("not generate")
        };
        assert_eq!(g.stop, ["A", "B"], "{args:?}");
    }
}
