//! `--model org/name[@revision][:quant]` against a hub stand-in on loopback that speaks
//! the routes the `hf-hub` crate calls (`/api/models/{id}/revision/{rev}`, ranged
//! `/{id}/resolve/{rev}/{file}`): only the model's files are fetched, into the standard
//! cache layout, with the token sent; the model then gives transformers' greedy tokens;
//! `HF_HUB_OFFLINE` reads the cache alone; a connection dropped mid-file resumes where it
//! broke; a checksum that does not match and a missing repository are clear errors.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::Output;
use std::time::Duration;
use troupe::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};

const COMMIT: &str = "4f3c2b1a00112233445566778899aabbccddeeff";
const TOKEN: &str = "hf_stand_in_token";

struct File {
    body: Vec<u8>,
    /// The hub's ETag: a weight file's SHA-256 (as `x-linked-etag`), a git id otherwise.
    etag: String,
    lfs: bool,
}

#[derive(Default)]
struct Hub {
    repos: HashMap<String, Vec<(String, File)>>,
    /// Files whose next full download is cut after half its bytes.
    cut_once: Vec<String>,
    /// Every request: (method, path, range header, authorization header).
    log: Vec<(String, String, String, String)>,
}

fn sha256_hex(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

fn repo_from_dir(dir: &Path, corrupt: bool) -> Vec<(String, File)> {
    let mut files = Vec::new();
    for name in [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
    ] {
        let body = std::fs::read(dir.join(name)).unwrap();
        let lfs = name.ends_with(".safetensors");
        let etag = if !lfs {
            format!("{:040x}", body.len() * 7919)
        } else if corrupt {
            sha256_hex(b"not these bytes")
        } else {
            sha256_hex(&body)
        };
        files.push((name.to_string(), File { body, etag, lfs }));
    }
    for (name, body) in [
        ("README.md", b"# a model card".to_vec()),
        ("original/consolidated.pth", vec![7u8; 64]),
    ] {
        files.push((
            name.to_string(),
            File {
                etag: format!("{:040x}", body.len()),
                body,
                lfs: false,
            },
        ));
    }
    files
}

fn serve(hub: Arc<Mutex<Hub>>) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { return };
            let hub = hub.clone();
            std::thread::spawn(move || answer(conn, &hub));
        }
    });
    port
}

fn answer(mut conn: std::net::TcpStream, hub: &Mutex<Hub>) {
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let mut parts = line.split_whitespace();
        let (method, path) = (
            parts.next().unwrap_or("").to_string(),
            parts.next().unwrap_or("").to_string(),
        );
        let (mut range, mut auth, mut len) = (String::new(), String::new(), 0usize);
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) <= 2 {
                break;
            }
            let (k, v) = h.split_once(':').unwrap_or((&h, ""));
            match k.trim().to_ascii_lowercase().as_str() {
                "range" => range = v.trim().to_string(),
                "authorization" => auth = v.trim().to_string(),
                "content-length" => len = v.trim().parse().unwrap_or(0),
                _ => {}
            }
        }
        let mut skip = vec![0; len];
        let _ = reader.read_exact(&mut skip);
        let mut hub = hub.lock().unwrap();
        hub.log
            .push((method.clone(), path.clone(), range.clone(), auth));
        let reply = route(&mut hub, &path, &range);
        drop(hub);
        let (status, headers, body, cut) = reply;
        let mut head = format!("HTTP/1.1 {status}\r\ncontent-length: {}\r\n", body.len());
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        if conn.write_all(head.as_bytes()).is_err() {
            return;
        }
        let sent = if cut { body.len() / 2 } else { body.len() };
        if conn.write_all(&body[..sent]).is_err() || cut {
            return;
        }
    }
}

type Reply = (&'static str, Vec<(&'static str, String)>, Vec<u8>, bool);

fn route(hub: &mut Hub, path: &str, range: &str) -> Reply {
    let not_found = (
        "404 Not Found",
        vec![("x-error-code", "RepoNotFound".to_string())],
        b"{\"error\":\"not found\"}".to_vec(),
        false,
    );
    if let Some(rest) = path.strip_prefix("/api/models/") {
        let Some((id, _rev)) = rest.split_once("/revision/") else {
            return not_found;
        };
        let Some(files) = hub.repos.get(id) else {
            return not_found;
        };
        let siblings: Vec<_> = files
            .iter()
            .map(|(n, _)| serde_json::json!({"rfilename": n}))
            .collect();
        let body = serde_json::json!({"sha": COMMIT, "siblings": siblings})
            .to_string()
            .into_bytes();
        return (
            "200 OK",
            vec![("content-type", "application/json".into())],
            body,
            false,
        );
    }
    // Any revision: a branch, or the commit a client pinned.
    let resolved = path.trim_start_matches('/').split_once("/resolve/");
    let Some((id, file)) = resolved.and_then(|(id, rest)| Some((id, rest.split_once('/')?.1)))
    else {
        return not_found;
    };
    let Some(f) = hub
        .repos
        .get(id)
        .and_then(|fs| fs.iter().find(|(n, _)| n == file))
        .map(|(_, f)| f)
    else {
        return not_found;
    };
    let total = f.body.len();
    let (from, to) = match range.strip_prefix("bytes=").and_then(|r| r.split_once('-')) {
        Some((a, b)) => (
            a.parse().unwrap_or(0),
            b.parse().unwrap_or(total - 1).min(total - 1),
        ),
        None => (0, total - 1),
    };
    let mut headers = vec![
        ("x-repo-commit", COMMIT.to_string()),
        ("etag", format!("\"{}\"", f.etag)),
        ("content-range", format!("bytes {from}-{to}/{total}")),
    ];
    if f.lfs {
        headers.push(("x-linked-etag", format!("\"{}\"", f.etag)));
    }
    let body = f.body[from..=to].to_vec();
    let full = from == 0 && to == total - 1 && total > 1;
    let cut = full && hub.cut_once.iter().any(|c| c == file);
    if cut {
        hub.cut_once.retain(|c| c != file);
    }
    ("206 Partial Content", headers, body, cut)
}

