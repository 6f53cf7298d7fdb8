//! `--model org/name[@revision][:quant]`: a model from the Hugging Face hub, fetched with
//! the `hf-hub` crate into the standard cache (`HF_HOME`, default `~/.cache/huggingface`;
//! the layout Python's huggingface_hub reads and writes, so each sees what the other
//! fetched). Only what troupe loads is fetched: the config, tokenizer and chat-template
//! files and the safetensors shards, or one GGUF file chosen by quant or file name.
//! `HF_ENDPOINT` points at a mirror, `HF_TOKEN` (or `huggingface-cli login`'s token) opens
//! gated repositories, `HF_HUB_OFFLINE=1` uses the cache alone. An interrupted download
//! resumes (its partial blob is kept), and a weight file whose hub checksum is its SHA-256
//! is checked against it.

use std::path::{Path, PathBuf};

use hf_hub::api::sync::{ApiBuilder, ApiRepo};
use hf_hub::{Cache, Repo, RepoType};

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

/// `--model MODEL --gguf-file FILE` as one model spec: a directory's file, or a hub id with
/// the file as its `:FILE` suffix.
pub fn with_gguf_file(model: &str, file: &str) -> Result<String> {
    let refuse = |why: String| Err(TroupeError::InvalidInput(format!("--gguf-file: {why}")));
    if Path::new(model).is_dir() {
        return Ok(Path::new(model).join(file).to_string_lossy().into_owned());
    }
    match RepoSpec::parse(model) {
        Some(spec) if spec.gguf.is_some() => refuse(format!(
            "`{model}` names its GGUF file already (`:{}`)",
            spec.gguf.unwrap_or_default()
        )),
        Some(_) if file.contains('/') || file.is_empty() => refuse(format!(
            "`{file}` is not a file name of the repository's top level"
        )),
        Some(_) => Ok(format!("{model}:{file}")),
        None => refuse(format!(
            "`{model}` is neither a hub id nor a model directory to take `{file}` from"
        )),
    }
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
    std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| {
        ["1", "true", "yes", "on"]
            .iter()
            .any(|t| v.trim().eq_ignore_ascii_case(t))
    })
}

