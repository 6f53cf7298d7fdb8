//! The Llama-family forward pass (Llama 2/3, Mistral, SmolLM2, Qwen2/2.5, Qwen3) over a
//! paged KV cache, for a step that mixes any number of sequences, each contributing a
//! prefill chunk or one decode token.

use super::config::ModelConfig;
use super::rope::{cos_sin_table, inv_freqs};
use super::vision::mrope::{self, ImageSpan};
use super::weights::Weights;
use crate::kernels::collective::Collective;
use crate::kernels::{
    Backend, GraphStep, KvCacheShape, MovedBack, NOT_PICKED, QkvHeads, SeqAttention,
    StagedVerified, VerifiedRow,
};

/// One sequence's part of a step, as the caller plans it.
#[derive(Debug, Clone)]
pub struct SeqStep<'a> {
    /// Tokens to run now; the first sits at position `num_cached_tokens`.
    pub token_ids: &'a [u32],
    /// Tokens whose K/V are already in the cache.
    pub num_cached_tokens: usize,
    /// Blocks covering at least `num_cached_tokens + token_ids.len()` positions.
    pub block_table: &'a [u32],
    /// Trailing positions of `token_ids` that return logits, oldest first (1: the last
    /// token's; a speculative verify row: one per draft and one after).
    pub num_logit_rows: usize,
    /// Models with per-sequence state (DeepSeek-V4): the sequence's slot.
    pub state: Option<SlotState>,
}

/// A row's images (vision-language models): where the sequence's images sit, so every
/// token of the row gets its multimodal RoPE position, and the encoder's rows that replace
/// the embeddings of the image tokens this row runs.
#[derive(Debug, Clone)]
pub struct RowMedia<'a> {
    /// The row's index among the step's sequences.
    pub row: usize,
    /// The sequence's images in prompt order.
    pub spans: &'a [ImageSpan],
    /// (index in the row's `token_ids` of the first token replaced, `(tokens, hidden)`
    /// rows).
    pub embeds: Vec<(usize, &'a [f32])>,
}

/// A sequence's state slot and its history (`PlannedRow`'s fields of the same names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotState {
    pub slot: u32,
    /// The slot's history begins at this position: a row starting here starts afresh.
    pub state_start: usize,
    /// Positions before this are prefix-cache hits being replayed: their blocks are
    /// written already.
    pub replay_until: usize,
}

/// Activation buffers, sized for the largest step seen and reused: nothing is allocated
/// per token once a step size has been seen.
struct Workspace<B: Backend> {
    capacity_tokens: usize,
    capacity_logit_rows: usize,
    x: B::Buf,       // (tokens, hidden): the residual stream
    normed: B::Buf,  // (tokens, hidden)
    qkv: B::Buf,     // (tokens, q_dim + 2 * kv_dim)
    q: B::Buf,       // (tokens, q_dim)
    k: B::Buf,       // (tokens, kv_dim)
    v: B::Buf,       // (tokens, kv_dim)
    attn: B::Buf,    // (tokens, q_dim); the per-head norms' scratch before attention
    proj: B::Buf,    // (tokens, hidden)
    gate_up: B::Buf, // (tokens, 2 * intermediate)
    act: B::Buf,     // (tokens, intermediate)
    last: B::Buf,    // (logit rows, hidden)
    logits: B::Buf,  // (logit rows, vocab)
}

/// RoPE rows built when a model loads (see `LlamaModel::cos_sin`). Doubling from here
/// costs a handful of rebuilds over a process's life, and the golden cases (prompts of
/// up to 70 tokens) cross a growth, so transformers checks the grown rows too.
const ROPE_ROWS_AT_LOAD: usize = 64;

pub struct LlamaModel<B: Backend> {
    pub cfg: ModelConfig,
    pub weights: Weights<B>,
    /// RoPE's cos/sin rows, `(cos_sin_rows, head_dim)`: built for the first
    /// `ROPE_ROWS_AT_LOAD` positions and grown when a step reaches past them, so a file
    /// that declares a huge context costs nothing until a sequence is that long.
    cos_sin: B::Buf,
    cos_sin_rows: usize,
    inv_freqs: Vec<f64>,
    ws: Option<Workspace<B>>,
    /// The tensor-parallel group this rank belongs to; `None`: the whole model is here.
    collective: Option<Box<dyn Collective<B>>>,
    // Host-side step metadata, kept to avoid reallocating it every step.
    picked: Vec<u32>,
    positions: Vec<u32>,
    slots: Vec<u32>,
    ids: Vec<u32>,
    /// A step with image rows: each token's own cos/sin row (its multimodal position).
    step_rope: Option<B::Buf>,
    /// Steps of short rows may run as the backend's recorded graphs. Off for a second
    /// model on the same backend (a draft model): the backend keys its graphs by token
    /// count only.
    graphs: bool,
}

