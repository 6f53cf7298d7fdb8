//! DeepSeek-V4's multi-token-prediction layer (DeepSeek's `MTPBlock`): MTP position `i`
//! reads the model's last-layer streams at `i` and the token at `i + 1`, and predicts the
//! token at `i + 2`. Its input is `e_proj(enorm(embedding)) + h_proj(hnorm(streams))` on
//! every mHC stream; the block is a sliding-window, score-routed V4 block with a cache of
//! its own (one ring per state slot); its output goes through its own hyper-head and norm,
//! then the model's head. Drafts past the first feed the block's output streams back in
//! place of the model's (vLLM's recursion for one MTP layer and several drafts).

use std::path::Path;

use super::attention::ChunkAt;
use super::cache::{DsV4Cache, SlotSpan};
use super::config::{AttentionKind, DsV4Config, MlpKind};
use super::weights::MtpWeights;
use super::{BlockStep, DsV4Model, block, ops};
use crate::error::Result;
use crate::model::loader::SafetensorsSource;

pub struct MtpLayer {
    /// The model's config seen as one sliding-window, score-routed layer: the shape of
    /// the MTP block and of its cache.
    cfg: DsV4Config,
    w: MtpWeights,
}

impl MtpLayer {
    fn block_config(cfg: &DsV4Config) -> DsV4Config {
        DsV4Config {
            num_layers: 1,
            attention: vec![AttentionKind::Sliding],
            mlp: vec![MlpKind::Moe],
            ..cfg.clone()
        }
    }

    /// The `mtp.0.*` tensors of the checkpoint in `dir` (a clear error names the first
    /// one missing: a checkpoint shipped without its MTP layer).
    pub fn load_dir(cfg: &DsV4Config, dir: &Path) -> Result<Self> {
        let src = SafetensorsSource::open_dir(dir)?;
        let cfg = Self::block_config(cfg);
        let w = MtpWeights::load(&cfg, &src)?;
        Ok(MtpLayer { cfg, w })
    }

    /// Seeded random MTP weights (`--dummy-weights`).
    pub fn dummy(cfg: &DsV4Config) -> Result<Self> {
        let cfg = Self::block_config(cfg);
        let w = MtpWeights::dummy(&cfg)?;
        Ok(MtpLayer { cfg, w })
    }

    /// The MTP block's cache: a window ring per state slot, nothing paged.
    pub fn new_cache(&self, num_slots: usize) -> DsV4Cache {
        DsV4Cache::new(&self.cfg, num_slots, 0, 1)
    }

    /// Starts `slot`'s MTP history at `position` (nothing before it is attended to).
    pub fn restart(cache: &mut DsV4Cache, slot: usize, position: usize) {
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
        model: &DsV4Model,
        cache: &mut DsV4Cache,
        slot: usize,
        pos0: usize,
        streams: &[f32],
        next_ids: &[u32],
    ) -> Vec<f32> {
        let cfg = &self.cfg;
        let (d, n_hc, eps) = (cfg.hidden_size, cfg.hc_mult, cfg.rms_norm_eps);
        let n = next_ids.len();
        debug_assert_eq!(streams.len(), n * n_hc * d);
        debug_assert_eq!(cache.slot_tokens(slot), pos0);
        let mut e: Vec<f32> = next_ids
            .iter()
            .flat_map(|&id| model.embedding(id).iter().copied())
            .collect();
        ops::rms_norm(&mut e, d, Some(&self.w.enorm), eps);
        let e = self.w.e_proj.apply(&e);
        let mut h = streams.to_vec();
        ops::rms_norm(&mut h, d, Some(&self.w.hnorm), eps);
        let mut x = self.w.h_proj.apply(&h);
        for (t, row) in x.chunks_exact_mut(n_hc * d).enumerate() {
            for stream in row.chunks_exact_mut(d) {
                stream
                    .iter_mut()
                    .zip(&e[t * d..(t + 1) * d])
                    .for_each(|(a, b)| *a += b);
            }
        }
        let rope = model.rope();
        let at = ChunkAt {
            slot,
            pos0,
            block_table: &[],
        };
        let step = BlockStep {
            cfg,
            layer: 0,
            rope: &rope,
            chunks: &[(at, n)],
            token_ids: next_ids,
        };
        let mut expert_tokens = vec![0; cfg.num_routed_experts];
        block(
            &step,
            &self.w.block,
            cache,
            &mut x,
            &mut expert_tokens,
            None,
        );
        cache.set_slot_tokens(slot, pos0 + n);
        x
    }

    /// Logits (`[rows, vocab]`) of MTP output streams (`[rows, n_hc, hidden]`).
    pub fn logits(&self, model: &DsV4Model, streams: &[f32]) -> Vec<f32> {
        model.logits(&self.w.hc_head, &self.w.norm, streams)
    }
}
