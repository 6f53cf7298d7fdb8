//! Multimodal RoPE (Qwen2-VL's M-RoPE): every prompt token has a (temporal, row, column)
//! position. Text tokens carry one position thrice, counting on from the last; an image's
//! tokens share the position where it starts, plus their row and column in the merged
//! grid, and the text after it resumes past its larger side (transformers'
//! `get_rope_index`). The head's frequencies are split in three sections, each turned by
//! one of the three positions.

/// An image's place in a prompt: its first placeholder token and its grid of merged
/// patches (temporal, rows, columns): one token per merged patch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ImageSpan {
    pub start: usize,
    pub grid: [usize; 3],
}

impl ImageSpan {
    pub fn num_tokens(&self) -> usize {
        self.grid.iter().product()
    }

    fn end(&self) -> usize {
        self.start + self.num_tokens()
    }
}

/// How many of the head's frequencies each of (temporal, row, column) turns, in order
/// (`rope_parameters.mrope_section`; Qwen2.5-VL: 16, 24, 24 for 64 frequencies).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MropeSection(pub [usize; 3]);

impl MropeSection {
    /// Which position turns frequency `j`.
    fn axis(&self, j: usize) -> usize {
        let [t, h, _] = self.0;
        if j < t {
            0
        } else if j < t + h {
            1
        } else {
            2
        }
    }

    /// A cos/sin row (cos halves then sin halves, as `rope::cos_sin_table`) for a token
    /// at `pos`; a text token's row equals the plain table's at its position.
    pub fn cos_sin_row(&self, inv_freqs: &[f64], pos: [u32; 3], row: &mut [f32]) {
        let half = inv_freqs.len();
        for (j, &f) in inv_freqs.iter().enumerate() {
            let angle = (pos[self.axis(j)] as f32 * f as f32) as f64;
            row[j] = angle.cos() as f32;
            row[half + j] = angle.sin() as f32;
        }
    }
}

/// The (temporal, row, column) position of prompt token `p`, given the prompt's images in
/// order. Past the prompt it goes on as text.
pub fn position(spans: &[ImageSpan], p: usize) -> [u32; 3] {
    let mut text_pos = 0usize;
    let mut prev_end = 0usize;
    for span in spans {
        if p < span.start {
            break;
        }
        text_pos += span.start - prev_end;
        if p < span.end() {
            let i = p - span.start;
            let [_, gh, gw] = span.grid;
            let (t, r, c) = (i / (gh * gw), i / gw % gh, i % gw);
            return [
                (text_pos + t) as u32,
                (text_pos + r) as u32,
                (text_pos + c) as u32,
            ];
        }
        text_pos += gh_gw_max(span);
        prev_end = span.end();
    }
    let p = (text_pos + (p - prev_end)) as u32;
    [p, p, p]
}

fn gh_gw_max(span: &ImageSpan) -> usize {
    span.grid[1].max(span.grid[2])
}

/// How far text positions after every image lag behind token indices (negative of
/// transformers' `rope_deltas`, which is `max position + 1 - length`).
pub fn lag(spans: &[ImageSpan]) -> usize {
    spans.iter().map(|s| s.num_tokens() - gh_gw_max(s)).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_follow_get_rope_index() {
        // "ab" + a 2×3 image + "c" + a 1×1 image + "de".
        let spans = [
            ImageSpan {
                start: 2,
                grid: [1, 2, 3],
            },
            ImageSpan {
                start: 9,
                grid: [1, 1, 1],
            },
        ];
        let got: Vec<[u32; 3]> = (0..12).map(|p| position(&spans, p)).collect();
        let want = vec![
            [0, 0, 0],
            [1, 1, 1],
            [2, 2, 2],
            [2, 2, 3],
            [2, 2, 4],
            [2, 3, 2],
            [2, 3, 3],
            [2, 3, 4],
            [5, 5, 5],
            [6, 6, 6],
            [7, 7, 7],
            [8, 8, 8],
        ];
        assert_eq!(got, want);
        // The text after both images lags its index by (6 - 3) + (1 - 1).
        assert_eq!(lag(&spans), 3);
        assert_eq!(position(&spans, 40), [37, 37, 37]);
    }
}
