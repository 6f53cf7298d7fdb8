//! Routed experts kept in host memory and computed by the CPU beside the device
//! (`--cpu-moe`, `--n-cpu-moe N`, the automatic split of `expert_placement.rs`), as
//! llama.cpp and KTransformers run DeepSeek on one GPU. MXFP4 experts stay as shipped
//! (ggml's 17-byte blocks, the same codes and exponents) and run as integer dot products
//! against 8-bit activations (`kernels::cpu::packed`); other formats run as the CPU
//! backend runs them.
//!
//! A layer with host experts splits its routed products by an owner table: the device
//! is rank 0 and computes its experts' pairs (the host's come out as zero rows), the host
//! is rank 1 and computes the rest. The device's products, the shared expert and the
//! combine stay on the device; the host's rows are added into the device's before the
//! combine, so each token still adds its experts in expert order and a product the host
//! computes exactly as the device would gives the all-device run's bits.
//!
//! A step whose rows make the bus cheaper than the CPU (`expert_streaming.rs`) copies the
//! touched host experts' blocks to the device instead (pinned where the driver allows),
//! and the device computes the whole layer.

use std::cell::{Cell, RefCell};

use super::config::DsV4Config;
use super::expert_placement::ExpertPlacement;
use super::expert_streaming::{StreamCost, StreamExperts};
use super::weights::{EitherNaming, Expert, LinearData, LinearStore, NoTensors, Reader};
use crate::error::Result;
use crate::kernels::cpu::CpuBackend;
use crate::kernels::deepseek_v4::{DsV4Kernels, ExpertOwners};
use crate::kernels::fp4::Mxfp4Matrix;
use crate::kernels::quant::GgmlType;
use crate::kernels::{Backend, HostData, HostMatrix, HostPin};
use crate::model::loader::TensorSource;

/// Where the device stands in a split layer's owner table; the host is the other rank.
const DEVICE_RANK: u32 = 0;
const HOST_RANK: u32 = 1;

/// Steps of at most this many tokens count as decode in the host part's log.
const DECODE_TOKENS: usize = 32;

/// The routed experts of the placement's host layers, in host memory.
pub struct HostExperts<B: DsV4Kernels> {
    cpu: CpuBackend,
    /// By layer; `None` where the device holds every expert.
    layers: Vec<Option<HostLayer<B>>>,
    pub placement: ExpertPlacement,
    /// Per `[layer, expert]`, the pairs of the layers whose experts are all here (the
    /// device counts the others'); drained once a step by `take_counts`.
    counts: RefCell<Vec<u32>>,
    /// Bytes of one host expert's three matrices as held.
    expert_bytes: usize,
    /// Seconds in `compute` and the expert bytes it read since load, for decode-sized
    /// steps (at most `DECODE_TOKENS` tokens) and the others: the host part's bandwidth,
    /// logged when the experts go.
    busy_secs: [Cell<f64>; 2],
    read_bytes: [Cell<u64>; 2],
    /// The (token, expert) products computed, likewise.
    products: [Cell<u64>; 2],
    /// Whether a layer's host part is computed here or streamed to the device.
    cost: RefCell<StreamCost>,
    /// Layers streamed to the device and the expert bytes copied, for the log.
    streamed: [Cell<u64>; 2],
    /// Host seconds spent queueing those copies (they run on the device meanwhile), and
    /// waiting for them where `TROUPE_LAYER_TIMES` waits.
    streamed_issue_secs: Cell<f64>,
    streamed_wait_secs: Cell<f64>,
}

struct HostLayer<B: DsV4Kernels> {
    /// The device's page locks on `experts`' blocks, by expert id; dropped first.
    pins: Vec<Vec<HostPin>>,
    /// By expert id; `None`: on the device.
    experts: Vec<Option<Expert<CpuBackend>>>,
    /// Per expert `[1, owner rank]`: `ExpertShard::owner_table`'s layout for two ranks.
    owners: Vec<u32>,
    /// `owners` on the device, where the device computes some of the layer's experts.
    device_owners: Option<B::Ids>,
}

/// Host matrices as the CPU computes them: MXFP4 packed into ggml's blocks (never
/// expanded), everything else as the CPU backend takes it.
struct HostStore<'a>(&'a CpuBackend);

