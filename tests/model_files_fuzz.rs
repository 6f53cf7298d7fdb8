//! Model files are untrusted input: a hub id names whatever its owner uploaded. Mutated
//! GGUF files, safetensors headers, `config.json` of every architecture, `tokenizer.json`
//! and `tokenizer_config.json` (chat templates among its fields) are loaded as `--model`
//! loads them: the text side, then the weights. Every case must end within its time bound
//! with the model or a clear error — never a panic — and allocate no more than its files
//! justify (a counting allocator measures each case's peak).
//!
//! CI runs `TROUPE_FUZZ_CASES` cases a target (default 150); `TROUPE_FUZZ_CASES=1000000`
//! is the long mode BENCHMARKS.md quotes. `TROUPE_FUZZ_SEED` picks another sequence; a
//! failure names its target, case and seed, which reproduce it.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Value, json};
use troupe::sampling::splitmix64;
use troupe::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Counts live heap bytes and their peak since the last reset.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
/// While a case runs, one request past this many bytes ends the process (a case that asks
/// for terabytes must not take the machine down first).
static CASE_RUNNING: AtomicBool = AtomicBool::new(false);
const ONE_REQUEST_LIMIT: usize = 1 << 30;

// SAFETY: every call goes to the system allocator with the caller's layout; the counters
// are plain atomics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() > ONE_REQUEST_LIMIT && CASE_RUNNING.load(Ordering::Relaxed) {
            let msg = b"model_files_fuzz: a case asked for more than 1 GiB at once\n";
            // SAFETY: writes a static buffer to stderr.
            unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
            std::process::abort();
        }
        // SAFETY: forwarded as given.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as given.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn cases() -> u64 {
    std::env::var("TROUPE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(150)
}

fn seed() -> u64 {
    std::env::var("TROUPE_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5eed)
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = splitmix64(self.0);
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// Values that break parsers: zero, one, signs, widths' edges, sizes past the file.
fn interesting(rng: &mut Rng, file_len: usize) -> u64 {
    let picks = [
        0,
        1,
        2,
        u64::MAX,
        u64::MAX / 2,
        u32::MAX as u64,
        1 << 31,
        1 << 40,
        1 << 62,
        file_len as u64,
        file_len as u64 + 1,
        (file_len as u64).wrapping_sub(1),
        4096,
        rng.next(),
    ];
    picks[rng.below(picks.len() as u64) as usize]
}

/// A binary mutation inside `0..region` of `bytes`: bit flips, a 4- or 8-byte field set to
/// an interesting value, bytes inserted or removed, or the file cut.
fn mutate_bytes(rng: &mut Rng, bytes: &mut Vec<u8>, region: usize) {
    let region = region.min(bytes.len()).max(1);
    for _ in 0..1 + rng.below(3) {
        let at = rng.below(region as u64) as usize;
        match rng.below(6) {
            0 => {
                if at < bytes.len() {
                    bytes[at] ^= 1 << rng.below(8);
                }
            }
            1 | 2 => {
                let width = if rng.below(2) == 0 { 4 } else { 8 };
                let at = at / width * width;
                let v = interesting(rng, bytes.len()).to_le_bytes();
                if at + width <= bytes.len() {
                    bytes[at..at + width].copy_from_slice(&v[..width]);
                }
            }
            3 => {
                let n = 1 + rng.below(16) as usize;
                let fill: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                let at = at.min(bytes.len());
                bytes.splice(at..at, fill);
            }
            4 => {
                let end = (at + 1 + rng.below(16) as usize).min(bytes.len());
                bytes.drain(at.min(end)..end);
            }
            _ => bytes.truncate(rng.below(bytes.len() as u64 + 1) as usize),
        }
    }
}

/// A JSON value that breaks readers: wrong types, huge or negative numbers, deep nests,
/// long strings.
fn hostile_value(rng: &mut Rng) -> Value {
    match rng.below(12) {
        0 => Value::Null,
        1 => json!(-1),
        2 => json!(0),
        3 => json!(u64::MAX),
        4 => json!(1u64 << 40),
        5 => json!(1e308),
        6 => json!(-1e308),
        7 => json!("x".repeat(1 + rng.below(1 << 16) as usize)),
        8 => json!([]),
        9 => json!({}),
        10 => {
            let mut v = json!(1);
            for _ in 0..rng.below(200) {
                v = json!([v]);
            }
            v
        }
        _ => json!(true),
    }
}

/// Every path of `v` to a value (object keys and array indices), at most `limit`.
fn paths(v: &Value, prefix: &mut Vec<Value>, out: &mut Vec<Vec<Value>>, limit: usize) {
    if out.len() >= limit {
        return;
    }
    out.push(prefix.clone());
    match v {
        Value::Object(m) => {
            for (k, sub) in m {
                prefix.push(json!(k));
                paths(sub, prefix, out, limit);
                prefix.pop();
            }
        }
        Value::Array(a) => {
            for (i, sub) in a.iter().enumerate().take(8) {
                prefix.push(json!(i));
                paths(sub, prefix, out, limit);
                prefix.pop();
            }
        }
        _ => {}
    }
}

fn at_path<'a>(v: &'a mut Value, path: &[Value]) -> &'a mut Value {
    let mut v = v;
    for p in path {
        v = match p {
            Value::String(k) => &mut v[k.as_str()],
            Value::Number(i) => &mut v[i.as_u64().unwrap() as usize],
            _ => unreachable!(),
        };
    }
    v
}