/// `troupe generate` on a hub id; a run that hangs is killed and fails the test.
fn troupe(model: &str, port: u16, home: &Path, extra_env: &[(&str, &str)]) -> Output {
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_troupe"))
        .args([
            "generate",
            "--model",
            model,
            "--prompt-ids",
            "213,122,31,88,276",
            "--max-tokens",
            "16",
            "--ignore-eos",
            "--json",
        ])
        .env("HF_HOME", home)
        .env("HF_ENDPOINT", format!("http://127.0.0.1:{port}"))
        .env("HF_TOKEN", TOKEN)
        .env_remove("HF_HUB_OFFLINE")
        .env_remove("HF_HUB_CACHE")
        .env_remove("HUGGINGFACE_HUB_CACHE")
        .envs(extra_env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(Duration::from_secs(120)) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            // SAFETY: signals our own child, which has not been reaped (its wait is pending).
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            panic!("troupe generate --model {model} did not finish within 120 s");
        }
    }
}

fn home(name: &str) -> std::path::PathBuf {
    common::scratch_path(&format!("hub-{name}"))
}

#[test]
fn a_hub_model_is_fetched_once_and_gives_transformers_tokens() {
    let dir = common::goldens().join("tiny-qwen3");
    let mut hub = Hub::default();
    hub.repos
        .insert("troupe-test/tiny-qwen3".into(), repo_from_dir(&dir, false));
    hub.cut_once.push("model.safetensors".into());
    let hub = Arc::new(Mutex::new(hub));
    let port = serve(hub.clone());
    let home = home("fetch");
    let out = troupe("troupe-test/tiny-qwen3", port, &home, &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let reference = common::read_json("tiny-qwen3/reference.json");
    assert_eq!(
        common::cli::token_ids(&out),
        common::ids(&reference["cases"][0]["greedy"])
    );

    let log = hub.lock().unwrap().log.clone();
    let fetched: Vec<&str> = log
        .iter()
        .filter_map(|(_, p, _, _)| p.split("/resolve/").nth(1)?.split_once('/').map(|(_, f)| f))
        .collect();
    assert!(
        !fetched
            .iter()
            .any(|f| *f == "README.md" || f.starts_with("original/")),
        "{fetched:?}"
    );
    for want in ["config.json", "tokenizer.json", "model.safetensors"] {
        assert!(
            fetched.contains(&want),
            "{want} was not fetched: {fetched:?}"
        );
    }
    assert!(
        log.iter()
            .all(|(_, _, _, auth)| auth == &format!("Bearer {TOKEN}")),
        "{log:?}"
    );
    // The cut download went on from where it broke.
    assert!(
        log.iter()
            .any(|(_, p, r, _)| p.ends_with("model.safetensors")
                && r.starts_with("bytes=")
                && !r.starts_with("bytes=0-")),
        "no resumed range: {log:?}"
    );
    // The standard layout: refs/main names the commit; the snapshot links to blobs.
    let repo_dir = home.join("hub").join("models--troupe-test--tiny-qwen3");
    assert_eq!(
        std::fs::read_to_string(repo_dir.join("refs/main"))
            .unwrap()
            .trim(),
        COMMIT
    );
    let weights = repo_dir
        .join("snapshots")
        .join(COMMIT)
        .join("model.safetensors");
    assert_eq!(
        std::fs::read(&weights).unwrap(),
        std::fs::read(dir.join("model.safetensors")).unwrap()
    );

    // Offline: the cache alone, no request.
    let before = hub.lock().unwrap().log.len();
    let out = troupe(
        "troupe-test/tiny-qwen3",
        port,
        &home,
        &[("HF_HUB_OFFLINE", "1")],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        hub.lock().unwrap().log.len(),
        before,
        "offline run reached the hub"
    );
    std::fs::remove_dir_all(&home).unwrap();
}

#[test]
fn bad_downloads_and_missing_models_are_clear_errors() {
    let dir = common::goldens().join("tiny-qwen3");
    let mut hub = Hub::default();
    hub.repos
        .insert("troupe-test/corrupt".into(), repo_from_dir(&dir, true));
    let port = serve(Arc::new(Mutex::new(hub)));
    let home = home("errors");
    let out = troupe("troupe-test/corrupt", port, &home, &[]);
    common::cli::assert_clear_error(&out, "SHA-256");
    let blobs = home.join("hub/models--troupe-test--corrupt/blobs");
    let left: Vec<_> = std::fs::read_dir(&blobs)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.metadata().unwrap().len() > 100_000)
        .collect();
    assert!(left.is_empty(), "the bad weights stayed in the cache");
    let out = troupe("troupe-test/absent", port, &home, &[]);
    common::cli::assert_clear_error(&out, "not found");
    let out = troupe(
        "troupe-test/never-fetched",
        port,
        &home,
        &[("HF_HUB_OFFLINE", "1")],
    );
    common::cli::assert_clear_error(&out, "HF_HUB_OFFLINE");
    std::fs::remove_dir_all(&home).unwrap();
}