impl LinearStore for HostStore<'_> {
    type Backend = CpuBackend;
    fn backend(&self) -> &CpuBackend {
        self.0
    }

    fn store(
        &self,
        rows: usize,
        cols: usize,
        data: LinearData,
    ) -> Result<crate::kernels::cpu::CpuMatrix> {
        let blocks = match data {
            LinearData::Stored(HostData::Mxfp4(m)) => m.to_ggml_blocks(),
            LinearData::Stored(HostData::RandomMxfp4 { seed }) => {
                Mxfp4Matrix::random_ggml_blocks(rows, cols, seed)
            }
            data => return OnHost(self.0).store(rows, cols, data),
        };
        Ok(self.0.upload_matrix(HostMatrix {
            rows,
            cols,
            data: HostData::Quantized {
                ggml_type: GgmlType::MXFP4,
                bytes: blocks,
            },
        }))
    }
}

/// The default store (what the CPU backend makes of any matrix).
struct OnHost<'a>(&'a CpuBackend);

impl LinearStore for OnHost<'_> {
    type Backend = CpuBackend;
    fn backend(&self) -> &CpuBackend {
        self.0
    }
}

impl<B: DsV4Kernels> HostExperts<B> {
    /// Reads the placement's host experts from `src` (`None`: `--dummy-weights`' values,
    /// the same codes the device makes) and puts each split layer's owner table on
    /// `device`.
    pub fn load(
        cfg: &DsV4Config,
        src: Option<&dyn TensorSource>,
        placement: ExpertPlacement,
        device: &B,
        (batch_invariant, stream): (bool, StreamExperts),
    ) -> Result<Self> {
        let cpu = CpuBackend {
            batch_invariant,
            ..CpuBackend::default()
        };
        let mut layers: Vec<Option<HostLayer<B>>> = (0..cfg.num_layers).map(|_| None).collect();
        let pin = stream != StreamExperts::Never;
        let started = std::time::Instant::now();
        place_layers(&cpu, cfg, src, &placement, (device, pin), &mut layers)?;
        let expert_bytes = layers
            .iter()
            .flatten()
            .flat_map(|l| l.experts.iter().flatten())
            .next()
            .map_or(0, |e| {
                [&e.gate, &e.up, &e.down]
                    .iter()
                    .map(|m| m.resident_bytes())
                    .sum()
            });
        let mut host = HostExperts {
            cpu,
            layers,
            expert_bytes,
            busy_secs: Default::default(),
            read_bytes: Default::default(),
            products: Default::default(),
            counts: RefCell::new(vec![0; cfg.num_layers * cfg.num_routed_experts]),
            placement,
            cost: RefCell::new(StreamCost::new(stream, f64::INFINITY, 1.0)),
            streamed: Default::default(),
            streamed_issue_secs: Default::default(),
            streamed_wait_secs: Default::default(),
        };
        if stream == StreamExperts::Never {
            return Ok(host);
        }
        if host
            .held()
            .next()
            .is_some_and(|e| e.gate.packed_blocks().is_none())
        {
            if stream == StreamExperts::Always {
                return Err(crate::error::TroupeError::InvalidInput(
                    "--stream-experts always: the host experts are not kept packed (bf16 \
                     checkpoints, or --batch-invariant's panels); only packed blocks stream"
                        .into(),
                ));
            }
            host.cost.get_mut().mode = StreamExperts::Never;
            return Ok(host);
        }
        let pinned: usize = host
            .layers
            .iter()
            .flatten()
            .flat_map(|l| l.pins.iter().map(Vec::len))
            .sum();
        let (read, upload) = (host.measure_read(), host.measure_upload(device));
        *host.cost.get_mut() = StreamCost::new(stream, read, upload);
        tracing::info!(
            "host experts: {pinned} matrices pinned of {}; host reads {:.1} GB/s, copies to the device {:.1} GB/s ({:.1} s to load)",
            3 * host.placement.num_host(),
            read / 1e9,
            upload / 1e9,
            started.elapsed().as_secs_f64()
        );
        Ok(host)
    }

    /// The experts held here.
    fn held(&self) -> impl Iterator<Item = &Expert<CpuBackend>> {
        self.layers
            .iter()
            .flatten()
            .flat_map(|l| l.experts.iter().flatten())
    }

