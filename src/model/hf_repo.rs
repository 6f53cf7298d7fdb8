//! `--model org/name[@revision][:quant]`: a model from the Hugging Face hub, fetched with
//! the `hf-hub` crate into the standard cache (`HF_HOME`, default `~/.cache/huggingface`;
//! the layout Python's huggingface_hub reads and writes, so each sees what the other
//! fetched). Only what troupe loads is fetched: the config, tokenizer and chat-template
//! files and the safetensors shards, or one GGUF file chosen by quant or file name.
//! `HF_ENDPOINT` points at a mirror, `HF_TOKEN` (or `huggingface-cli login`'s token) opens
//! gated repositories, `HF_HUB_OFFLINE=1` uses the cache alone. An interrupted download
//! resumes (its partial blob is kept), and a weight file whose hub checksum is its SHA-256
//! is checked against it.

use std::io::Read;
use std::path::{Path, PathBuf};

use hf_hub::api::sync::{ApiBuilder, ApiRepo};
use hf_hub::{Cache, Repo, RepoType};
use sha2::{Digest, Sha256};

use crate::error::{Result, TroupeError};

/// What troupe reads from an HF model directory besides the weights.
const TEXT_FILES: &[&str] = &[
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "model.safetensors.index.json",
];

/// A hub model named on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoSpec {
    pub repo_id: String,
    pub revision: String,
    /// A GGUF file's name, or a quant name a GGUF file's name contains (`Q4_K_M`).
    pub gguf: Option<String>,
}

impl RepoSpec {
    /// `org/name[@revision][:quant]`; `None` for anything else (a path, a known name).
    pub fn parse(spec: &str) -> Option<RepoSpec> {
        let (rest, gguf) = match spec.rsplit_once(':') {
            Some((r, q)) if !q.is_empty() && !q.contains('/') => (r, Some(q.to_string())),
            _ => (spec, None),
        };
        let (repo_id, revision) = match rest.split_once('@') {
            Some((r, rev)) if !rev.is_empty() => (r, rev),
            Some(_) => return None,
            None => (rest, "main"),
        };
        let (org, name) = repo_id.split_once('/')?;
        let ok = |s: &str| {
            !s.is_empty()
                && !s.starts_with(['.', '-'])
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        };
        (ok(org) && ok(name) && !name.contains("..")).then(|| RepoSpec {
            repo_id: repo_id.to_string(),
            revision: revision.to_string(),
            gguf,
        })
    }

    fn repo(&self) -> Repo {
        Repo::with_revision(self.repo_id.clone(), RepoType::Model, self.revision.clone())
    }
}

fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE")
        .is_ok_and(|v| matches!(v.trim(), "1" | "true" | "TRUE" | "yes" | "ON" | "on"))
}

fn err(spec: &RepoSpec, reason: impl std::fmt::Display) -> TroupeError {
    TroupeError::Fetch {
        name: format!("{}@{}", spec.repo_id, spec.revision),
        reason: reason.to_string(),
    }
}

/// The local path of the model: its snapshot directory (safetensors) or GGUF file.
pub fn fetch(spec: &RepoSpec) -> Result<PathBuf> {
    let cache = Cache::from_env();
    if offline() {
        return from_cache(spec, &cache);
    }
    let mut builder = ApiBuilder::from_cache(cache)
        .with_progress(true)
        .with_retries(3);
    if let Ok(endpoint) = std::env::var("HF_ENDPOINT") {
        builder = builder.with_endpoint(endpoint.trim_end_matches('/').to_string());
    }
    if let Ok(token) = std::env::var("HF_TOKEN") {
        builder = builder.with_token(Some(token).filter(|t| !t.trim().is_empty()));
    }
    let api = builder.build().map_err(|e| err(spec, e))?;
    let repo = api.repo(spec.repo());
    let info = repo.info().map_err(|e| err(spec, describe(&e)))?;
    let files: Vec<&str> = info.siblings.iter().map(|s| s.rfilename.as_str()).collect();
    let wanted = choose_files(spec, &files)?;
    let mut last = PathBuf::new();
    for file in &wanted {
        last = fetch_file(spec, &repo, file)?;
    }
    Ok(model_path(&wanted, &last))
}

/// A lone GGUF file is the model; otherwise the snapshot directory its files lie in.
fn model_path(wanted: &[String], a_file: &Path) -> PathBuf {
    match wanted {
        [one] if one.ends_with(".gguf") => a_file.to_path_buf(),
        _ => a_file
            .parent()
            .expect("a snapshot file has a directory")
            .to_path_buf(),
    }
}

