//! DeepSeek-V4's forward pass on one GPU: the host reference's steps (`super::forward`)
//! with the matrices in bf16 on the device, activations and cache in f32 there, and
//! `kernels-cuda/deepseek_v4.cu` for the model's own operations. The host plans each step
//! (which entries close, which rows go to which expert) and reads back only the routing
//! of each MoE layer and the logits. Speculative rewinds stay on the host pass.
//!
//! | file | what it is |
//! |---|---|
//! | `weights.rs` | the weights on the device |
//! | `cache.rs` | the state slots and paged entries on the device |
//! | `moe.rs` | routing, grouping rows by expert, the experts' GEMMs |

pub mod cache;
mod moe;
pub mod weights;

use std::path::Path;

use cudarc::driver::CudaSlice;

use super::config::{AttentionKind, DsV4Config};
use super::{DsSeqStep, SlotView, check_steps, ops};
use crate::error::{Result, TroupeError};
use crate::kernels::Backend;
use crate::kernels::cuda::{AttentionKeys, CudaBackend, DsStepMeta, SEQ_FIELDS};
use crate::model::loader::SafetensorsSource;
use cache::DeviceCache;
use weights::{DeviceLayer, DeviceWeights, OnDevice};

pub struct DsV4Cuda {
    pub cfg: DsV4Config,
    weights: DeviceWeights,
    main_freqs: CudaSlice<f32>,
    compress_freqs: CudaSlice<f32>,
    /// Ones, for the norms without a weight (of the flat streams and of each head).
    ones: CudaSlice<f32>,
}

/// What a step's layers share: its metadata, its tokens, and per compress rate the
/// entries its chunks close (entry index, position of the window's first token).
struct Step {
    meta: DsStepMeta,
    token_ids: CudaSlice<u32>,
    token_ids_host: Vec<u32>,
    emits: Vec<(usize, CudaSlice<u32>, usize)>,
    /// Per row: its position.
    positions: Vec<usize>,
}