    /// Bytes a second every core together reads of the experts' blocks (up to 4 GiB of
    /// them, the best of three passes): the host part's bound.
    fn measure_read(&self) -> f64 {
        let mut regions: Vec<&[u8]> = Vec::new();
        let mut total = 0usize;
        for m in self.held().flat_map(|e| [&e.gate, &e.up, &e.down]) {
            if total >= 4 << 30 {
                break;
            }
            if let Some((_, blocks)) = m.packed_blocks() {
                total += blocks.len();
                regions.push(blocks);
            }
        }
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut best = 0f64;
        for _ in 0..3 {
            let started = std::time::Instant::now();
            let sum: u64 = std::thread::scope(|s| {
                let parts: Vec<_> = (0..threads)
                    .map(|t| {
                        let mine: Vec<&[u8]> =
                            regions.iter().skip(t).step_by(threads).copied().collect();
                        s.spawn(move || {
                            // Whole words, as a wide load reads them.
                            mine.iter()
                                .map(|r| {
                                    // SAFETY: any bytes are valid u64s; align_to splits
                                    // off the unaligned ends.
                                    let (_, words, _) = unsafe { r.align_to::<u64>() };
                                    words.iter().fold(0u64, |a, &w| a.wrapping_add(w))
                                })
                                .fold(0u64, u64::wrapping_add)
                        })
                    })
                    .collect();
                parts
                    .into_iter()
                    .map(|p| p.join().unwrap_or(0))
                    .fold(0u64, u64::wrapping_add)
            });
            std::hint::black_box(sum);
            best = best.max(total as f64 / started.elapsed().as_secs_f64());
        }
        best
    }

    /// Bytes a second host experts' blocks reach the device (up to 64 experts' copied,
    /// the better of two passes, each waited for).
    fn measure_upload(&self, device: &B) -> f64 {
        let probe = device.alloc(1);
        let mut best = 0f64;
        for _ in 0..2 {
            let started = std::time::Instant::now();
            let mut bytes = 0usize;
            let copies: Vec<B::Matrix> = self
                .held()
                .take(64)
                .flat_map(|e| [&e.gate, &e.up, &e.down])
                .filter_map(|m| {
                    let (ty, blocks) = m.packed_blocks()?;
                    bytes += blocks.len();
                    Some(device.upload_blocks(m.rows(), m.cols(), ty, blocks))
                })
                .collect();
            device.download(&probe, 1);
            best = best.max(bytes as f64 / started.elapsed().as_secs_f64());
            drop(copies);
        }
        best
    }

    /// Holds exactly `placement`'s host experts from now on: those it lacks read from
    /// `src` (`None`: made), those now on the device dropped; the owner tables follow.
    pub fn reside(
        &mut self,
        cfg: &DsV4Config,
        src: Option<&dyn TensorSource>,
        placement: ExpertPlacement,
        device: &B,
    ) -> Result<()> {
        let pin = self.cost.get_mut().mode != StreamExperts::Never;
        place_layers(
            &self.cpu,
            cfg,
            src,
            &placement,
            (device, pin),
            &mut self.layers,
        )?;
        self.placement = placement;
        Ok(())
    }

    /// Whether `layer` has experts here.
    pub fn has_layer(&self, layer: usize) -> bool {
        self.layers.get(layer).is_some_and(Option::is_some)
    }