/// The files a model of this repository needs, in the order they are fetched.
pub fn choose_files(spec: &RepoSpec, files: &[&str]) -> Result<Vec<String>> {
    let top: Vec<&str> = files.iter().copied().filter(|f| !f.contains('/')).collect();
    let ggufs: Vec<&str> = top
        .iter()
        .copied()
        .filter(|f| f.ends_with(".gguf"))
        .collect();
    let shards: Vec<&str> = top
        .iter()
        .copied()
        .filter(|f| f.ends_with(".safetensors"))
        .collect();
    if let Some(want) = &spec.gguf {
        let lower = want.to_ascii_lowercase();
        let matching: Vec<&str> = ggufs
            .iter()
            .copied()
            .filter(|f| *f == want || f.to_ascii_lowercase().contains(&lower))
            .collect();
        return match matching.as_slice() {
            [one] => Ok(vec![one.to_string()]),
            [] => Err(err(
                spec,
                format!("no GGUF file matches `{want}`; it has: {}", list(&ggufs)),
            )),
            many => Err(err(
                spec,
                format!("`{want}` matches several GGUF files: {}", list(many)),
            )),
        };
    }
    if shards.is_empty() {
        return match ggufs.as_slice() {
            [one] => Ok(vec![one.to_string()]),
            [] => Err(err(
                spec,
                "the repository has neither safetensors weights nor a GGUF file",
            )),
            many => Err(err(
                spec,
                format!(
                    "pick one GGUF file with `:QUANT` or `:FILE` after the name: {}",
                    list(many)
                ),
            )),
        };
    }
    let mut wanted: Vec<String> = TEXT_FILES
        .iter()
        .filter(|f| top.contains(f))
        .map(|f| f.to_string())
        .collect();
    wanted.extend(shards.iter().map(|s| s.to_string()));
    if !wanted.iter().any(|f| f == "config.json") {
        return Err(err(
            spec,
            "the repository has safetensors weights but no config.json",
        ));
    }
    Ok(wanted)
}

fn list(files: &[&str]) -> String {
    files.join(", ")
}

fn fetch_file(spec: &RepoSpec, repo: &ApiRepo, file: &str) -> Result<PathBuf> {
    let path = repo
        .get(file)
        .map_err(|e| err(spec, format!("{file}: {}", describe(&e))))?;
    verify(spec, file, &path)?;
    Ok(path)
}

/// The hub names an LFS file's blob by its SHA-256: a fetched weight file is checked
/// against it once, and removed when it does not match.
fn verify(spec: &RepoSpec, file: &str, path: &Path) -> Result<()> {
    let Ok(blob) = std::fs::canonicalize(path) else {
        return Ok(());
    };
    let want = blob
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default()
        .to_string();
    let is_sha256 = want.len() == 64 && want.bytes().all(|b| b.is_ascii_hexdigit());
    let checked = blob.with_extension("sha256-ok");
    if !is_sha256 || checked.exists() {
        return Ok(());
    }
    let mut f = std::fs::File::open(&blob).map_err(|e| TroupeError::io(&blob, e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| TroupeError::io(&blob, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    let got: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    if got != want.to_ascii_lowercase() {
        let _ = std::fs::remove_file(&blob);
        let _ = std::fs::remove_file(path);
        return Err(err(
            spec,
            format!(
                "{file}: the download's SHA-256 is {got}, the hub's is {want}; removed, fetch again"
            ),
        ));
    }
    let _ = std::fs::write(&checked, b"");
    Ok(())
}

fn describe(e: &hf_hub::api::sync::ApiError) -> String {
    let text = e.to_string();
    if text.contains("404") {
        format!("not found on the hub (a private or gated repository needs HF_TOKEN): {text}")
    } else if text.contains("401") || text.contains("403") {
        format!("access refused: set HF_TOKEN to a token with access ({text})")
    } else {
        text
    }
}

/// `HF_HUB_OFFLINE`: the revision's snapshot in the cache (`refs/<revision>` names its
/// commit), refused unless it holds what the model needs.
fn from_cache(spec: &RepoSpec, cache: &Cache) -> Result<PathBuf> {
    let repo_dir = cache
        .path()
        .join(format!("models--{}", spec.repo_id.replace('/', "--")));
    let is_commit =
        spec.revision.len() == 40 && spec.revision.bytes().all(|b| b.is_ascii_hexdigit());
    let commit = match is_commit {
        true => Some(spec.revision.clone()),
        false => std::fs::read_to_string(repo_dir.join("refs").join(&spec.revision))
            .ok()
            .map(|c| c.trim().to_string()),
    };
    let dir = commit.map(|c| repo_dir.join("snapshots").join(c));
    let Some(dir) = dir.filter(|d| d.is_dir()) else {
        return Err(err(
            spec,
            format!(
                "HF_HUB_OFFLINE is set and the cache ({}) has no snapshot of this revision",
                cache.path().display()
            ),
        ));
    };
    let names: Vec<String> = std::fs::read_dir(&dir)
        .map_err(|e| TroupeError::io(&dir, e))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    let files: Vec<&str> = names.iter().map(String::as_str).collect();
    let wanted = choose_files(spec, &files)?;
    Ok(model_path(&wanted, &dir.join(&wanted[0])))
}

#[cfg(test)]
mod tests;