fn env_path(name: &str) -> Option<PathBuf> {
    std::env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

fn hf_home() -> PathBuf {
    env_path("HF_HOME").unwrap_or_else(|| {
        env_path("XDG_CACHE_HOME")
            .or_else(|| dirs::home_dir().map(|h| h.join(".cache")))
            .unwrap_or_else(std::env::temp_dir)
            .join("huggingface")
    })
}

/// huggingface_hub's order: `HF_HUB_CACHE`, `HUGGINGFACE_HUB_CACHE`, `$HF_HOME/hub`,
/// `$XDG_CACHE_HOME/huggingface/hub`, `~/.cache/huggingface/hub`.
fn cache() -> Cache {
    Cache::new(
        env_path("HF_HUB_CACHE")
            .or_else(|| env_path("HUGGINGFACE_HUB_CACHE"))
            .unwrap_or_else(|| hf_home().join("hub")),
    )
}

/// `HF_TOKEN`, `HUGGING_FACE_HUB_TOKEN`, then `huggingface-cli login`'s token file.
fn token() -> Option<String> {
    ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"]
        .iter()
        .filter_map(|k| std::env::var(k).ok())
        .chain(std::fs::read_to_string(hf_home().join("token")).ok())
        .map(|t| t.trim().to_string())
        .find(|t| !t.is_empty())
}

fn err(spec: &RepoSpec, reason: impl std::fmt::Display) -> TroupeError {
    TroupeError::Fetch {
        name: format!("{}@{}", spec.repo_id, spec.revision),
        reason: reason.to_string(),
    }
}

const INDEX: &str = "model.safetensors.index.json";
const MAX_RETRIES: u32 = 3;

/// The local path of the model: its snapshot directory (safetensors) or GGUF file. Every
/// file comes from the commit the revision names now, so a snapshot is never a mix.
pub fn fetch(spec: &RepoSpec) -> Result<PathBuf> {
    let cache = cache();
    if offline() {
        return from_cache(spec, &cache);
    }
    let mut builder = ApiBuilder::from_cache(cache.clone())
        .with_progress(true)
        .with_token(token());
    if let Ok(endpoint) = std::env::var("HF_ENDPOINT") {
        builder = builder.with_endpoint(endpoint.trim_end_matches('/').to_string());
    }
    let api = builder.build().map_err(|e| err(spec, e))?;
    let info = api
        .repo(spec.repo())
        .info()
        .map_err(|e| err(spec, describe(&e)))?;
    let pinned = api.repo(Repo::with_revision(
        spec.repo_id.clone(),
        RepoType::Model,
        info.sha.clone(),
    ));
    let snapshot = repo_dir(spec, &cache).join("snapshots").join(&info.sha);
    let files: Vec<&str> = info.siblings.iter().map(|s| s.rfilename.as_str()).collect();
    let mut wanted = choose_files(spec, &files)?;
    for file in &wanted {
        fetch_file(spec, &pinned, &snapshot, file)?;
    }
    if wanted.iter().any(|f| f == INDEX) {
        for shard in index_shards(spec, &snapshot)? {
            fetch_file(spec, &pinned, &snapshot, &shard)?;
            wanted.push(shard);
        }
    }
    set_ref(spec, &cache, &info.sha)?;
    Ok(model_path(&wanted, &snapshot.join(&wanted[0])))
}

fn repo_dir(spec: &RepoSpec, cache: &Cache) -> PathBuf {
    cache
        .path()
        .join(format!("models--{}", spec.repo_id.replace('/', "--")))
}

/// `refs/<revision>` names the commit fetched, as huggingface_hub writes it (hf-hub also
/// leaves a ref under the commit's own name, which is none).
fn set_ref(spec: &RepoSpec, cache: &Cache, sha: &str) -> Result<()> {
    let refs = repo_dir(spec, cache).join("refs");
    if spec.revision != sha {
        let _ = std::fs::remove_file(refs.join(sha));
    }
    let path = refs.join(&spec.revision);
    std::fs::create_dir_all(path.parent().expect("a ref has a directory"))
        .and_then(|()| std::fs::write(&path, sha))
        .map_err(|e| TroupeError::io(&path, e))
}

/// The shard files `model.safetensors.index.json` maps weights to.
fn index_shards(spec: &RepoSpec, snapshot: &Path) -> Result<Vec<String>> {
    let path = snapshot.join(INDEX);
    let text = std::fs::read_to_string(&path).map_err(|e| TroupeError::io(&path, e))?;
    let index: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| err(spec, format!("{INDEX}: {e}")))?;
    let map = index["weight_map"]
        .as_object()
        .ok_or_else(|| err(spec, format!("{INDEX} has no weight_map")))?;
    let mut shards: Vec<String> = map
        .values()
        .filter_map(|v| v.as_str().map(str::to_string))
        .collect();
    shards.sort();
    shards.dedup();
    Ok(shards)
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
    // One whole checkpoint, or an index whose shards are read from it once fetched; other
    // `*.safetensors` (Mistral's `consolidated.safetensors`) are not the HF layout.
    if top.contains(&"model.safetensors") {
        wanted.retain(|f| f != INDEX);
        wanted.push("model.safetensors".into());
    } else if !top.contains(&INDEX) {
        wanted.extend(shards.iter().map(|s| s.to_string()));
    }
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

/// One file of the pinned commit: the snapshot's copy, or a download. A dropped
/// connection is tried again, each try reopening the partial blob at its length.
fn fetch_file(spec: &RepoSpec, repo: &ApiRepo, snapshot: &Path, file: &str) -> Result<PathBuf> {
    let local = snapshot.join(file);
    if local.exists() {
        return Ok(local);
    }
    let mut tries = 0;
    let path = loop {
        match repo.download(file) {
            Ok(path) => break path,
            Err(e) if tries < MAX_RETRIES && status_of(&e).is_none() => {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(200 << tries));
            }
            Err(e) => return Err(err(spec, format!("{file}: {}", describe(&e)))),
        }
    };
    verify(spec, file, &path)?;
    Ok(path)
}

/// The HTTP status of a refused request (ureq writes "<url>: status code <n>").
fn status_of(e: &hf_hub::api::sync::ApiError) -> Option<u16> {
    let text = e.to_string();
    let at = text.rfind(": status code ")? + ": status code ".len();
    text[at..]
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
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
    let got = super::hub::sha256_hex(&blob).map_err(|e| TroupeError::io(&blob, e))?;
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
    match status_of(e) {
        Some(404) => {
            format!("not found on the hub (a private or gated repository needs HF_TOKEN): {text}")
        }
        Some(401 | 403) => format!("access refused: set HF_TOKEN to a token with access ({text})"),
        _ => text,
    }
}

/// `HF_HUB_OFFLINE`: the revision's snapshot in the cache (`refs/<revision>` names its
/// commit), refused unless it holds everything the model needs.
fn from_cache(spec: &RepoSpec, cache: &Cache) -> Result<PathBuf> {
    let repo_dir = repo_dir(spec, cache);
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
    let mut wanted = choose_files(spec, &files)?;
    if wanted.iter().any(|f| f == INDEX) {
        wanted.extend(index_shards(spec, &dir)?);
    }
    // `exists` follows the snapshot's links: one to a missing blob is missing.
    if let Some(gone) = wanted.iter().find(|f| !dir.join(f).exists()) {
        return Err(err(
            spec,
            format!(
                "HF_HUB_OFFLINE is set and the cached snapshot is incomplete: {gone} is missing"
            ),
        ));
    }
    Ok(model_path(&wanted, &dir.join(&wanted[0])))
}

#[cfg(test)]
mod tests;
