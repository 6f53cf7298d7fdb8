//! Pinning a rank's thread to CPU cores: a GPU rank to the cores of its GPU's NUMA node
//! (read from sysfs), so the host work that feeds the device (launches, metadata, the
//! sampler's copies) runs near it; CPU ranks of a group to disjoint shares of the cores
//! the process may use, so ranks do not steal each other's caches. `--cpu-affinity off`
//! leaves the scheduler of the OS in charge.

use std::path::Path;

use crate::kernels::Device;

/// Whether rank threads are pinned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CpuAffinity {
    Off,
    /// Pin where a placement is known (a GPU's NUMA node; a CPU rank's share).
    #[default]
    Auto,
}

impl std::str::FromStr for CpuAffinity {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(CpuAffinity::Off),
            "auto" => Ok(CpuAffinity::Auto),
            other => Err(format!("--cpu-affinity must be off or auto, got `{other}`")),
        }
    }
}

/// Places a starting rank: a GPU rank's thread pinned to its GPU's node; a CPU rank given
/// a thread pool of its own pinned to its share of the cores, or to the first `threads` of
/// them, a thread a core (its kernels run on rayon's current pool); a GPU rank a
/// pool too where `threads` asks for one (its host experts' work). Returns the cores the
/// rank's work is pinned to (`None`: not pinned) and its pool. Failing to pin is not
/// fatal: the rank runs where the OS puts it, and says so. `check_threads` has refused
/// more threads than a share holds before any rank starts.
pub fn place_rank(
    affinity: CpuAffinity,
    threads: Option<usize>,
    device: Device,
    shard: crate::model::tensor_parallel::TpShard,
) -> (Option<Vec<usize>>, Option<rayon::ThreadPool>) {
    let cores = match affinity {
        CpuAffinity::Off => None,
        CpuAffinity::Auto => cores_for(device, shard.rank, shard.size, Path::new("/sys")),
    };
    let cores = match (device, cores) {
        (Device::Cuda(_), Some(near)) => match pin_current_thread(&near) {
            Ok(()) => Some(near),
            Err(e) => {
                tracing::warn!("rank {} not pinned: {e}", shard.rank);
                None
            }
        },
        (_, cores) => cores,
    };
    let pinned = match (device, cores) {
        (Device::Cpu, Some(share)) => {
            let n = threads.unwrap_or(share.len()).min(share.len());
            Some(share[..n].to_vec())
        }
        (_, cores) => cores,
    };
    if threads.is_none() && (device != Device::Cpu || pinned.is_none()) {
        return (pinned, None);
    }
    // One thread a core where pinned (rayon's default, the process's cores, otherwise).
    let num_threads = threads.or(pinned.as_ref().map(Vec::len)).unwrap_or(0);
    let to_pin = pinned.clone();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(num_threads)
        .thread_name(move |i| format!("troupe-rank{}-{i}", shard.rank))
        .start_handler(move |_| {
            let Some(cores) = &to_pin else { return };
            if let Err(e) = pin_current_thread(cores) {
                tracing::warn!("a rank thread was not pinned: {e}");
            }
        })
        .build();
    match pool {
        Ok(pool) => (pinned, Some(pool)),
        Err(e) => {
            tracing::warn!("rank {} has no pool of its own: {e}", shard.rank);
            (None, None)
        }
    }
}

/// `--threads` against the cores: at least one, and under `--cpu-affinity auto` no more
/// than every CPU rank's share holds (a pinned pool cannot use more cores than it has).
pub fn check_threads(
    threads: Option<usize>,
    affinity: CpuAffinity,
    device: Device,
    num_ranks: usize,
) -> Result<(), String> {
    let Some(n) = threads else { return Ok(()) };
    if n == 0 {
        return Err("--threads must be at least 1".into());
    }
    if affinity == CpuAffinity::Off || device != Device::Cpu {
        return Ok(());
    }
    for rank in 0..num_ranks {
        if let Some(share) = cores_for(device, rank, num_ranks, Path::new("/sys"))
            && n > share.len()
        {
            return Err(format!(
                "--threads {n} is more than the {} cores CPU rank {rank} of {num_ranks} may use \
                 under --cpu-affinity auto (cores {}): pass --threads {} or fewer, or \
                 --cpu-affinity off",
                share.len(),
                format_cpulist(&share),
                share.len()
            ));
        }
    }
    Ok(())
}