/// A JSON document mutated: a value replaced by a hostile one, a key removed or added, or
/// (one time in eight) the text itself cut or flipped.
fn mutate_json(rng: &mut Rng, text: &[u8]) -> Vec<u8> {
    let Ok(mut v) = serde_json::from_slice::<Value>(text) else {
        return text.to_vec();
    };
    if rng.below(8) == 0 {
        let mut raw = text.to_vec();
        let len = raw.len();
        mutate_bytes(rng, &mut raw, len);
        return raw;
    }
    let mut all = Vec::new();
    paths(&v, &mut Vec::new(), &mut all, 4096);
    for _ in 0..1 + rng.below(3) {
        let path = all[rng.below(all.len() as u64) as usize].clone();
        let target = at_path(&mut v, &path);
        match rng.below(4) {
            0 if target.is_object() => {
                let keys: Vec<String> = target.as_object().unwrap().keys().cloned().collect();
                if !keys.is_empty() {
                    let k = &keys[rng.below(keys.len() as u64) as usize];
                    target.as_object_mut().unwrap().remove(k);
                }
            }
            1 if target.is_object() => {
                target[format!("fuzz_{}", rng.below(100))] = hostile_value(rng);
            }
            _ => *target = hostile_value(rng),
        }
        // Paths under a replaced value are gone: take new ones.
        all.clear();
        paths(&v, &mut Vec::new(), &mut all, 4096);
    }
    serde_json::to_vec(&v).unwrap()
}

/// A safetensors file with its header mutated as JSON (or its length field as bytes).
fn mutate_safetensors(rng: &mut Rng, bytes: &[u8]) -> Vec<u8> {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let (header, data) = (&bytes[8..8 + n], &bytes[8 + n..]);
    if rng.below(4) == 0 {
        let mut out = bytes.to_vec();
        mutate_bytes(rng, &mut out, 8 + n);
        return out;
    }
    let header = mutate_json(rng, header);
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&header);
    out.extend_from_slice(data);
    out
}

