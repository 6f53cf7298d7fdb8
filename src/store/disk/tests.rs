use super::*;

/// A fresh directory under the system's temporary one, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    /// `tag`: the test's own, so tests running side by side never share a directory.
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("troupe-kv-{}-{tag}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// SplitMix64 of (a, b): test bytes and positions nobody picked by hand.
fn mix(a: u64, b: u64) -> u64 {
    let mut z = a.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ b.wrapping_add(0x6a09_e667_f3bc_c908);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn key(hash: u64) -> BlockKey {
    BlockKey {
        hash,
        parent_hash: hash.wrapping_mul(31),
        cache_salt: 7,
        tokens: (0..16).map(|t| t * hash as u32).collect(),
    }
}

fn payload(hash: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| mix(hash, i as u64) as u8).collect()
}

fn hit(hash: u64, len: usize) -> Shared<[u8]> {
    payload(hash, len).into()
}

fn age(tier: &DiskTier, hash: u64, secs: u64) {
    let f = fs::File::options()
        .write(true)
        .open(tier.path(hash))
        .unwrap();
    f.set_modified(SystemTime::now() - Duration::from_secs(secs))
        .unwrap();
}

#[test]
fn a_block_reads_back_whole_and_only_for_its_own_key() {
    let dir = TempDir::new("read-back");
    let tier = DiskTier::open(dir.0.clone(), u64::MAX, None, 1000).unwrap();
    let written = tier.write(&key(5), &payload(5, 1000)).unwrap();
    assert_eq!(written, fs::metadata(tier.path(5)).unwrap().len());
    assert_eq!(tier.read(&key(5)), DiskRead::Hit(hit(5, 1000)));
    assert_eq!(tier.read(&key(6)), DiskRead::Miss);
    let mut other = key(5);
    other.tokens[3] += 1;
    assert_eq!(
        tier.read(&other),
        DiskRead::Corrupt,
        "same hash, other tokens"
    );
    assert!(!tier.contains(5), "a file that failed its check is removed");
    tier.write(&key(8), &payload(8, 999)).unwrap();
    assert_eq!(
        tier.read(&key(8)),
        DiskRead::Corrupt,
        "another layout's length"
    );
}

#[test]
fn a_truncated_or_bit_flipped_file_is_a_miss_never_wrong_bytes() {
    let dir = TempDir::new("corrupt");
    let tier = DiskTier::open(dir.0.clone(), u64::MAX, None, 777).unwrap();
    let len = tier.write(&key(9), &payload(9, 777)).unwrap() as usize;
    let whole = fs::read(tier.path(9)).unwrap();
    // Positions drawn over the whole file: header, tokens and payload alike.
    for trial in 0..40u64 {
        let at = mix(trial, 1) as usize % len;
        let mut bytes = whole.clone();
        if trial % 2 == 0 {
            bytes.truncate(at);
        } else {
            bytes[at] ^= 1 << (trial % 8);
        }
        fs::write(tier.path(9), &bytes).unwrap();
        assert_eq!(
            tier.read(&key(9)),
            DiskRead::Corrupt,
            "trial {trial} at {at}"
        );
    }
    fs::write(tier.path(9), &whole).unwrap();
    assert_eq!(tier.read(&key(9)), DiskRead::Hit(hit(9, 777)));
}

#[test]
fn expired_files_go_and_the_least_recently_used_go_over_budget() {
    let dir = TempDir::new("gc");
    let file_bytes = {
        let probe = DiskTier::open(dir.0.join("probe"), u64::MAX, None, 500).unwrap();
        probe.write(&key(1), &payload(1, 500)).unwrap()
    };
    let tier = DiskTier::open(
        dir.0.join("ns"),
        3 * file_bytes,
        Some(Duration::from_secs(3600)),
        500,
    )
    .unwrap();
    for h in 1..=5 {
        tier.write(&key(h), &payload(h, 500)).unwrap();
        age(&tier, h, 100 * (10 - h));
    }
    age(&tier, 1, 7200);
    assert!(!tier.contains(1), "past its time to live");
    assert_eq!(tier.read(&key(1)), DiskRead::Miss);
    // 2 is the oldest left; a hit makes it the newest.
    assert!(matches!(tier.read(&key(2)), DiskRead::Hit(_)));
    age(&tier, 5, 7200);
    let done = tier.collect_garbage().unwrap();
    assert_eq!((done.expired, done.evicted), (1, 0), "{done:?}");
    tier.write(&key(6), &payload(6, 500)).unwrap();
    tier.write(&key(7), &payload(7, 500)).unwrap();
    let done = tier.collect_garbage().unwrap();
    assert_eq!(done.evicted, 2, "{done:?}");
    assert!(done.bytes <= 3 * file_bytes);
    let left: Vec<u64> = (1..=7).filter(|&h| tier.contains(h)).collect();
    assert_eq!(left, vec![2, 6, 7], "3 and 4 were least recently used");
}

#[test]
fn two_engines_share_a_directory() {
    let dir = TempDir::new("shared");
    let a = DiskTier::open(dir.0.clone(), u64::MAX, None, 4096).unwrap();
    let b = DiskTier::open(dir.0.clone(), u64::MAX, None, 4096).unwrap();
    a.write(&key(3), &payload(3, 4096)).unwrap();
    assert_eq!(b.read(&key(3)), DiskRead::Hit(hit(3, 4096)));
    // Both write the same blocks at once while a reader reads them: every read is a
    // whole block or a miss.
    std::thread::scope(|s| {
        for tier in [&a, &b] {
            s.spawn(move || {
                for h in 10..40 {
                    tier.write(&key(h), &payload(h, 4096)).unwrap();
                }
            });
        }
        s.spawn(|| {
            for _ in 0..3 {
                for h in 10..40 {
                    match b.read(&key(h)) {
                        DiskRead::Hit(p) => assert_eq!(*p, payload(h, 4096)[..]),
                        DiskRead::Miss => {}
                        DiskRead::Corrupt => panic!("block {h} read torn"),
                    }
                }
            }
        });
    });
    for h in 10..40 {
        assert_eq!(a.read(&key(h)), DiskRead::Hit(hit(h, 4096)));
    }
}

/// A writer that dies mid-file leaves a temporary file: no reader takes it for the block,
/// the collector removes it once stale, and the block is written whole later. A write
/// that fails (its name taken by a directory) reports the failure and leaves nothing.
#[test]
fn a_write_torn_by_a_crash_or_refused_leaves_no_block() {
    let dir = TempDir::new("torn-write");
    let tier = DiskTier::open(dir.0.clone(), u64::MAX, None, 500).unwrap();
    let whole = encode(&key(3), &payload(3, 500));
    for trial in 0..8u64 {
        let cut = mix(trial, 3) as usize % whole.len();
        let temp = dir.0.join(format!(".{:016x}.{}.{trial}.tmp", 3u64, 99_999));
        fs::write(&temp, &whole[..cut]).unwrap();
        assert_eq!(tier.read(&key(3)), DiskRead::Miss, "cut at {cut}");
        // Not yet stale: a live writer's file is left alone.
        tier.collect_garbage().unwrap();
        assert!(temp.exists());
        fs::File::options()
            .write(true)
            .open(&temp)
            .unwrap()
            .set_modified(SystemTime::now() - STALE_TEMP - Duration::from_secs(1))
            .unwrap();
        tier.collect_garbage().unwrap();
        assert!(!temp.exists(), "a stale temp file is removed");
    }
    tier.write(&key(3), &payload(3, 500)).unwrap();
    assert_eq!(tier.read(&key(3)), DiskRead::Hit(hit(3, 500)));

    fs::create_dir_all(tier.path(4).join("in-the-way")).unwrap();
    assert!(tier.write(&key(4), &payload(4, 500)).is_err());
    let left: Vec<_> = fs::read_dir(&dir.0)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| is_temp(&e.path()))
        .collect();
    assert!(
        left.is_empty(),
        "a failed write leaves no temp file: {left:?}"
    );
}