/// The cores rank `rank` of a group of `size` on `device` is pinned to, or `None` where
/// no placement is known (no NUMA information, too few cores for a share each).
pub fn cores_for(device: Device, rank: usize, size: usize, sysfs: &Path) -> Option<Vec<usize>> {
    let allowed = allowed_cores()?;
    match device {
        Device::Cpu => cpu_share(&allowed, rank, size),
        Device::Cuda(ordinal) => {
            let node = gpu_numa_node(&pci_address(ordinal)?, sysfs)?;
            let list = std::fs::read_to_string(
                sysfs.join(format!("devices/system/node/node{node}/cpulist")),
            )
            .ok()?;
            let near: Vec<usize> = parse_cpulist(&list)?
                .into_iter()
                .filter(|c| allowed.contains(c))
                .collect();
            (!near.is_empty()).then_some(near)
        }
    }
}

/// Rank `rank`'s contiguous share of `allowed` among `size` ranks (the first ranks take
/// one more core when they do not divide).
fn cpu_share(allowed: &[usize], rank: usize, size: usize) -> Option<Vec<usize>> {
    if size == 0 || rank >= size || allowed.len() < size {
        return None;
    }
    let (base, extra) = (allowed.len() / size, allowed.len() % size);
    let start = rank * base + rank.min(extra);
    let len = base + usize::from(rank < extra);
    Some(allowed[start..start + len].to_vec())
}

fn pci_address(ordinal: usize) -> Option<String> {
    crate::kernels::cuda::pci_address(ordinal)
}

/// The NUMA node of the PCI device at `address`; `None` where sysfs says -1 (one node).
fn gpu_numa_node(address: &str, sysfs: &Path) -> Option<usize> {
    let text =
        std::fs::read_to_string(sysfs.join(format!("bus/pci/devices/{address}/numa_node"))).ok()?;
    text.trim()
        .parse::<i64>()
        .ok()
        .and_then(|n| usize::try_from(n).ok())
}

/// A kernel cpulist (`0-3,8,10-11`), in order.
pub fn parse_cpulist(text: &str) -> Option<Vec<usize>> {
    let mut cores = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (a.parse::<usize>().ok()?, b.parse::<usize>().ok()?);
                if a > b {
                    return None;
                }
                cores.extend(a..=b);
            }
            None => cores.push(part.parse().ok()?),
        }
    }
    Some(cores)
}

/// `cores` as a cpulist (`0-3,8`), for reports.
pub fn format_cpulist(cores: &[usize]) -> String {
    let mut out = Vec::new();
    let mut i = 0;
    while i < cores.len() {
        let mut j = i;
        while j + 1 < cores.len() && cores[j + 1] == cores[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            cores[i].to_string()
        } else {
            format!("{}-{}", cores[i], cores[j])
        });
        i = j + 1;
    }
    out.join(",")
}

/// The cores this process may run on.
fn allowed_cores() -> Option<Vec<usize>> {
    // SAFETY: a zeroed cpu_set_t is an empty set; sched_getaffinity fills it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return None;
        }
        Some(
            (0..libc::CPU_SETSIZE as usize)
                .filter(|&c| libc::CPU_ISSET(c, &set))
                .collect(),
        )
    }
}

/// Pins the calling thread to `cores`; the OS's refusal otherwise.
pub fn pin_current_thread(cores: &[usize]) -> std::io::Result<()> {
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET stays within CPU_SETSIZE.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cores.iter().filter(|&&c| c < libc::CPU_SETSIZE as usize) {
            libc::CPU_SET(c, &mut set);
        }
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpulists_parse_and_print_back() {
        assert_eq!(
            parse_cpulist("0-3,8,10-11\n"),
            Some(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(format_cpulist(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(parse_cpulist("3-1"), None);
        assert_eq!(parse_cpulist("x"), None);
    }

    #[test]
    fn cpu_ranks_get_disjoint_shares_that_cover_the_cores() {
        let allowed: Vec<usize> = (0..10).collect();
        for size in 1..=10 {
            let shares: Vec<Vec<usize>> = (0..size)
                .map(|r| cpu_share(&allowed, r, size).unwrap())
                .collect();
            let all: Vec<usize> = shares.concat();
            assert_eq!(all, allowed, "size {size}");
            let lens: Vec<usize> = shares.iter().map(Vec::len).collect();
            assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1);
        }
        assert_eq!(cpu_share(&allowed, 0, 11), None);
    }

    #[test]
    fn a_gpu_rank_takes_its_nodes_cores_from_sysfs() {
        let dir = std::env::temp_dir().join(format!("troupe-affinity-{}", std::process::id()));
        let dev = dir.join("bus/pci/devices/0000:3b:00.0");
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::write(dev.join("numa_node"), "1\n").unwrap();
        assert_eq!(gpu_numa_node("0000:3b:00.0", &dir), Some(1));
        std::fs::write(dev.join("numa_node"), "-1\n").unwrap();
        assert_eq!(gpu_numa_node("0000:3b:00.0", &dir), None);
        assert_eq!(gpu_numa_node("0000:00:00.0", &dir), None);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