impl<B: Backend> LlamaModel<B> {
    pub fn new(
        cfg: ModelConfig,
        weights: Weights<B>,
        backend: &B,
        freq_factors: Option<&[f32]>,
    ) -> Self {
        let inv_freqs = inv_freqs(&cfg, freq_factors);
        let cos_sin_rows = cfg.max_context_tokens.min(ROPE_ROWS_AT_LOAD);
        LlamaModel {
            cos_sin: backend.upload(&cos_sin_table(&inv_freqs, cos_sin_rows)),
            cos_sin_rows,
            inv_freqs,
            cfg,
            weights,
            ws: None,
            collective: None,
            picked: Vec::new(),
            positions: Vec::new(),
            slots: Vec::new(),
            ids: Vec::new(),
            step_rope: None,
            graphs: true,
        }
    }

    /// Every step of this model runs eagerly (see `graphs`).
    pub fn without_graphs(mut self) -> Self {
        self.graphs = false;
        self
    }

    /// Joins a tensor-parallel group: the partial outputs of the attention and MLP
    /// projections are summed over it (the weights must be this rank's shard).
    pub fn set_collective(&mut self, collective: Box<dyn Collective<B>>) {
        self.collective = Some(collective);
    }

    /// Whether this rank's group was aborted (see [`crate::kernels::collective::AbortProbe`]).
    pub fn abort_probe(&self) -> Option<crate::kernels::collective::AbortProbe> {
        self.collective.as_ref().and_then(|c| c.abort_probe())
    }

    /// Drops the group membership (aborting a collective still in flight).
    pub fn leave_group(&mut self) {
        self.collective = None;
    }

    pub fn kv_cache_shape(&self, num_blocks: usize, block_size: usize) -> KvCacheShape {
        KvCacheShape {
            num_layers: self.cfg.num_layers,
            num_blocks,
            block_size,
            num_kv_heads: self.cfg.num_kv_heads,
            head_dim: self.cfg.head_dim,
            dtype: Default::default(),
        }
    }

    /// RoPE rows for every position below `positions`: the table doubles (up to the
    /// model's context) and is uploaded again, and recorded graphs re-record around it.
    fn ensure_rope_rows(&mut self, backend: &B, positions: usize) {
        if positions <= self.cos_sin_rows {
            return;
        }
        let rows = positions
            .max(2 * self.cos_sin_rows)
            .min(self.cfg.max_context_tokens.max(positions));
        if let Some(graphs) = backend.graphs() {
            graphs.buffers_moved();
        }
        self.cos_sin = backend.upload(&cos_sin_table(&self.inv_freqs, rows));
        self.cos_sin_rows = rows;
    }

