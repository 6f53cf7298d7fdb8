//! The tree's shape: `scripts/check-layers.sh` against the real tree and against copies of
//! it with one planted offence each (a back-import, one inside a `use` group, two files
//! importing each other, a path in code closing a loop of two files and of three, a cycle
//! between pure cores), which it must name, and with look-alikes it must not count
//! (comments, strings, an inline module's `super::`); and no source file over 600 lines.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Runs the script on `src`: (passed, its output). Killed after a minute: a hang fails.
fn check(src: &Path) -> (bool, String) {
    let out_path = std::env::temp_dir().join(format!(
        "troupe-layers-{}-{}.out",
        std::process::id(),
        src.file_name().unwrap().to_string_lossy()
    ));
    let out = std::fs::File::create(&out_path).unwrap();
    let mut child = Command::new("bash")
        .arg(repo().join("scripts/check-layers.sh"))
        .arg(src)
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .stdin(Stdio::null())
        .spawn()
        .expect("bash runs");
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("check-layers.sh did not finish within 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let text = std::fs::read_to_string(&out_path).unwrap();
    let _ = std::fs::remove_file(&out_path);
    (status.success(), text)
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// A copy of `src/` with `line` prepended to each of `files`.
fn planted(name: &str, plants: &[(&str, &str)]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("troupe-layers-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    copy_tree(&repo().join("src"), &dir);
    for (file, line) in plants {
        let path = dir.join(file);
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, format!("{line}\n{text}")).unwrap();
    }
    dir
}

/// `check-layers.sh` on a copy of `src/` with `plants`: (passed, its output).
fn check_planted(name: &str, plants: &[(&str, &str)]) -> (bool, String) {
    let dir = planted(name, plants);
    let result = check(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

#[test]
fn the_tree_holds_its_layers() {
    let (ok, out) = check(&repo().join("src"));
    assert!(ok, "{out}");
    assert!(out.contains("layers hold"), "{out}");
}

#[test]
fn a_kernel_importing_the_engine_is_refused() {
    let (ok, out) = check_planted(
        "back",
        &[(
            "kernels/quant.rs",
            "#[allow(unused_imports)] use crate::engine::EngineHandle;",
        )],
    );
    assert!(!ok, "{out}");
    assert!(
        out.contains("kernels::quant imports engine") && out.contains("may not import `engine`"),
        "{out}"
    );
}

#[test]
fn two_files_importing_each_other_are_refused() {
    let (ok, out) = check_planted(
        "mutual",
        &[
            ("protocol/openai.rs", "use crate::protocol::anthropic::X;"),
            ("protocol/anthropic.rs", "use crate::protocol::openai::Y;"),
        ],
    );
    assert!(!ok, "{out}");
    assert!(
        out.contains("protocol::anthropic and protocol::openai import each other"),
        "{out}"
    );
}

#[test]
fn a_cycle_between_pure_cores_is_refused() {
    // sched imports spec (it plans drafts); spec importing sched closes a cycle.
    let (ok, out) = check_planted(
        "cycle",
        &[("spec/ngram.rs", "use crate::sched::Scheduler;")],
    );
    assert!(!ok, "{out}");
    assert!(out.contains("import cycle:"), "{out}");
    assert!(out.contains("sched") && out.contains("spec"), "{out}");
}

#[test]
fn a_back_import_inside_a_use_group_is_refused() {
    let (ok, out) = check_planted(
        "grouped",
        &[(
            "kernels/quant.rs",
            "#[allow(unused_imports)] use crate::{error::Result, engine::{EngineHandle, EngineConfig as C}};",
        )],
    );
    assert!(!ok, "{out}");
    assert!(
        out.contains("kernels::quant imports engine") && out.contains("may not import `engine`"),
        "{out}"
    );
}

#[test]
fn a_path_in_code_closes_a_loop_as_an_import_does() {
    // `super::` in an expression, and `super::{..}` groups: two files, then three.
    let (ok, out) = check_planted(
        "paths",
        &[
            (
                "protocol/jsonl.rs",
                "fn _planted() { let _ = super::reply::planted(); }",
            ),
            (
                "protocol/reply.rs",
                "use super::{jsonl::planted as _, metrics};",
            ),
        ],
    );
    assert!(!ok, "{out}");
    assert!(
        out.contains("protocol::jsonl and protocol::reply import each other"),
        "{out}"
    );
    let (ok, out) = check_planted(
        "loop3",
        &[
            ("cluster/registry.rs", "use super::{agent::{self}};"),
            (
                "cluster/agent.rs",
                "fn _planted() { super::kv_transfer::planted() }",
            ),
            (
                "cluster/kv_transfer.rs",
                "use crate::cluster::{registry::Registry as _};",
            ),
        ],
    );
    assert!(!ok, "{out}");
    assert!(out.contains("import loop between files:"), "{out}");
    for f in [
        "cluster::registry",
        "cluster::agent",
        "cluster::kv_transfer",
    ] {
        assert!(out.contains(f), "{f}: {out}");
    }
}

#[test]
fn paths_in_comments_strings_and_test_modules_are_not_imports() {
    // Each names the other only where no import is: a comment, a string, and `super::`
    // inside an inline module (its own file's module).
    let (ok, out) = check_planted(
        "quiet",
        &[
            (
                "protocol/jsonl.rs",
                "// use super::reply::X;\nconst _S: &str = \"super::reply::planted()\";",
            ),
            (
                "protocol/reply.rs",
                "#[cfg(test)] mod planted { #[allow(unused_imports)] use super::*; fn _f() { let _ = super::jsonl_free(); } }\nfn jsonl_free() {}\nuse super::jsonl as _;",
            ),
        ],
    );
    assert!(ok, "{out}");
}

/// One noun per file, files under 600 lines: every source file of the tree (Rust, CUDA,
/// Python, shell), tests and scripts included.
#[test]
fn no_source_file_is_over_600_lines() {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                // Goldens are data, written by scripts.
                if !path.ends_with("goldens") {
                    walk(&path, out);
                }
            } else if matches!(
                path.extension().and_then(|e| e.to_str()),
                Some("rs" | "cu" | "py" | "sh")
            ) {
                out.push(path);
            }
        }
    }
    let mut files = Vec::new();
    for dir in [
        "src",
        "tests",
        "benches",
        "scripts",
        "kernels-cuda",
        "kernels-ascend",
    ] {
        let d = repo().join(dir);
        if d.is_dir() {
            walk(&d, &mut files);
        }
    }
    assert!(files.len() > 100, "only {} files found", files.len());
    let long: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let n = std::fs::read_to_string(f).ok()?.lines().count();
            (n > 600).then(|| format!("{} ({n} lines)", f.display()))
        })
        .collect();
    assert!(long.is_empty(), "files over 600 lines: {long:?}");
}

/// Actors only decode a message, call the runner or a pure core, and reply: the whole of
/// `src/actors/` stays under 2 000 lines (it was 3 186 before the runner layer).
#[test]
fn the_actors_stay_thin() {
    fn lines(dir: &Path) -> usize {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .map(|p| {
                if p.is_dir() {
                    lines(&p)
                } else {
                    std::fs::read_to_string(&p).map_or(0, |t| t.lines().count())
                }
            })
            .sum()
    }
    let total = lines(&repo().join("src/actors"));
    assert!(total > 500, "src/actors has only {total} lines: moved?");
    assert!(total < 2000, "src/actors has {total} lines (at most 2 000)");
}
