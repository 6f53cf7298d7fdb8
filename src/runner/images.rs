//! A rank's images (vision-language models): the encoder, run on each image the first time
//! a step reaches its placeholders and kept by content hash, and each step's rows turned
//! into what the language model runs: placeholders back to the image token, the encoder's
//! rows over them, every position placed by the sequence's images.

use std::collections::VecDeque;

use super::rank_step::RankStep;
use crate::model::llama::{RowMedia, SeqStep};
use crate::model::vision::{ImageSpan, VisionEncoder};
use crate::step::{PromptImage, is_virtual};
use crate::sync::Shared;

/// Encoder rows kept for images seen lately (a later turn with the same image, a
/// preempted request recomputed, another completion of it).
const CACHE_BYTES: usize = 256 << 20;

pub(super) struct RankImages {
    encoder: VisionEncoder,
    image_token_id: u32,
    /// (image hash, its rows), least recently used first.
    cache: VecDeque<(u64, Shared<Vec<f32>>)>,
    cached_bytes: usize,
}

/// A step's rows as the language model runs them, owned for the step's length.
pub(super) struct StepImages {
    /// Per row, its tokens with every placeholder the image token (`None`: none in it).
    ids: Vec<Option<Vec<u32>>>,
    rows: Vec<ImageRow>,
    hidden: usize,
}

/// A row of a sequence with images: its index, the sequence's spans, and the encoder rows
/// it runs (first token in the row, the image's rows, first of them, count).
struct ImageRow {
    row: usize,
    spans: Vec<ImageSpan>,
    embeds: Vec<(usize, Shared<Vec<f32>>, usize, usize)>,
}

impl RankImages {
    pub(super) fn new(encoder: VisionEncoder, image_token_id: u32) -> RankImages {
        RankImages {
            encoder,
            image_token_id,
            cache: VecDeque::new(),
            cached_bytes: 0,
        }
    }

    /// The encoder's rows for `image`, from the cache or encoded now.
    fn rows_of(&mut self, image: &PromptImage) -> Shared<Vec<f32>> {
        if let Some(i) = self.cache.iter().position(|(h, _)| *h == image.hash) {
            let entry = self.cache.remove(i).expect("found");
            let rows = entry.1.clone();
            self.cache.push_back(entry);
            return rows;
        }
        let rows = Shared::new(self.encoder.encode_pixels(&image.pixels, image.grid));
        self.cached_bytes += rows.len() * 4;
        self.cache.push_back((image.hash, rows.clone()));
        while self.cached_bytes > CACHE_BYTES && self.cache.len() > 1 {
            let (_, old) = self.cache.pop_front().expect("more than one");
            self.cached_bytes -= old.len() * 4;
        }
        rows
    }

    /// What `step`'s rows with images need; `None` where it has none.
    pub(super) fn prepare(&mut self, step: &RankStep<'_>) -> Option<StepImages> {
        if step.rows.iter().all(|r| r.row.images.is_none()) {
            return None;
        }
        let hidden = self.encoder.cfg.out_hidden_size;
        let mut ids = Vec::with_capacity(step.rows.len());
        let mut rows = Vec::new();
        for (i, r) in step.rows.iter().enumerate() {
            let tokens = r.seq.token_ids;
            ids.push(tokens.iter().any(|&t| is_virtual(t)).then(|| {
                tokens
                    .iter()
                    .map(|&t| {
                        if is_virtual(t) {
                            self.image_token_id
                        } else {
                            t
                        }
                    })
                    .collect()
            }));
            let Some(images) = &r.row.images else {
                continue;
            };
            let spans: Vec<ImageSpan> = images
                .iter()
                .map(|im| ImageSpan {
                    start: im.first_token,
                    grid: im.token_grid(),
                })
                .collect();
            let (lo, hi) = (
                r.seq.num_cached_tokens,
                r.seq.num_cached_tokens + tokens.len(),
            );
            let mut embeds = Vec::new();
            for image in images.iter() {
                let (s, e) = (image.first_token.max(lo), image.end_token().min(hi));
                // Only placeholders the row runs now (a prompt's, not a draft's).
                if s < e && tokens[s - lo..e - lo].iter().all(|&t| is_virtual(t)) {
                    embeds.push((s - lo, self.rows_of(image), s - image.first_token, e - s));
                }
            }
            rows.push(ImageRow {
                row: i,
                spans,
                embeds,
            });
        }
        Some(StepImages { ids, rows, hidden })
    }
}

impl StepImages {
    /// `seqs` reading the restored ids, and each image row's media.
    pub(super) fn apply<'a>(&'a self, seqs: &mut [SeqStep<'a>]) -> Vec<RowMedia<'a>> {
        for (seq, ids) in seqs.iter_mut().zip(&self.ids) {
            if let Some(ids) = ids {
                seq.token_ids = ids;
            }
        }
        let h = self.hidden;
        self.rows
            .iter()
            .map(|r| RowMedia {
                row: r.row,
                spans: &r.spans,
                embeds: r
                    .embeds
                    .iter()
                    .map(|(at, rows, first, n)| (*at, &rows[first * h..(first + n) * h]))
                    .collect(),
            })
            .collect()
    }
}
