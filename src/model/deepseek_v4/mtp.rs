//! DeepSeek-V4's multi-token-prediction layer (DeepSeek's `MTPBlock`): MTP position `i`
//! reads the model's last-layer streams at `i` and the token at `i + 1`, and predicts the
//! token at `i + 2`. Its input is `e_proj(enorm(embedding)) + h_proj(hnorm(streams))` on
//! every mHC stream; the block is a sliding-window, score-routed V4 block with a cache of
//! its own (one ring per state slot); its output goes through its own hyper-head and norm,
//! then the model's head. Drafts past the first feed the block's output streams back in
//! place of the model's (vLLM's recursion for one MTP layer and several drafts).

use std::path::Path;

use super::cache::{DsV4Cache, SlotSpan};
use super::config::{AttentionKind, DsV4Config, MlpKind};
use super::plan::Plan;
use super::weights::{MtpWeights, OnBackend};
use super::{DsSeqStep, DsV4Model, block};
use crate::error::Result;
use crate::kernels::cpu::CpuBackend;
use crate::kernels::deepseek_v4::DsV4Kernels;
use crate::model::loader::SafetensorsSource;

pub struct MtpLayer<B: DsV4Kernels = CpuBackend> {
    /// The model's config seen as one sliding-window, score-routed layer: the shape of
    /// the MTP block and of its cache.
    cfg: DsV4Config,
    w: MtpWeights<B>,
}

fn block_config(cfg: &DsV4Config) -> DsV4Config {
    DsV4Config {
        num_layers: 1,
        attention: vec![AttentionKind::Sliding],
        mlp: vec![MlpKind::Moe],
        ..cfg.clone()
    }
}

impl MtpLayer<CpuBackend> {
    /// The `mtp.0.*` tensors of the checkpoint in `dir` (a clear error names the first
    /// one missing: a checkpoint shipped without its MTP layer).
    pub fn load_dir(cfg: &DsV4Config, dir: &Path) -> Result<Self> {
        Self::load_into(cfg, Some(dir), &CpuBackend::default())
    }

    /// Seeded random MTP weights (`--dummy-weights`).
    pub fn dummy(cfg: &DsV4Config) -> Result<Self> {
        Self::load_into(cfg, None, &CpuBackend::default())
    }

    /// The MTP block's cache: a window ring per state slot, nothing paged.
    pub fn new_cache(&self, num_slots: usize) -> DsV4Cache {
        self.new_cache_on(&CpuBackend::default(), num_slots)
    }

    /// Logits (`[rows, vocab]`) of MTP output streams (`[rows, n_hc, hidden]`).
    pub fn logits(&self, model: &DsV4Model, streams: &[f32]) -> Vec<f32> {
        let rows = streams.len() / (self.cfg.hc_mult * self.cfg.hidden_size);
        self.logits_on(model, &streams.to_vec(), rows)
    }
}

impl<B: DsV4Kernels> MtpLayer<B> {
    /// The MTP layer of a model whose config is `cfg` on `b`, from the checkpoint in `dir`
    /// (`None`: seeded random weights, `--dummy-weights`).
    pub fn load_into(cfg: &DsV4Config, dir: Option<&Path>, b: &B) -> Result<Self> {
        let cfg = block_config(cfg);
        let w = match dir {
            Some(dir) => MtpWeights::load(&cfg, &SafetensorsSource::open_dir(dir)?, &OnBackend(b))?,
            None => MtpWeights::dummy(&cfg, &OnBackend(b))?,
        };
        Ok(MtpLayer { cfg, w })
    }

    /// The MTP block's cache on `b`: a window ring per state slot, nothing paged.
    pub fn new_cache_on(&self, b: &B, num_slots: usize) -> DsV4Cache<B> {
        DsV4Cache::on(b, &self.cfg, num_slots, 0, 1)
    }

    /// Logits (`[rows, vocab]`) of `rows` MTP output streams (`[rows, n_hc, hidden]`).
    pub fn logits_on(&self, model: &DsV4Model<B>, streams: &B::Buf, rows: usize) -> Vec<f32> {
        model.logits(&self.w.hc_head, &self.w.norm, streams, rows)
    }

    /// The floats of one position's streams (`n_hc · hidden`).
    pub fn stream_width(&self) -> usize {
        self.cfg.hc_mult * self.cfg.hidden_size
    }

    /// Starts `slot`'s MTP history at `position` (nothing before it is attended to).
    pub fn restart(cache: &mut DsV4Cache<B>, slot: usize, position: usize) {
        cache.restart(
            slot,
            SlotSpan {
                state_start: position,
                replay_until: position,
            },
        );
    }

    /// MTP positions `pos0 .. pos0 + n` of the sequence in `slot`, continuing its MTP
    /// cache (which must hold `pos0` positions): `streams` `[n, n_hc, hidden]` at those
    /// positions and `next_ids` `[n]`, the token after each. Returns the block's output
    /// streams (`[n, n_hc, hidden]`).
    pub fn forward(
        &self,
        model: &DsV4Model<B>,
        cache: &mut DsV4Cache<B>,
        slot: usize,
        pos0: usize,
        streams: &B::Buf,
        next_ids: &[u32],
    ) -> B::Buf {
        let (b, cfg) = (&model.backend, &self.cfg);
        let (d, n_hc, eps) = (cfg.hidden_size, cfg.hc_mult, cfg.rms_norm_eps);
        let n = next_ids.len();
        debug_assert_eq!(cache.slot_tokens(slot), pos0);
        let embedded: Vec<f32> = next_ids
            .iter()
            .flat_map(|&id| model.embedding(id).iter().copied())
            .collect();
        let mut e = b.scratch(n * d);
        b.rms_norm_into_gemm(&b.upload(&embedded), &self.w.enorm, eps, n, d, &mut e);
        let mut e_proj = b.scratch(n * d);
        b.matmul(&e, n, &self.w.e_proj, None, &mut e_proj);
        let mut h = b.scratch(n * n_hc * d);
        b.rms_norm_into_gemm(streams, &self.w.hnorm, eps, n * n_hc, d, &mut h);
        let mut x = b.scratch(n * n_hc * d);
        b.matmul(&h, n * n_hc, &self.w.h_proj, None, &mut x);
        // Every stream of a position gets its token's projection.
        let mut e_streams = b.scratch(n * n_hc * d);
        b.dsv4_expand(&mut e_streams, &e_proj, n, n_hc, d);
        b.add(&mut x, &e_streams, n * n_hc * d);

        let step = DsSeqStep {
            token_ids: next_ids,
            num_cached_tokens: pos0,
            block_table: &[],
            state_slot: slot as u32,
            span: cache.span(slot),
            num_logit_rows: n,
        };
        let plan = Plan::new(b, cfg, cache.block_size, std::slice::from_ref(&step));
        let mut counts = b.alloc_ids(cfg.num_routed_experts);
        block::block(
            &model.pass(cfg, &plan),
            0,
            &self.w.block,
            cache,
            &mut x,
            &mut counts,
            None,
        );
        cache.set_slot_tokens(slot, pos0 + n);
        x
    }
}