impl DsV4Cuda {
    pub fn load_dir(b: &CudaBackend, dir: &Path, dummy_weights: bool) -> Result<Self> {
        let cfg = DsV4Config::from_dir(dir)?;
        b.dsv4_kernels()
            .map_err(|e| TroupeError::InvalidInput(e.to_string()))?;
        let store = OnDevice(b);
        let w = if dummy_weights {
            super::weights::DsV4Weights::dummy_into(&cfg, &store)?
        } else {
            let src = SafetensorsSource::open_dir(dir)?;
            super::weights::DsV4Weights::load_into(&cfg, &src, &store)?
        };
        let weights = DeviceWeights::new(b, &cfg, w)?;
        let main_freqs = b.upload(&ops::inv_freqs(&cfg.main_rope, cfg.rope_head_dim));
        let compress_freqs = b.upload(&ops::inv_freqs(&cfg.compress_rope, cfg.rope_head_dim));
        let ones = b.upload(&vec![
            1.0f32;
            (cfg.hc_mult * cfg.hidden_size).max(cfg.head_dim)
        ]);
        Ok(DsV4Cuda {
            cfg,
            weights,
            main_freqs,
            compress_freqs,
            ones,
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.cfg.vocab_size
    }

    /// Runs every sequence's tokens and returns the logits of their logit rows (as
    /// `DsV4Model::forward`), adding each layer's tokens per routed expert to
    /// `expert_tokens`. A rewind into a verify row is refused: speculation runs on the host.
    pub fn forward(
        &self,
        b: &CudaBackend,
        cache: &mut DeviceCache,
        steps: &[DsSeqStep<'_>],
        expert_tokens: &mut [Vec<u64>],
    ) -> Result<Vec<f32>> {
        let cfg = &self.cfg;
        check_steps(
            cfg,
            steps,
            (cache.num_slots(), cache.num_blocks, cache.block_size),
            |slot| SlotView {
                span: cache.spans[slot],
                num_tokens: cache.slot_tokens[slot],
                snapshot: None,
            },
        )?;
        for s in steps {
            let slot = s.state_slot as usize;
            if s.num_cached_tokens == s.span.state_start {
                cache.spans[slot] = s.span;
            }
        }
        let step = self.plan(b, cache, steps);
        let tokens = step.positions.len();
        let (d, n) = (cfg.hidden_size, cfg.hc_mult);
        let mut embedded = Vec::with_capacity(tokens * d);
        for &id in &step.token_ids_host {
            embedded.extend_from_slice(&self.weights.embed[id as usize * d..(id as usize + 1) * d]);
        }
        let x = b.upload(&embedded);
        let mut streams = b.alloc_written(tokens * n * d);
        b.dsv4_expand(&mut streams, &x, tokens, n, d);
        for (l, w) in self.weights.layers.iter().enumerate() {
            self.block(b, cache, &step, l, w, &mut streams, &mut expert_tokens[l])?;
        }
        for s in steps {
            cache.slot_tokens[s.state_slot as usize] = s.num_cached_tokens + s.token_ids.len();
        }

        let mut picked = Vec::new();
        let mut row0 = 0;
        for s in steps {
            let len = s.token_ids.len();
            picked.extend(row0 + len - s.num_logit_rows.min(len)..row0 + len);
            row0 += len;
        }
        let rows = picked.len();
        let mut last = b.alloc_written(rows * n * d);
        b.gather_rows(&streams, n * d, &picked, &mut last);
        let mut flat = b.alloc_written(rows * n * d);
        b.rms_norm(&last, &self.ones, cfg.rms_norm_eps, rows, n * d, &mut flat);
        let hc = &self.weights.hc_head;
        let mut mixes = b.alloc_written(rows * n);
        b.matmul(&flat, rows, &hc.fn_, None, &mut mixes);
        let mut h = b.alloc_written(rows * d);
        b.dsv4_mhc_head(
            &mixes, &last, &hc.base, &hc.scale, &mut h, rows, n, d, cfg.hc_eps,
        );
        let mut hn = b.alloc_written(rows * d);
        b.rms_norm(&h, &self.weights.norm, cfg.rms_norm_eps, rows, d, &mut hn);
        let mut logits = b.alloc_written(rows * cfg.vocab_size);
        b.matmul(&hn, rows, &self.weights.head, None, &mut logits);
        Ok(b.download(&logits, rows * cfg.vocab_size))
    }

    /// The step's metadata on the device, and the entries each compress rate closes.
    fn plan(&self, b: &CudaBackend, cache: &DeviceCache, steps: &[DsSeqStep<'_>]) -> Step {
        let mut rows = Vec::new();
        let mut seqs = Vec::new();
        let mut tables = Vec::new();
        let mut token_ids_host = Vec::new();
        let mut positions = Vec::new();
        let mut row0 = 0;
        let mut max_len = 0;
        for (i, s) in steps.iter().enumerate() {
            let len = s.token_ids.len();
            let mut fields = [0u32; SEQ_FIELDS];
            fields[0] = s.state_slot;
            fields[1] = s.num_cached_tokens as u32;
            fields[2] = row0 as u32;
            fields[3] = len as u32;
            fields[4] = s.span.state_start as u32;
            fields[5] = s.span.replay_until as u32;
            fields[6] = tables.len() as u32;
            seqs.extend_from_slice(&fields);
            tables.extend_from_slice(s.block_table);
            for p in s.num_cached_tokens..s.num_cached_tokens + len {
                rows.extend_from_slice(&[i as u32, p as u32]);
                positions.push(p);
            }
            token_ids_host.extend_from_slice(s.token_ids);
            row0 += len;
            max_len = max_len.max(len);
        }
        let mut rates: Vec<usize> = (0..self.cfg.num_layers)
            .filter_map(|l| self.cfg.rate(l))
            .collect();
        if self
            .cfg
            .attention
            .contains(&AttentionKind::CompressedSparse)
        {
            rates.push(self.cfg.csa_rate);
        }
        rates.sort_unstable();
        rates.dedup();
        let bs = cache.block_size;
        let emits = rates
            .into_iter()
            .map(|rate| {
                let mut list = Vec::new();
                for s in steps {
                    for pos in s.num_cached_tokens..s.num_cached_tokens + s.token_ids.len() {
                        let w = pos / rate;
                        if pos % rate != rate - 1 || (w + 1) * rate <= s.span.replay_until {
                            continue;
                        }
                        let first = w * rate;
                        let block = s.block_table[first / bs] as usize;
                        let entry = block * (bs / rate) + (first % bs) / rate;
                        list.extend_from_slice(&[entry as u32, first as u32]);
                    }
                }
                let count = list.len() / 2;
                (rate, b.upload_u32s(&list), count)
            })
            .collect();
        Step {
            meta: DsStepMeta {
                rows: b.upload_u32s(&rows),
                seqs: b.upload_u32s(&seqs),
                tables: b.upload_u32s(&tables),
                num_rows: positions.len(),
                num_seqs: steps.len(),
                max_len,
            },
            token_ids: b.upload_u32s(&token_ids_host),
            token_ids_host,
            emits,
            positions,
        }
    }

    /// One block over the streams, in place: mHC around attention, then around the MoE.
    #[allow(clippy::too_many_arguments)]
    fn block(
        &self,
        b: &CudaBackend,
        cache: &mut DeviceCache,
        step: &Step,
        l: usize,
        w: &DeviceLayer,
        streams: &mut CudaSlice<f32>,
        expert_tokens: &mut [u64],
    ) -> Result<()> {
        let cfg = &self.cfg;
        let t = step.positions.len();
        let (d, n) = (cfg.hidden_size, cfg.hc_mult);
        let mut flat = b.alloc_written(t * n * d);
        let mut mixes = b.alloc_written(t * (2 + n) * n);
        let mut post = b.alloc_written(t * n);
        let mut comb = b.alloc_written(t * n * n);
        let mut collapsed = b.alloc_written(t * d);
        let mut x = b.alloc_written(t * d);
        for half in 0..2 {
            let (hc, norm) = if half == 0 {
                (&w.attn_hc, &w.attn_norm)
            } else {
                (&w.ffn_hc, &w.ffn_norm)
            };
            b.rms_norm(streams, &self.ones, cfg.rms_norm_eps, t, n * d, &mut flat);
            b.matmul(&flat, t, &hc.fn_, None, &mut mixes);
            b.dsv4_mhc_mix(
                &mixes,
                streams,
                &hc.base,
                &hc.scale,
                &mut post,
                &mut comb,
                &mut collapsed,
                t,
                n,
                d,
                cfg.hc_sinkhorn_iters,
                cfg.hc_eps,
            );
            b.rms_norm(&collapsed, norm, cfg.rms_norm_eps, t, d, &mut x);
            let y = if half == 0 {
                self.attention(b, cache, step, l, w, &x)?
            } else {
                moe::moe(self, b, step, l, &w.moe, &x, expert_tokens)
            };
            b.dsv4_mhc_merge(streams, &post, &comb, &y, t, n, d);
        }
        Ok(())
    }

    /// `attention::attention` for every sequence of the step at once.
    fn attention(
        &self,
        b: &CudaBackend,
        cache: &mut DeviceCache,
        step: &Step,
        l: usize,
        w: &DeviceLayer,
        x: &CudaSlice<f32>,
    ) -> Result<CudaSlice<f32>> {
        let cfg = &self.cfg;
        let a = &w.attn;
        let t = step.positions.len();
        let (hd, heads, eps) = (cfg.head_dim, cfg.num_heads, cfg.rms_norm_eps);
        let freqs = if cfg.attention[l] == AttentionKind::Sliding {
            &self.main_freqs
        } else {
            &self.compress_freqs
        };
        let mut qr = b.alloc_written(t * cfg.q_lora_rank);
        b.matmul(x, t, &a.q_a, None, &mut qr);
        let mut qrn = b.alloc_written(t * cfg.q_lora_rank);
        b.rms_norm(&qr, &a.q_a_norm, eps, t, cfg.q_lora_rank, &mut qrn);
        let mut q = b.alloc_written(t * heads * hd);
        b.matmul(&qrn, t, &a.q_b, None, &mut q);
        let mut qn = b.alloc_written(t * heads * hd);
        b.rms_norm(&q, &self.ones, eps, t * heads, hd, &mut qn);
        let mut kv = b.alloc_written(t * hd);
        b.matmul(x, t, &a.kv, None, &mut kv);
        let mut kvn = b.alloc_written(t * hd);
        b.rms_norm(&kv, &a.kv_norm, eps, t, hd, &mut kvn);
        b.dsv4_rope(&mut qn, &step.meta, heads, hd, freqs, 1.0);
        b.dsv4_rope(&mut kvn, &step.meta, 1, hd, freqs, 1.0);

        let lc = &mut cache.layers[l];
        let bs = cache.block_size;
        if let (Some(cw), Some(cc)) = (&a.compressor, lc.compressor.as_mut()) {
            self.feed(b, step, cw, cc, x, bs);
        }
        let max_row_pos = step.positions.iter().copied().max().unwrap_or(0);
        let mut selection = None;
        if let (Some((iw, q_b, weights_proj)), Some(ic)) = (&a.indexer, lc.indexer.as_mut()) {
            self.feed(b, step, iw, ic, x, bs);
            let (ih, ihd) = (cfg.index_n_heads, cfg.index_head_dim);
            let mut iq = b.alloc_written(t * ih * ihd);
            b.matmul(&qrn, t, q_b, None, &mut iq);
            b.dsv4_rope(&mut iq, &step.meta, ih, ihd, &self.compress_freqs, 1.0);
            let mut hw = b.alloc_written(t * ih);
            b.matmul(x, t, weights_proj, None, &mut hw);
            let max_visible = (max_row_pos + 1) / cfg.csa_rate;
            let mut scores = b.alloc_written(t * max_visible.max(1));
            let mut sel = b.alloc_i32s(t * cfg.index_topk);
            b.dsv4_index_select(
                &mut sel,
                &mut scores,
                &iq,
                &hw,
                ic,
                &step.meta,
                bs,
                ih,
                max_visible,
                cfg.index_topk,
            );
            selection = Some(sel);
        }
        let keys = AttentionKeys {
            kv: &kvn,
            ring: &lc.ring,
            ring_len: cache.ring_len,
            window: cfg.sliding_window,
            compressed: lc
                .compressor
                .as_ref()
                .map(|c| (c, selection.as_ref().map(|s| (s, cfg.index_topk)))),
            block_size: bs,
        };
        let mut out = b.alloc_written(t * heads * hd);
        b.dsv4_attention(&mut out, &qn, &keys, &a.sinks, &step.meta, heads, hd)
            .map_err(|e| TroupeError::InvalidInput(e.to_string()))?;
        b.dsv4_rope(&mut out, &step.meta, heads, hd, freqs, -1.0);
        b.dsv4_ring_write(&mut lc.ring, &kvn, &step.meta, cache.ring_len, hd);

        // The grouped output projection: each group's heads through its own rows of o_a.
        let (groups, rank) = (cfg.o_groups, cfg.o_lora_rank);
        let per_group = heads * hd / groups;
        let mut by_group = b.alloc_written(t * heads * hd);
        b.dsv4_swap(&mut by_group, &out, t, groups, per_group);
        let mut projected = b.alloc_written(groups * t * rank);
        for (g, o_a) in a.o_a.iter().enumerate() {
            b.gemm_rows(&by_group, g * t, t, o_a, &mut projected, g * t);
        }
        let mut grouped = b.alloc_written(t * groups * rank);
        b.dsv4_swap(&mut grouped, &projected, groups, t, rank);
        let mut y = b.alloc_written(t * cfg.hidden_size);
        b.matmul(&grouped, t, &a.o_b, None, &mut y);
        Ok(y)
    }

    /// One compressor's projections of the step, fed to its windows; the entries they
    /// close normed and rotated.
    fn feed(
        &self,
        b: &CudaBackend,
        step: &Step,
        w: &weights::DeviceCompressorWeights,
        c: &mut crate::kernels::cuda::DeviceCompressor,
        x: &CudaSlice<f32>,
        block_size: usize,
    ) {
        let t = step.positions.len();
        let mut kv = b.alloc_written(t * c.width);
        b.matmul(x, t, &w.kv, None, &mut kv);
        let mut gate = b.alloc_written(t * c.width);
        b.matmul(x, t, &w.gate, None, &mut gate);
        b.dsv4_compress_feed(c, &kv, &gate, &w.position_bias, &step.meta, block_size);
        let (_, emits, count) = step
            .emits
            .iter()
            .find(|(rate, _, _)| *rate == c.rate)
            .expect("plan lists every compress rate");
        b.dsv4_entry_finish(
            c,
            emits,
            *count,
            &w.norm,
            self.cfg.rms_norm_eps,
            &self.compress_freqs,
        );
    }
}