    /// The split layer's table for the device's kernels: the device computes only its
    /// own experts' pairs. `None` where the host holds the whole layer.
    pub fn device_owners(&self, layer: usize) -> Option<ExpertOwners<'_, B>> {
        let table = self.layers[layer].as_ref()?.device_owners.as_ref()?;
        Some(ExpertOwners {
            table,
            replicas: 1,
            rank: DEVICE_RANK as usize,
        })
    }

    /// The host's routed products of `layer` for `x [tokens, hidden]` and `chosen [tokens,
    /// k]` (read off the device): `[tokens · k, hidden]`, the device's pairs zero rows.
    /// Counts the layer's pairs when the host holds the whole layer.
    pub fn compute(
        &self,
        layer: usize,
        x: &[f32],
        chosen: &[u32],
        dims: (usize, usize, usize, f32),
    ) -> Vec<f32> {
        let (tokens, k, hidden, _) = dims;
        let mut ys = vec![0f32; tokens * k * hidden];
        self.compute_into(layer, x, chosen, dims, &mut ys);
        ys
    }

    /// `compute` into `ys` (at least `[tokens · k, hidden]`; the inputs may be longer
    /// than the step's: staging as wide as the widest step).
    pub fn compute_into(
        &self,
        layer: usize,
        x: &[f32],
        chosen: &[u32],
        (tokens, k, hidden, limit): (usize, usize, usize, f32),
        ys: &mut [f32],
    ) {
        let (x, chosen, ys) = (
            &x[..tokens * hidden],
            &chosen[..tokens * k],
            &mut ys[..tokens * k * hidden],
        );
        // The device's pairs are zero rows.
        ys.fill(0.0);
        let l = self.layers[layer]
            .as_ref()
            .expect("compute is asked only of host layers");
        let owners = ExpertOwners {
            table: &l.owners,
            replicas: 1,
            rank: HOST_RANK as usize,
        };
        let experts = super::expert_table::matrices(&l.experts);
        let num_experts = self.placement.num_experts;
        let started = std::time::Instant::now();
        let mut counts = self.counts.borrow_mut();
        let at = layer * num_experts;
        let mut layer_counts = vec![0u32; num_experts];
        self.cpu.routed_experts_into(
            ys,
            x,
            chosen,
            &experts,
            Some(&owners),
            &mut layer_counts,
            (tokens, k, limit),
        );
        if l.device_owners.is_none() {
            for (c, n) in counts[at..at + num_experts].iter_mut().zip(&layer_counts) {
                *c += n;
            }
        }
        let on_host = |e: &usize| self.placement.on_host(layer, *e);
        let touched = (0..num_experts)
            .filter(|e| layer_counts[*e] > 0 && on_host(e))
            .count();
        let products: u32 = (0..num_experts)
            .filter(on_host)
            .map(|e| layer_counts[e])
            .sum();
        let i = usize::from(tokens > DECODE_TOKENS);
        let (bytes, secs) = (&self.read_bytes[i], &self.busy_secs[i]);
        bytes.set(bytes.get() + (touched * self.expert_bytes) as u64);
        let done = &self.products[i];
        done.set(done.get() + u64::from(products));
        let took = started.elapsed().as_secs_f64();
        secs.set(secs.get() + took);
        self.cost.borrow_mut().observe_host(products as usize, took);
    }

    /// Whether a step of `pairs` (token, expert) pairs a layer computes every host layer
    /// here, routed as evenly as the router is trained to (`StreamCost::streams_spread`):
    /// such a step can be recorded with its host part as calls on the device's stream.
    pub fn computes_on_host(&self, pairs: usize) -> bool {
        !self
            .cost
            .borrow()
            .streams_spread(pairs, self.placement.num_experts, self.expert_bytes)
    }

    /// The host experts of `layer` that `chosen` (the step's pairs, read off the device)
    /// touches, copied to `device` where the cost model or `--stream-experts` says the
    /// device should compute them: by expert id, `None` for those not copied. `None`: the
    /// CPU computes them (`compute`).
    pub fn stream(
        &self,
        layer: usize,
        device: &B,
        chosen: &[u32],
    ) -> Option<Vec<Option<Expert<B>>>> {
        let l = self.layers[layer].as_ref()?;
        let num_experts = self.placement.num_experts;
        let mut pairs = vec![0usize; num_experts];
        for &e in chosen {
            if let Some(n) = pairs.get_mut(e as usize) {
                *n += 1;
            }
        }
        let wanted: Vec<usize> = (0..num_experts)
            .filter(|&e| pairs[e] > 0 && l.experts[e].is_some())
            .collect();
        let products = wanted.iter().map(|&e| pairs[e]).sum();
        let bytes = wanted.len() * self.expert_bytes;
        if !self.cost.borrow().streams(products, bytes) {
            return None;
        }
        let copy = |m: &crate::kernels::cpu::CpuMatrix| {
            let (ty, blocks) = m.packed_blocks()?;
            Some(device.upload_blocks(m.rows(), m.cols(), ty, blocks))
        };
        let started = std::time::Instant::now();
        let mut out: Vec<Option<Expert<B>>> = (0..num_experts).map(|_| None).collect();
        for e in wanted {
            let x = l.experts[e].as_ref()?;
            out[e] = Some(Expert {
                gate: copy(&x.gate)?,
                up: copy(&x.up)?,
                down: copy(&x.down)?,
            });
        }
        let [steps, copied] = &self.streamed;
        steps.set(steps.get() + 1);
        copied.set(copied.get() + bytes as u64);
        let issuing = &self.streamed_issue_secs;
        issuing.set(issuing.get() + started.elapsed().as_secs_f64());
        Some(out)
    }

    /// `TROUPE_LAYER_TIMES`: seconds the device took to finish a layer's copies once queued.
    pub fn waited_on_copies(&self, secs: f64) {
        let w = &self.streamed_wait_secs;
        w.set(w.get() + secs);
    }

    /// The pairs counted here since the last call, per `[layer, expert]`.
    pub fn take_counts(&self) -> Vec<u32> {
        let mut counts = self.counts.borrow_mut();
        let out = counts.clone();
        counts.fill(0);
        out
    }

    /// Bytes the host experts take, and their formats (the model card).
    pub fn footprint(&self) -> crate::model::weights::WeightFootprint {
        let mut out = crate::model::weights::WeightFootprint::default();
        out.add_group(
            &self.cpu,
            "routed_experts_host",
            self.layers
                .iter()
                .flatten()
                .flat_map(|l| l.experts.iter().flatten())
                .flat_map(|e| [&e.gate, &e.up, &e.down])
                .collect(),
        );
        out
    }
}

