use super::*;

/// A minimal GGUF writer for building test files byte by byte.
struct Writer {
    bytes: Vec<u8>,
}

impl Writer {
    fn new(version: u32, num_tensors: u64, num_kv: u64) -> Self {
        let mut w = Writer {
            bytes: b"GGUF".to_vec(),
        };
        w.u32(version);
        w.u64(num_tensors);
        w.u64(num_kv);
        w
    }
    fn u32(&mut self, v: u32) {
        self.bytes.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.bytes.extend_from_slice(&v.to_le_bytes());
    }
    fn str(&mut self, s: &str) {
        self.u64(s.len() as u64);
        self.bytes.extend_from_slice(s.as_bytes());
    }
    fn kv_str(&mut self, k: &str, v: &str) {
        self.str(k);
        self.u32(8);
        self.str(v);
    }
    fn kv_u32(&mut self, k: &str, v: u32) {
        self.str(k);
        self.u32(4);
        self.u32(v);
    }
    fn kv_str_array(&mut self, k: &str, items: &[&str]) {
        self.str(k);
        self.u32(9);
        self.u32(8);
        self.u64(items.len() as u64);
        for i in items {
            self.str(i);
        }
    }
    fn tensor_info(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) {
        self.str(name);
        self.u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(ty);
        self.u64(offset);
    }
    fn align(&mut self, a: usize) {
        while !self.bytes.len().is_multiple_of(a) {
            self.bytes.push(0);
        }
    }
}