    /// Every token's cos/sin row for a step with images, its position the token's
    /// multimodal one; `positions` then index this step's rows.
    fn mrope_rows(
        &mut self,
        backend: &B,
        seqs: &[SeqStep<'_>],
        moved: &[MovedBack],
        media: &[RowMedia<'_>],
    ) {
        let section = self
            .cfg
            .mrope_section
            .expect("images reach only a model with multimodal RoPE");
        let hd = self.cfg.head_dim;
        let mut table = vec![0f32; self.positions.len() * hd];
        let mut token = 0;
        for (row, s) in seqs.iter().enumerate() {
            let spans = media
                .iter()
                .find(|m| m.row == row)
                .map_or(&[][..], |m| m.spans);
            let cached = match moved.get(row) {
                Some(&MovedBack::Positions(n)) => s.num_cached_tokens - n,
                _ => s.num_cached_tokens,
            };
            for i in 0..s.token_ids.len() {
                let pos = mrope::position(spans, cached + i);
                section.cos_sin_row(&self.inv_freqs, pos, &mut table[token * hd..][..hd]);
                token += 1;
            }
        }
        // Padding rows (none: a step with images is never recorded) keep position 0.
        for (i, p) in self.positions.iter_mut().enumerate() {
            *p = i as u32;
        }
        self.step_rope = Some(backend.upload(&table));
    }

    fn ensure_workspace(&mut self, backend: &B, num_tokens: usize, num_logit_rows: usize) {
        let fits = self.ws.as_ref().is_some_and(|w| {
            w.capacity_tokens >= num_tokens && w.capacity_logit_rows >= num_logit_rows
        });
        if fits {
            return;
        }
        let c = &self.cfg;
        let t = num_tokens.max(self.ws.as_ref().map_or(0, |w| w.capacity_tokens));
        let r = num_logit_rows.max(self.ws.as_ref().map_or(0, |w| w.capacity_logit_rows));
        if let Some(graphs) = backend.graphs() {
            graphs.buffers_moved();
        }
        self.ws = Some(Workspace {
            capacity_tokens: t,
            capacity_logit_rows: r,
            x: backend.alloc(t * c.hidden_size),
            normed: backend.alloc(t * c.hidden_size),
            qkv: backend.alloc(t * (c.q_dim() + 2 * c.kv_dim())),
            q: backend.alloc(t * c.q_dim()),
            k: backend.alloc(t * c.kv_dim()),
            v: backend.alloc(t * c.kv_dim()),
            attn: backend.alloc(t * c.q_dim()),
            proj: backend.alloc(t * c.hidden_size),
            gate_up: backend.alloc(t * 2 * c.intermediate_size),
            act: backend.alloc(t * c.intermediate_size),
            last: backend.alloc(r * c.hidden_size),
            logits: backend.alloc(r * c.vocab_size),
        });
    }

    /// Runs one step and returns each sequence's `num_logit_rows` logit rows, sequence
    /// after sequence, `[Σ num_logit_rows, vocab]` row-major.
    pub fn forward(
        &mut self,
        backend: &B,
        cache: &mut B::KvCache,
        block_size: usize,
        seqs: &[SeqStep<'_>],
    ) -> Vec<f32> {
        self.forward_with_media(backend, cache, block_size, seqs, &[])
    }

    /// `forward`, with the rows' images (`RowMedia`).
    pub fn forward_with_media(
        &mut self,
        backend: &B,
        cache: &mut B::KvCache,
        block_size: usize,
        seqs: &[SeqStep<'_>],
        media: &[RowMedia<'_>],
    ) -> Vec<f32> {
        self.forward_on_device(backend, cache, block_size, seqs, &[], &[], media);
        let logits = &self.ws.as_ref().expect("workspace made by the step").logits;
        let num_logit_rows: usize = seqs.iter().map(|s| s.num_logit_rows).sum();
        backend.download(logits, num_logit_rows * self.cfg.vocab_size)
    }

    /// The logits of the last step, left on the device: `[rows, vocab]`.
    pub fn device_logits(&self) -> &B::Buf {
        &self.ws.as_ref().expect("a step ran").logits
    }

    /// Where `verified` rows stand: staged for the device to move back (a recorded step),
    /// or moved back here from their verify rows' picks, read now. Returns per sequence
    /// how far it moves back (empty: none does), and `picked_rows` pointing at the picks
    /// drawn.
    fn place_verified(
        backend: &B,
        block_size: usize,
        seqs: &[SeqStep<'_>],
        picked_rows: &[u32],
        verified: &[VerifiedRow<'_>],
    ) -> (Vec<MovedBack>, Vec<u32>) {
        let mut picked = picked_rows.to_vec();
        if verified.is_empty() {
            return (Vec::new(), picked);
        }
        let (mut token_starts, mut table_offsets) = (Vec::new(), Vec::new());
        let (mut tokens, mut tables) = (0, 0);
        for s in seqs {
            token_starts.push(tokens);
            table_offsets.push(tables);
            tokens += s.token_ids.len();
            tables += s.block_table.len();
        }
        let staged: Vec<StagedVerified<'_>> = verified
            .iter()
            .map(|&v| StagedVerified {
                verified: v,
                token_start: token_starts[v.row],
                num_tokens: seqs[v.row].token_ids.len(),
                table_offset: table_offsets[v.row],
            })
            .collect();
        let mut moved = vec![MovedBack::Positions(0); seqs.len()];
        if backend
            .graphs()
            .is_some_and(|g| g.stage_verified(&staged, block_size))
        {
            for (i, v) in verified.iter().enumerate() {
                moved[v.row] = MovedBack::OnDevice(i as u32);
            }
            return (moved, picked);
        }
        for v in verified {
            let picks = backend
                .device_picks()
                .expect("rows continue verify rows on the device only where it keeps picks")
                .read_picks(v.first_pick as usize, v.drafts.len() + 1);
            let kept = crate::spec::verify::num_accepted_by_picks(v.drafts, picks);
            moved[v.row] = MovedBack::Positions(v.drafts.len() - kept);
            picked[v.row] = v.first_pick + kept as u32;
        }
        (moved, picked)
    }

    /// Runs one step, leaving the logits on the device (`device_logits`). `picked_rows`
    /// is empty or, per sequence, `NOT_PICKED` or the index of its first input token among
    /// the backend's last greedy picks (`Backend::embedding`). `verified` lists the rows
    /// that continue a verify row of the step before (their `picked_rows` entry is that
    /// row's first pick): the device moves them back by the drafts it rejected where the
    /// step is a recorded graph, else its picks are read here. Returns, per sequence, how
    /// far it moved back (empty: none did), for the positions of its draws.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_on_device(
        &mut self,
        backend: &B,
        cache: &mut B::KvCache,
        block_size: usize,
        seqs: &[SeqStep<'_>],
        picked_rows: &[u32],
        verified: &[VerifiedRow<'_>],
        media: &[RowMedia<'_>],
    ) -> Vec<MovedBack> {
        // A step of short rows whose every token is a logit row (decode rows, verify rows)
        // may run as a recorded graph, padded with one-token rows to the graph's count.
        // Not a step with images: its RoPE rows are its own.
        let real_tokens: usize = seqs.iter().map(|s| s.token_ids.len()).sum();
        let recordable = self.graphs && media.is_empty();
        let graph_tokens = backend.graphs().filter(|_| recordable).and_then(|g| {
            seqs.iter()
                .all(|s| {
                    s.num_logit_rows == s.token_ids.len() && s.token_ids.len() <= g.max_row_tokens()
                })
                .then(|| g.padded_tokens(real_tokens, seqs.len()))
                .flatten()
        });
        let num_pad_rows = graph_tokens.map_or(0, |t| t - real_tokens);
        let num_rows = seqs.len() + num_pad_rows;
        let num_tokens = real_tokens + num_pad_rows;
        let num_logit_rows: usize =
            seqs.iter().map(|s| s.num_logit_rows).sum::<usize>() + num_pad_rows;
        self.ensure_workspace(backend, num_tokens, num_logit_rows);
        let reach = seqs
            .iter()
            .map(|s| s.num_cached_tokens + s.token_ids.len())
            .max()
            .unwrap_or(0);
        self.ensure_rope_rows(backend, reach);
        let max_blocks = self.cfg.max_context_tokens.div_ceil(block_size);
        let _graph = graph_tokens
            .zip(backend.graphs())
            .map(|(tokens, graphs)| GraphStep::begin(graphs, tokens, max_blocks));
        let (moved, picked_rows) =
            Self::place_verified(backend, block_size, seqs, picked_rows, verified);
        let picked_rows = &picked_rows[..];
        self.positions.clear();
        self.slots.clear();
        self.ids.clear();
        self.picked.clear();
        // A graph step always passes picks, so its recorded embedding reads them.
        let with_picks = graph_tokens.is_some() || !picked_rows.is_empty();
        let mut attn_seqs = Vec::with_capacity(seqs.len());
        let mut last_rows = Vec::with_capacity(seqs.len());
        for (row, s) in seqs.iter().enumerate() {
            let query_start = self.ids.len();
            let num_cached_tokens = match moved.get(row) {
                Some(&MovedBack::Positions(n)) => s.num_cached_tokens - n,
                _ => s.num_cached_tokens,
            };
            for (i, &id) in s.token_ids.iter().enumerate() {
                let pos = num_cached_tokens + i;
                if with_picks {
                    let pick = picked_rows.get(row).copied().unwrap_or(NOT_PICKED);
                    self.picked.push(if i == 0 { pick } else { NOT_PICKED });
                }
                self.ids.push(id);
                self.positions.push(pos as u32);
                self.slots.push(crate::kernels::paged_kv::slot_of(
                    s.block_table,
                    block_size,
                    pos,
                ));
            }
            attn_seqs.push(SeqAttention {
                query_start,
                num_query_tokens: s.token_ids.len(),
                num_context_tokens: num_cached_tokens + s.token_ids.len(),
                block_table: s.block_table,
            });
            assert!(
                (1..=s.token_ids.len()).contains(&s.num_logit_rows),
                "a sequence returns 1..={} logit rows, not {}",
                s.token_ids.len(),
                s.num_logit_rows
            );
            last_rows.extend(self.ids.len() - s.num_logit_rows..self.ids.len());
        }
        for _ in seqs.len()..num_rows {
            attn_seqs.push(SeqAttention {
                query_start: self.ids.len(),
                num_query_tokens: 1,
                num_context_tokens: 0,
                block_table: &[],
            });
            last_rows.push(self.ids.len());
            self.ids.push(0);
            if with_picks {
                self.picked.push(NOT_PICKED);
            }
            self.positions.push(0);
            self.slots.push(crate::kernels::PAD_SLOT);
        }

        if !media.is_empty() {
            self.mrope_rows(backend, seqs, &moved, media);
        }
        let cos_sin = match &self.step_rope {
            Some(rows) if !media.is_empty() => rows,
            _ => &self.cos_sin,
        };
        let c = &self.cfg;
        let c_hidden = c.hidden_size;
        let w = &self.weights;
        let ws = self.ws.as_mut().expect("workspace ensured above");
        let mut collective = self.collective.as_deref_mut();
        // A rank's o and down projections see only its heads and MLP rows: partial sums.
        let mut reduce = |buf: &mut B::Buf| {
            if let Some(c) = collective.as_mut() {
                c.all_reduce_sum(backend, buf, num_tokens * c_hidden);
            }
        };
        let (hd, eps) = (c.head_dim, c.rms_norm_eps);
        backend.embedding(&w.embed, &self.ids, &self.picked, &mut ws.x);
        for m in media {
            let start = attn_seqs[m.row].query_start;
            for &(first, rows) in &m.embeds {
                backend.write_at(&mut ws.x, (start + first) * c_hidden, rows);
            }
        }
        for (li, lw) in w.layers.iter().enumerate() {
            if li == 0 {
                backend.rms_norm_into_gemm(
                    &ws.x,
                    &lw.attn_norm,
                    eps,
                    num_tokens,
                    c.hidden_size,
                    &mut ws.normed,
                );
            } else {
                // The previous layer's MLP output joins the residual stream here, fused.
                backend.add_rms_norm(
                    &mut ws.x,
                    &ws.proj,
                    &lw.attn_norm,
                    eps,
                    num_tokens,
                    c.hidden_size,
                    &mut ws.normed,
                );
            }
            backend.matmul(
                &ws.normed,
                num_tokens,
                &lw.wqkv,
                lw.bqkv.as_ref(),
                &mut ws.qkv,
            );
            let heads = QkvHeads {
                num_heads: c.num_heads,
                num_kv_heads: c.num_kv_heads,
                head_dim: hd,
            };
            let qk_norm = lw
                .q_norm
                .as_ref()
                .zip(lw.k_norm.as_ref())
                .map(|(q, k)| (q, k, eps));
            let fused = backend.qkv_into_cache(
                &ws.qkv,
                heads,
                qk_norm,
                &self.positions,
                cos_sin,
                cache,
                li,
                &self.slots,
                &mut ws.q,
            );
            if !fused {
                crate::kernels::composed::qkv_by_parts(
                    backend,
                    &ws.qkv,
                    heads,
                    qk_norm,
                    &self.positions,
                    &self.cos_sin,
                    cache,
                    li,
                    &self.slots,
                    &mut ws.q,
                    [&mut ws.k, &mut ws.v, &mut ws.attn],
                );
            }
            backend.paged_attention(&ws.q, cache, li, &attn_seqs, c.num_heads, &mut ws.attn);
            backend.matmul(&ws.attn, num_tokens, &lw.wo, None, &mut ws.proj);
            reduce(&mut ws.proj);
            backend.add_rms_norm(
                &mut ws.x,
                &ws.proj,
                &lw.ffn_norm,
                eps,
                num_tokens,
                c.hidden_size,
                &mut ws.normed,
            );
            backend.gate_up_silu(
                &ws.normed,
                num_tokens,
                &lw.w_gate_up,
                c.intermediate_size,
                &mut ws.gate_up,
                &mut ws.act,
            );
            backend.matmul(&ws.act, num_tokens, &lw.w_down, None, &mut ws.proj);
            reduce(&mut ws.proj);
        }
        backend.add(&mut ws.x, &ws.proj, num_tokens * c.hidden_size);
        backend.gather_rows(&ws.x, c.hidden_size, &last_rows, &mut ws.normed);
        backend.rms_norm_into_gemm(
            &ws.normed,
            &w.final_norm,
            eps,
            num_logit_rows,
            c.hidden_size,
            &mut ws.last,
        );
        let head = w.lm_head.as_ref().unwrap_or(&w.embed);
        backend.matmul(&ws.last, num_logit_rows, head, None, &mut ws.logits);
        moved
    }
}