/// What `--model` does with a path: the text side, then the weights.
fn load(path: &Path) -> Result<(), String> {
    let text = troupe::model::load_text(path).map_err(|e| e.to_string())?;
    if text.deepseek_v4.is_some() {
        troupe::model::deepseek_v4::DsV4Model::load_dir(path).map_err(|e| e.to_string())?;
    } else {
        let backend = troupe::kernels::cpu::CpuBackend::default();
        troupe::model::load(path, &backend).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// `load(path)`, its panic caught, and the peak of live heap bytes over what was live
/// before it; one request past `ONE_REQUEST_LIMIT` meanwhile ends the process.
fn measured_load(path: &Path) -> (std::thread::Result<Result<(), String>>, usize) {
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    CASE_RUNNING.store(true, Ordering::Relaxed);
    let result = std::panic::catch_unwind(|| load(path));
    CASE_RUNNING.store(false, Ordering::Relaxed);
    (result, PEAK.load(Ordering::Relaxed).saturating_sub(before))
}

/// Runs `cases()` mutations of `target`: each loads within the bound, panics never, and
/// peaks at no more than 16 × its files' bytes + 64 MiB over what was live before it.
fn fuzz(
    target: &str,
    input_bytes: usize,
    mut make_case: impl FnMut(&mut Rng) -> PathBuf + Send + 'static,
) {
    let target = target.to_string();
    let (done, report) = std::sync::mpsc::channel();
    let worker_target = target.clone();
    std::thread::spawn(move || {
        let mut rng = Rng(seed() ^ splitmix64(worker_target.len() as u64));
        let (mut ok, mut refused) = (0u64, 0u64);
        for case in 0..cases() {
            let path = make_case(&mut rng);
            if std::env::var_os("TROUPE_FUZZ_VERBOSE").is_some() {
                eprintln!("{worker_target} case {case}: {}", path.display());
            }
            let (result, peak) = measured_load(&path);
            let verdict = match result {
                Err(p) => Err(format!(
                    "panicked: {}",
                    troupe::structured::panic_message(p.as_ref())
                )),
                Ok(_) if peak > 16 * input_bytes + (64 << 20) => Err(format!(
                    "peaked at {} MiB for {} KiB of files",
                    peak >> 20,
                    input_bytes >> 10
                )),
                Ok(Ok(())) => {
                    ok += 1;
                    Ok(())
                }
                Ok(Err(message)) if message.trim().is_empty() => Err("an empty error".into()),
                Ok(Err(_)) => {
                    refused += 1;
                    Ok(())
                }
            };
            if let Err(why) = verdict {
                let _ = done.send(Err(format!(
                    "{worker_target} case {case} (seed {}): {why}",
                    seed()
                )));
                return;
            }
        }
        let _ = done.send(Ok((ok, refused)));
    });
    // Each case well under a second here; a case that hangs fails the run.
    let limit = Duration::from_secs(60 + cases() / 2);
    match report.recv_timeout(limit) {
        Ok(Ok((ok, refused))) => {
            eprintln!("{target}: {ok} loaded, {refused} refused with an error");
            assert!(
                refused > 0,
                "{target}: no mutation was refused: the fuzzer mutates nothing"
            );
        }
        Ok(Err(failure)) => panic!("{failure}"),
        Err(_) => panic!("{target}: the cases did not end within {limit:?} (a hang)"),
    }
}

fn scratch(tag: &str) -> PathBuf {
    common::scratch_dir(&format!("fuzz-{tag}"))
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

fn dir_bytes(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len() as usize)
        .sum()
}

#[test]
fn mutated_gguf_files_load_or_are_refused() {
    for name in ["tiny-llama.gguf", "tiny-llama-q4_0.gguf", "tiny-qwen2.gguf"] {
        let original = std::fs::read(common::goldens().join(name)).unwrap();
        let path = scratch("gguf").join(name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        // The header (metadata and tensor table) is where the reader decides what to
        // allocate: most mutations land there.
        let header = original.len().min(64 << 10);
        let len = original.len();
        fuzz(&format!("gguf {name}"), len, move |rng| {
            let mut bytes = original.clone();
            let region = if rng.below(4) == 0 { len } else { header };
            mutate_bytes(rng, &mut bytes, region);
            std::fs::write(&path, &bytes).unwrap();
            path.clone()
        });
    }
}

/// One file of an HF directory mutated per case: `file`'s bytes through `mutate`.
fn fuzz_dir_file(model: &str, file: &'static str, mutate: fn(&mut Rng, &[u8]) -> Vec<u8>) {
    let source = common::goldens().join(model);
    let dir = scratch(&format!("{model}-{file}"));
    copy_dir(&source, &dir);
    let original = std::fs::read(source.join(file)).unwrap();
    let bytes = dir_bytes(&dir);
    fuzz(&format!("{model}/{file}"), bytes, move |rng| {
        std::fs::write(dir.join(file), mutate(rng, &original)).unwrap();
        dir.clone()
    });
}

#[test]
fn mutated_safetensors_headers_load_or_are_refused() {
    for model in ["tiny-llama", "tiny-qwen3", "tiny-dsv4-a"] {
        fuzz_dir_file(model, "model.safetensors", mutate_safetensors);
    }
}

#[test]
fn mutated_configs_of_every_architecture_load_or_are_refused() {
    for model in ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-dsv4-a"] {
        fuzz_dir_file(model, "config.json", mutate_json);
    }
}

#[test]
fn mutated_tokenizer_files_load_or_are_refused() {
    // Found by this fuzzer: the tokenizers crate panics on a decoder nested past serde's
    // recursion limit; the load must say so instead.
    let dir = scratch("deep-decoder");
    copy_dir(&common::goldens().join("tiny-qwen3"), &dir);
    let mut tok: Value =
        serde_json::from_slice(&std::fs::read(dir.join("tokenizer.json")).unwrap()).unwrap();
    let mut deep = json!(1);
    for _ in 0..200 {
        deep = json!([deep]);
    }
    tok["decoder"] = deep;
    std::fs::write(
        dir.join("tokenizer.json"),
        serde_json::to_vec(&tok).unwrap(),
    )
    .unwrap();
    let err = std::panic::catch_unwind(|| load(&dir))
        .expect("no panic")
        .unwrap_err();
    assert!(err.contains("tokenizer.json"), "{err}");

    fuzz_dir_file("tiny-qwen3", "tokenizer.json", mutate_json);
    // Its chat template among the fields.
    fuzz_dir_file("tiny-qwen3", "tokenizer_config.json", mutate_json);
}

/// A sharded checkpoint's index (`model.safetensors.index.json`): its weight map names
/// the shard of every tensor.
#[test]
fn mutated_shard_indexes_load_or_are_refused() {
    let source = common::goldens().join("tiny-llama");
    let dir = scratch("shard-index");
    copy_dir(&source, &dir);
    let shard = "model-00001-of-00001.safetensors";
    std::fs::rename(dir.join("model.safetensors"), dir.join(shard)).unwrap();
    let bytes = std::fs::read(dir.join(shard)).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let weight_map: serde_json::Map<String, Value> = header
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| *k != "__metadata__")
        .map(|k| (k.clone(), json!(shard)))
        .collect();
    let index = serde_json::to_vec(&json!({"metadata": {"total_size": bytes.len() - 8 - n},
        "weight_map": weight_map}))
    .unwrap();
    let index_path = dir.join("model.safetensors.index.json");
    std::fs::write(&index_path, &index).unwrap();
    load(&dir).expect("the unmutated sharded copy loads");
    // A shard named outside the directory is refused, not read.
    for outside in [
        "../tiny-llama/model.safetensors",
        "/etc/hostname",
        "a/../../b",
    ] {
        let mut climbing = serde_json::from_slice::<Value>(&index).unwrap();
        let first = climbing["weight_map"]
            .as_object()
            .unwrap()
            .keys()
            .next()
            .unwrap()
            .clone();
        climbing["weight_map"][first] = json!(outside);
        std::fs::write(&index_path, serde_json::to_vec(&climbing).unwrap()).unwrap();
        let err = load(&dir).unwrap_err();
        assert!(err.contains("not a file name"), "{outside}: {err}");
    }
    let total = dir_bytes(&dir);
    fuzz("shard index", total, move |rng| {
        std::fs::write(&index_path, mutate_json(rng, &index)).unwrap();
        dir.clone()
    });
}

/// Found by the long run and fixed, kept as cases of their own: a DeepSeek-V4 config of
/// 2^40 layers (a vector of that many layer kinds), a GGUF Llama q projection of no rows
/// (a division by zero while its rows were unpermuted), a context of 2^26 positions.
#[test]
fn the_long_runs_findings_stay_fixed() {
    let dir = scratch("dsv4-layers");
    copy_dir(&common::goldens().join("tiny-dsv4-a"), &dir);
    let mut cfg: Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    cfg["num_hidden_layers"] = json!(1u64 << 40);
    for key in ["layer_types", "compress_ratios", "mlp_layer_types"] {
        cfg.as_object_mut().unwrap().remove(key);
    }
    std::fs::write(dir.join("config.json"), serde_json::to_vec(&cfg).unwrap()).unwrap();
    let err = std::panic::catch_unwind(|| load(&dir))
        .expect("no panic")
        .unwrap_err();
    assert!(err.contains("num_hidden_layers"), "{err}");

    // A context of 2^26 positions declared by a small checkpoint: RoPE's table was built
    // for all of them at load (gigabytes); it is built for the first few thousand and
    // grows with the sequences that reach further.
    let dir = scratch("llama-context");
    copy_dir(&common::goldens().join("tiny-llama"), &dir);
    let mut cfg: Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    cfg["max_position_embeddings"] = json!(1u64 << 26);
    std::fs::write(dir.join("config.json"), serde_json::to_vec(&cfg).unwrap()).unwrap();
    let (result, peak) = measured_load(&dir);
    result.expect("no panic").expect("it loads");
    let bound = 16 * dir_bytes(&dir) + (64 << 20);
    assert!(peak <= bound, "peaked at {} MiB", peak >> 20);
}