fn write_tmp(name: &str, bytes: &[u8]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("troupe-gguf-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn valid_file() -> Vec<u8> {
    let mut w = Writer::new(3, 2, 3);
    w.kv_str("general.architecture", "llama");
    w.kv_u32("llama.block_count", 2);
    w.kv_str_array("tokenizer.ggml.tokens", &["a", "b", "ab"]);
    w.tensor_info("f32.weight", &[4, 2], 0, 0);
    w.tensor_info("q8.weight", &[32], 8, 64);
    w.align(32);
    for i in 0..8 {
        w.bytes.extend_from_slice(&(i as f32 * 0.5).to_le_bytes());
    }
    w.bytes.resize(w.bytes.len() + 32, 0); // pad to the second tensor at +64
    w.bytes
        .extend_from_slice(&half::f16::from_f32(0.25).to_le_bytes());
    w.bytes.extend((0..32).map(|i| (i as i8 - 16) as u8));
    w.bytes
}

#[test]
fn parses_metadata_tensors_and_data() {
    let p = write_tmp("valid.gguf", &valid_file());
    let g = GgufFile::open(&p).unwrap();
    assert_eq!(g.version, 3);
    assert_eq!(g.meta_str("general.architecture"), Some("llama"));
    assert_eq!(g.meta_u64("llama.block_count"), Some(2));
    assert_eq!(
        g.meta("tokenizer.ggml.tokens")
            .unwrap()
            .as_array()
            .unwrap()
            .len(),
        3
    );
    let t = g.tensor_info("f32.weight").unwrap();
    assert_eq!(
        (t.dims.clone(), t.ggml_type, t.num_bytes),
        (vec![4, 2], GgmlType::F32, 32)
    );
    let mut out = vec![0f32; 8];
    crate::kernels::quant::dequantize(t.ggml_type, g.tensor_bytes(t), &mut out);
    assert_eq!(out, (0..8).map(|i| i as f32 * 0.5).collect::<Vec<_>>());
    let q = g.tensor_info("q8.weight").unwrap();
    let mut out = vec![0f32; 32];
    crate::kernels::quant::dequantize(q.ggml_type, g.tensor_bytes(q), &mut out);
    assert_eq!(out[0], -16.0 * 0.25);
    assert_eq!(out[31], 15.0 * 0.25);
}

fn open_err(name: &str, bytes: &[u8]) -> String {
    match GgufFile::open(&write_tmp(name, bytes)) {
        Ok(_) => panic!("{name} parsed but is corrupt"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn corrupt_files_give_errors_naming_the_problem() {
    let good = valid_file();
    let mut bad_magic = good.clone();
    bad_magic[0] = b'X';
    assert!(open_err("magic.gguf", &bad_magic).contains("bad magic"));
    let mut bad_version = good.clone();
    bad_version[4] = 9;
    assert!(open_err("version.gguf", &bad_version).contains("version 9"));
    let truncated = &good[..good.len() - 10];
    assert!(open_err("trunc.gguf", truncated).contains("runs past the end"));
    let header_only = &good[..40];
    assert!(open_err("header.gguf", header_only).contains("truncated"));
    assert!(open_err("empty.gguf", b"").contains("shorter than the GGUF magic"));
    let mut huge_count = good.clone();
    huge_count[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(open_err("count.gguf", &huge_count).contains("implausibly large"));
}

#[test]
fn unknown_tensor_type_is_named() {
    let mut w = Writer::new(3, 1, 0);
    w.tensor_info("x", &[32], 99, 0);
    w.align(32);
    w.bytes.resize(w.bytes.len() + 64, 0);
    assert!(open_err("type.gguf", &w.bytes).contains("unsupported type id 99"));
}

/// Found by fuzzing: a shape whose byte count wraps u64 (2^62 f32 elements: 2^64 bytes,
/// 0 wrapped) passed the file-size check and sized a vector of 2^62 floats at load; an
/// offset that wraps past the data start likewise.
#[test]
fn shapes_and_offsets_that_wrap_are_refused() {
    let mut w = Writer::new(3, 1, 0);
    w.tensor_info("x", &[1 << 31, 1 << 31], 0, 0);
    w.align(32);
    w.bytes.resize(w.bytes.len() + 64, 0);
    assert!(open_err("wrap.gguf", &w.bytes).contains("overflows"));
    let mut w = Writer::new(3, 1, 0);
    w.tensor_info("x", &[8], 0, u64::MAX - 7);
    w.align(32);
    w.bytes.resize(w.bytes.len() + 64, 0);
    assert!(open_err("offset.gguf", &w.bytes).contains("overflows"));
}

/// Found by fuzzing: nested metadata arrays whose counts the file cannot hold reserved
/// 256 MiB from a 490 KiB file; a count past what is left of the file is refused first.
#[test]
fn an_array_count_past_the_files_end_is_refused_before_reserving() {
    let mut w = Writer::new(3, 0, 1);
    w.str("big");
    w.u32(9);
    w.u32(9);
    w.u64(1 << 20);
    w.bytes.resize(w.bytes.len() + 64, 0);
    assert!(open_err("array.gguf", &w.bytes).contains("cannot fit"));
}

/// A tensor copied out run by run (its file pages dropped as it goes) has the file's
/// bytes, for sizes across the run length and offsets off the page grid; a second copy
/// after the pages were dropped reads them back from the file.
#[test]
fn a_tensor_copied_out_in_runs_has_the_files_bytes() {
    for (case, blocks) in [1usize, 4_000, 123_457, 290_001].into_iter().enumerate() {
        let mut w = Writer::new(3, 2, 1);
        w.kv_str("general.architecture", "llama");
        w.tensor_info("small.weight", &[32], 8, 0);
        w.tensor_info("big.weight", &[32 * blocks as u64], 8, 64);
        w.align(32);
        let data_at = w.bytes.len();
        w.bytes.resize(data_at + 64, 7);
        let n = blocks * 34;
        w.bytes.extend(
            (0..n).map(|i| (crate::sampling::splitmix64((case * 1_000_003 + i) as u64) >> 7) as u8),
        );
        let p = write_tmp(&format!("runs{case}.gguf"), &w.bytes);
        let g = GgufFile::open(&p).unwrap();
        let t = g.tensor_info("big.weight").unwrap();
        let want = &std::fs::read(&p).unwrap()[data_at + 64..];
        assert_eq!(want.len(), n);
        let first = g.copy_out(t);
        assert!(
            first == want,
            "{blocks} blocks: the copy differs from the file"
        );
        let again = g.copy_out(t);
        assert!(again == want, "{blocks} blocks: the second copy differs");
    }
}
