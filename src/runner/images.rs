//! A rank's images (vision-language models): each step's rows turned into what the language
//! model runs — placeholders back to the image token, the encoder's rows over them (from
//! the engine's `ImageEncoder`), every position placed by the sequence's images.

use super::image_encoder::ImageEncoder;
use super::rank_step::RankStep;
use crate::model::llama::{RowMedia, SeqStep};
use crate::model::vision::ImageSpan;
use crate::step::is_virtual;
use crate::sync::Shared;

/// The engine's encoder, as a rank reads it.
pub(super) struct RankImages {
    encoder: Shared<ImageEncoder>,
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
    pub(super) fn new(encoder: Shared<ImageEncoder>) -> RankImages {
        RankImages { encoder }
    }

    /// What `step`'s rows with images need; `None` where it has none.
    pub(super) fn prepare(&mut self, step: &RankStep<'_>) -> Option<StepImages> {
        if step.rows.iter().all(|r| r.row.images.is_none()) {
            return None;
        }
        let hidden = self.encoder.out_hidden_size();
        let mut ids = Vec::with_capacity(step.rows.len());
        let mut rows = Vec::new();
        for (i, r) in step.rows.iter().enumerate() {
            let tokens = r.seq.token_ids;
            ids.push(tokens.iter().any(|&t| is_virtual(t)).then(|| {
                tokens
                    .iter()
                    .map(|&t| {
                        if is_virtual(t) {
                            self.encoder.image_token_id
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
                    embeds.push((
                        s - lo,
                        self.encoder.rows(image),
                        s - image.first_token,
                        e - s,
                    ));
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
