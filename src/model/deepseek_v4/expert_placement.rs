//! Where a one-device rank keeps DeepSeek-V4's routed experts: on the device, or in host
//! memory where the CPU computes them beside it (`host_experts.rs`). llama.cpp's
//! `--cpu-moe` / `--n-cpu-moe N`, and by default a split that fills the device first: the
//! first layers' experts go to the host until the rest fit. Pure: sizes in, placement out.

use std::fmt;

/// `--cpu-moe` / `--n-cpu-moe N` / neither.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CpuMoe {
    /// Every routed expert on the device if they fit with the KV cache; else the first
    /// layers' experts in host memory, as few as make the rest fit.
    #[default]
    Auto,
    /// `--cpu-moe`: every routed expert in host memory.
    All,
    /// `--n-cpu-moe N`: the routed experts of the first N MoE layers in host memory.
    FirstLayers(usize),
}

impl CpuMoe {
    /// The flag as a user wrote it (for refusals).
    pub fn flag(self) -> String {
        match self {
            CpuMoe::Auto => "the automatic expert split".into(),
            CpuMoe::All => "--cpu-moe".into(),
            CpuMoe::FirstLayers(n) => format!("--n-cpu-moe {n}"),
        }
    }

    /// Whether the user asked for host experts (not left to the automatic split).
    pub fn is_explicit(self) -> bool {
        self != CpuMoe::Auto
    }
}

/// What the placement is decided from, in bytes.
#[derive(Debug, Clone, Copy)]
pub struct PlacementSizes {
    pub num_layers: usize,
    pub num_experts: usize,
    /// One routed expert's weights (gate, up, down) as stored.
    pub expert_bytes: usize,
    /// Device memory left for routed experts once everything else is placed (the other
    /// weights, the KV cache, a margin for activations); `None`: the device is the host.
    pub device_room_bytes: Option<usize>,
    /// Host memory the experts may take (available memory, less a margin).
    pub host_room_bytes: usize,
}

/// Per layer, how many routed experts live in host memory, and which: the first that
/// many in the layer's host order (expert id order until loads reorder a split layer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertPlacement {
    pub host_experts: Vec<usize>,
    pub num_experts: usize,
    /// Per layer, each expert's place in the order experts go to the host.
    place: Vec<Vec<u32>>,
}

impl ExpertPlacement {
    /// `host_experts[l]` experts of layer `l` in host memory, the lowest ids.
    pub fn new(host_experts: Vec<usize>, num_experts: usize) -> Self {
        let place = vec![(0..num_experts as u32).collect(); host_experts.len()];
        ExpertPlacement {
            host_experts,
            num_experts,
            place,
        }
    }

    pub fn all_on_device(num_layers: usize, num_experts: usize) -> Self {
        Self::new(vec![0; num_layers], num_experts)
    }

    pub fn on_host(&self, layer: usize, expert: usize) -> bool {
        self.host_experts
            .get(layer)
            .is_some_and(|&n| (self.place[layer][expert] as usize) < n)
    }

    /// The same number of host experts a layer, each split layer's host share its least
    /// loaded experts (`load(layer)`: tokens per expert; ties keep the lower id on the
    /// device): the device computes the hot experts, the host the cold ones.
    pub fn following(&self, load: impl Fn(usize) -> Vec<f64>) -> Self {
        let mut next = self.clone();
        for (l, &n) in self.host_experts.iter().enumerate() {
            if n == 0 || n == self.num_experts {
                continue;
            }
            let load = load(l);
            let mut coldest: Vec<usize> = (0..self.num_experts).collect();
            coldest.sort_by(|&a, &b| load[a].total_cmp(&load[b]).then(b.cmp(&a)));
            for (place, e) in coldest.into_iter().enumerate() {
                next.place[l][e] = place as u32;
            }
        }
        next
    }

    /// Experts on the other side in `other` than here.
    pub fn num_moved(&self, other: &ExpertPlacement) -> usize {
        (0..self.host_experts.len())
            .flat_map(|l| (0..self.num_experts).map(move |e| (l, e)))
            .filter(|&(l, e)| self.on_host(l, e) != other.on_host(l, e))
            .count()
    }

    /// Whether some layer has experts on both sides.
    pub fn has_split_layer(&self) -> bool {
        self.host_experts
            .iter()
            .any(|&n| n > 0 && n < self.num_experts)
    }

    pub fn num_host(&self) -> usize {
        self.host_experts.iter().sum()
    }

    pub fn num_device(&self) -> usize {
        self.host_experts.len() * self.num_experts - self.num_host()
    }