impl<B: DsV4Kernels> Drop for HostExperts<B> {
    fn drop(&mut self) {
        let [steps, copied] = &self.streamed;
        if steps.get() > 0 {
            tracing::info!(
                "host experts streamed to the device: {} layer steps, {:.3} GB of experts copied, {:.3} s queueing the copies, {:.3} s waiting for them (TROUPE_LAYER_TIMES)",
                steps.get(),
                copied.get() as f64 / 1e9,
                self.streamed_issue_secs.get(),
                self.streamed_wait_secs.get()
            );
        }
        for (i, steps) in ["decode", "prefill"].iter().enumerate() {
            let (secs, bytes) = (self.busy_secs[i].get(), self.read_bytes[i].get());
            if secs > 0.0 {
                tracing::info!(
                    "host experts ({steps} steps): {secs:.3} s computing, {:.3} GB of experts read, {:.2} GB/s, {} products",
                    bytes as f64 / 1e9,
                    bytes as f64 / 1e9 / secs,
                    self.products[i].get()
                );
            }
        }
    }
}

/// Makes `layers` hold `placement`'s host experts: experts already held are kept, the
/// others read (`src`; `None`: made) or dropped, each changed layer's owner tables rebuilt.
/// With `pin`, the blocks the host gains are page-locked for the device's copies.
fn place_layers<B: DsV4Kernels>(
    cpu: &CpuBackend,
    cfg: &DsV4Config,
    src: Option<&dyn TensorSource>,
    placement: &ExpertPlacement,
    (device, pin): (&B, bool),
    layers: &mut [Option<HostLayer<B>>],
) -> Result<()> {
    let named = src.map(EitherNaming);
    let holds = |l: usize, e: usize| placement.on_host(l, e);
    let store = HostStore(cpu);
    let r = Reader {
        src: named
            .as_ref()
            .map_or(&NoTensors as &dyn TensorSource, |s| s),
        dummy_experts: named.is_none().then_some(cfg.num_routed_experts),
        store: &store,
        holds: &holds,
    };
    let num_experts = cfg.num_routed_experts;
    for (l, slot) in layers.iter_mut().enumerate() {
        let on_host = placement.host_experts.get(l).copied().unwrap_or(0);
        let (mut held, mut pins) = slot.take().map_or_else(
            || {
                (
                    (0..num_experts).map(|_| None).collect(),
                    (0..num_experts).map(|_| Vec::new()).collect(),
                )
            },
            |h| (h.experts, h.pins),
        );
        if on_host == 0 {
            // The locks go before the memory they lock.
            drop(pins);
            continue;
        }
        for (e, expert) in held.iter_mut().enumerate() {
            match (placement.on_host(l, e), expert.is_some()) {
                (true, false) => {
                    let x = r.expert(&format!("model.layers.{l}.ffn.experts.{e}"), cfg)?;
                    if pin {
                        pins[e] = [&x.gate, &x.up, &x.down]
                            .iter()
                            .filter_map(|m| device.pin_host(m.packed_blocks()?.1))
                            .collect();
                    }
                    *expert = Some(x);
                }
                (false, true) => {
                    pins[e].clear();
                    *expert = None;
                }
                _ => {}
            }
        }
        let owners: Vec<u32> = (0..num_experts)
            .flat_map(|e| {
                let rank = if placement.on_host(l, e) {
                    HOST_RANK
                } else {
                    DEVICE_RANK
                };
                [1, rank]
            })
            .collect();
        let device_owners = (on_host < num_experts).then(|| device.upload_ids(&owners));
        *slot = Some(HostLayer {
            pins,
            experts: held,
            owners,
            device_owners,
        });
    }
    Ok(())
}