    pub fn any_on_host(&self) -> bool {
        self.num_host() > 0
    }

    /// The layers with at least one expert in host memory.
    pub fn host_layers(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.host_experts.len()).filter(|&l| self.host_experts[l] > 0)
    }

    /// One line for the log: layers, experts and bytes on each side.
    pub fn describe(&self, expert_bytes: usize) -> String {
        let gib = |n: usize| (n * expert_bytes) as f64 / (1u64 << 30) as f64;
        let whole = self
            .host_experts
            .iter()
            .filter(|&&n| n == self.num_experts)
            .count();
        let partial: Vec<String> = self
            .host_experts
            .iter()
            .enumerate()
            .filter(|&(_, &n)| n > 0 && n < self.num_experts)
            .map(|(l, n)| format!("{n} of layer {l}"))
            .collect();
        format!(
            "routed experts: {} in host memory ({:.2} GiB; {whole} whole layers{}), {} on the device ({:.2} GiB)",
            self.num_host(),
            gib(self.num_host()),
            if partial.is_empty() {
                String::new()
            } else {
                format!(", {}", partial.join(", "))
            },
            self.num_device(),
            gib(self.num_device()),
        )
    }
}

/// Why a placement cannot be made, naming the flag and the sizes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    #[error("--n-cpu-moe {asked}: the model has {layers} MoE layers")]
    TooManyLayers { asked: usize, layers: usize },
    #[error(
        "{flag}: {host_bytes} bytes of routed experts in host memory, but only {room_bytes} bytes of host memory are available"
    )]
    HostTooSmall {
        flag: String,
        host_bytes: usize,
        room_bytes: usize,
    },
    #[error(
        "{flag}: {device_bytes} bytes of routed experts left on the device, which has room for {room_bytes}; raise --n-cpu-moe or leave it out for the automatic split"
    )]
    DeviceTooSmall {
        flag: String,
        device_bytes: usize,
        room_bytes: usize,
    },
}

/// The placement `mode` asks for at `sizes`, or why it cannot be made.
pub fn place_experts(mode: CpuMoe, s: &PlacementSizes) -> Result<ExpertPlacement, PlacementError> {
    let (l, e) = (s.num_layers, s.num_experts);
    let first_layers =
        |n: usize| ExpertPlacement::new((0..l).map(|i| if i < n { e } else { 0 }).collect(), e);
    let placement = match mode {
        CpuMoe::All => first_layers(l),
        CpuMoe::FirstLayers(n) if n > l => {
            return Err(PlacementError::TooManyLayers {
                asked: n,
                layers: l,
            });
        }
        CpuMoe::FirstLayers(n) => first_layers(n),
        CpuMoe::Auto => match s.device_room_bytes {
            None => ExpertPlacement::all_on_device(l, e),
            Some(room) => {
                let fit = (room / s.expert_bytes.max(1)).min(l * e);
                let mut left = l * e - fit;
                let host = (0..l)
                    .map(|_| {
                        let n = left.min(e);
                        left -= n;
                        n
                    })
                    .collect();
                ExpertPlacement::new(host, e)
            }
        },
    };
    let host_bytes = placement.num_host() * s.expert_bytes;
    if host_bytes > s.host_room_bytes {
        return Err(PlacementError::HostTooSmall {
            flag: mode.flag(),
            host_bytes,
            room_bytes: s.host_room_bytes,
        });
    }
    let device_bytes = placement.num_device() * s.expert_bytes;
    if let Some(room) = s.device_room_bytes
        && device_bytes > room
    {
        return Err(PlacementError::DeviceTooSmall {
            flag: mode.flag(),
            device_bytes,
            room_bytes: room,
        });
    }
    Ok(placement)
}

impl fmt::Display for CpuMoe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.flag())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes(device: Option<usize>, host: usize) -> PlacementSizes {
        PlacementSizes {
            num_layers: 43,
            num_experts: 256,
            expert_bytes: 13_369_344,
            device_room_bytes: device,
            host_room_bytes: host,
        }
    }

    const GIB: usize = 1 << 30;

    #[test]
    fn the_automatic_split_fills_the_device_first_and_takes_the_first_layers_to_the_host() {
        // Generated device sizes from nothing to more than the experts take: whatever the
        // room, the device holds as many experts as fit and the host the rest, from layer 0.
        let s = sizes(None, 1 << 40);
        let total = s.num_layers * s.num_experts * s.expert_bytes;
        for step in 0..=50 {
            let room = total / 47 * step;
            let p = place_experts(CpuMoe::Auto, &sizes(Some(room), 1 << 40)).unwrap();
            let fit = (room / s.expert_bytes).min(s.num_layers * s.num_experts);
            assert_eq!(p.num_device(), fit, "room {room}");
            assert!(p.num_device() * s.expert_bytes <= room);
            // Host layers come first and whole, at most one layer split.
            let split: Vec<_> = p
                .host_experts
                .iter()
                .filter(|&&n| n > 0 && n < 256)
                .collect();
            assert!(split.len() <= 1, "{:?}", p.host_experts);
            assert!(p.host_experts.windows(2).all(|w| w[0] >= w[1]));
            for l in 0..43 {
                for e in [0, 100, 255] {
                    assert_eq!(p.on_host(l, e), e < p.host_experts[l]);
                }
            }
        }
        // Enough room: nothing moves; the CPU as the device: nothing moves.
        assert!(
            !place_experts(CpuMoe::Auto, &sizes(Some(total), 0))
                .unwrap()
                .any_on_host()
        );
        assert!(
            !place_experts(CpuMoe::Auto, &sizes(None, 0))
                .unwrap()
                .any_on_host()
        );
    }

    #[test]
    fn the_flags_place_what_they_name() {
        let all = place_experts(CpuMoe::All, &sizes(Some(0), 200 * GIB)).unwrap();
        assert_eq!(all.num_device(), 0);
        assert!(all.host_experts.iter().all(|&n| n == 256));
        let some =
            place_experts(CpuMoe::FirstLayers(23), &sizes(Some(80 * GIB), 200 * GIB)).unwrap();
        assert_eq!(
            some.host_layers().collect::<Vec<_>>(),
            (0..23).collect::<Vec<_>>()
        );
        assert!(some.describe(13_369_344).contains("23 whole layers"));
    }

    /// Generated loads: a split layer's host share becomes its coldest experts, as many
    /// as before; whole layers stay; a second pass over the same loads moves nothing.
    #[test]
    fn split_layers_follow_the_loads_hot_experts_to_the_device() {
        let e = 16;
        let p = ExpertPlacement::new(vec![e, 5, 0, 11], e);
        for seed in 0..20u64 {
            let load = |l: usize| -> Vec<f64> {
                (0..e)
                    .map(|x| {
                        let h = crate::sampling::splitmix64(seed ^ ((l * e + x) as u64 * 0x9e37));
                        (h % 100) as f64
                    })
                    .collect()
            };
            let next = p.following(load);
            assert_eq!(next.host_experts, p.host_experts);
            for l in 0..4 {
                let host: Vec<usize> = (0..e).filter(|&x| next.on_host(l, x)).collect();
                assert_eq!(host.len(), p.host_experts[l], "layer {l}");
                let (loads, n) = (load(l), p.host_experts[l]);
                if n > 0 && n < e {
                    let hottest_host = host.iter().map(|&x| loads[x]).fold(f64::MIN, f64::max);
                    let coldest_device = (0..e)
                        .filter(|x| !host.contains(x))
                        .map(|x| loads[x])
                        .fold(f64::MAX, f64::min);
                    assert!(
                        hottest_host <= coldest_device,
                        "layer {l}: {loads:?} {host:?}"
                    );
                } else {
                    assert!((0..e).all(|x| next.on_host(l, x) == p.on_host(l, x)));
                }
            }
            assert_eq!(next.following(load).num_moved(&next), 0);
            assert_eq!(p.num_moved(&next), next.num_moved(&p));
        }
        assert!(p.has_split_layer());
        assert!(!ExpertPlacement::new(vec![e, 0], e).has_split_layer());
    }

    #[test]
    fn impossible_splits_are_refused_by_name() {
        let e = place_experts(CpuMoe::FirstLayers(44), &sizes(None, 1 << 40)).unwrap_err();
        assert_eq!(e.to_string(), "--n-cpu-moe 44: the model has 43 MoE layers");
        let e = place_experts(CpuMoe::All, &sizes(Some(0), 100 * GIB)).unwrap_err();
        assert!(e.to_string().starts_with("--cpu-moe: "), "{e}");
        assert!(matches!(e, PlacementError::HostTooSmall { .. }));
        let e = place_experts(CpuMoe::Auto, &sizes(Some(70 * GIB), 50 * GIB)).unwrap_err();
        assert!(e.to_string().contains("automatic expert split"), "{e}");
        let e = place_experts(CpuMoe::FirstLayers(2), &sizes(Some(70 * GIB), 1 << 40)).unwrap_err();
        assert!(matches!(e, PlacementError::DeviceTooSmall { .. }), "{e}");
        assert!(e.to_string().contains("--n-cpu-moe 2"), "{e}");
    }
}
