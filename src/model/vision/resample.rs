//! Pillow's resampling of 8-bit images, reproduced to the bit: transformers' image
//! processors resize with `PIL.Image.resize` (and torchvision's uint8 path ports the same
//! fixed-point arithmetic), so a model sees exactly these pixels in both.
//!
//! The algorithm (Pillow's `Resample.c`): per output pixel a window of source pixels
//! weighted by the filter stretched over the scale (antialiasing when shrinking), weights
//! normalised in f64, then rounded to fixed point with 22 fractional bits; a horizontal pass
//! over the rows the vertical pass needs, clipped to 8 bits, then the vertical pass.

/// Fractional bits of the fixed-point weights (Pillow: `32 - 8 - 2`).
const PRECISION_BITS: u32 = 32 - 8 - 2;

/// The filters transformers' processors name (`PILImageResampling`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Filter {
    Bilinear,
    Bicubic,
}

impl Filter {
    /// `PILImageResampling`'s integer codes, as preprocessor configs write them.
    pub fn from_pil_code(code: u64) -> Option<Filter> {
        match code {
            2 => Some(Filter::Bilinear),
            3 => Some(Filter::Bicubic),
            _ => None,
        }
    }

    fn support(self) -> f64 {
        match self {
            Filter::Bilinear => 1.0,
            Filter::Bicubic => 2.0,
        }
    }

    fn weight(self, x: f64) -> f64 {
        let x = x.abs();
        match self {
            Filter::Bilinear => (1.0 - x).max(0.0),
            Filter::Bicubic => {
                // Keys' kernel with a = -0.5, as Pillow has it.
                const A: f64 = -0.5;
                if x < 1.0 {
                    ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    (((x - 5.0) * x + 8.0) * x - 4.0) * A
                } else {
                    0.0
                }
            }
        }
    }
}

/// One axis' taps: output pixel `o` reads `len[o]` source pixels from `first[o]`, with the
/// fixed-point weights `weights[o * taps ..][.. len[o]]`.
struct Taps {
    first: Vec<usize>,
    len: Vec<usize>,
    taps: usize,
    weights: Vec<i32>,
}

impl Taps {
    /// Pillow's `precompute_coeffs` then `normalize_coeffs_8bpc`, over the whole input.
    fn new(in_size: usize, out_size: usize, filter: Filter) -> Taps {
        let scale = in_size as f64 / out_size as f64;
        let filter_scale = scale.max(1.0);
        let support = filter.support() * filter_scale;
        let taps = support.ceil() as usize * 2 + 1;
        let mut first = Vec::with_capacity(out_size);
        let mut len = Vec::with_capacity(out_size);
        let mut weights = vec![0i32; out_size * taps];
        let mut k = vec![0f64; taps];
        // Pillow multiplies by the reciprocal; dividing can round a weight differently.
        let inv_scale = 1.0 / filter_scale;
        for o in 0..out_size {
            let center = (o as f64 + 0.5) * scale;
            // Pillow rounds by truncating x + 0.5, negative values included.
            let lo = ((center - support + 0.5) as i64).max(0) as usize;
            let hi = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
            let n = hi.saturating_sub(lo);
            let mut total = 0.0;
            for (x, w) in k.iter_mut().enumerate().take(n) {
                *w = filter.weight((x as f64 + lo as f64 - center + 0.5) * inv_scale);
                total += *w;
            }
            for (x, &w) in k.iter().enumerate().take(n) {
                let w = if total != 0.0 { w / total } else { w };
                let fixed = w * f64::from(1u32 << PRECISION_BITS);
                weights[o * taps + x] = if w < 0.0 {
                    (fixed - 0.5) as i32
                } else {
                    (fixed + 0.5) as i32
                };
            }
            first.push(lo);
            len.push(n);
        }
        Taps {
            first,
            len,
            taps,
            weights,
        }
    }

    fn of(&self, o: usize) -> (usize, &[i32]) {
        let w = &self.weights[o * self.taps..][..self.len[o]];
        (self.first[o], w)
    }
}

fn clip8(acc: i32) -> u8 {
    if acc >= 255 << PRECISION_BITS {
        255
    } else if acc <= 0 {
        0
    } else {
        (acc >> PRECISION_BITS) as u8
    }
}

/// Resizes an interleaved 8-bit image of `channels` channels, `(height, width)` to
/// `(out_height, out_width)`, as `PIL.Image.resize(size, filter)` does (no reducing gap).
pub fn resize(
    pixels: &[u8],
    channels: usize,
    (height, width): (usize, usize),
    (out_height, out_width): (usize, usize),
    filter: Filter,
) -> Vec<u8> {
    assert_eq!(pixels.len(), height * width * channels, "image buffer size");
    assert!(height > 0 && width > 0 && out_height > 0 && out_width > 0);
    let vertical = (out_height != height).then(|| Taps::new(height, out_height, filter));
    // The horizontal pass covers only the source rows the vertical pass reads.
    let (row_first, row_end) = match &vertical {
        Some(v) => (v.first[0], v.first[out_height - 1] + v.len[out_height - 1]),
        None => (0, height),
    };
    let wide: Vec<u8> = if out_width != width {
        let taps = Taps::new(width, out_width, filter);
        let mut out = vec![0u8; (row_end - row_first) * out_width * channels];
        for (r, out_row) in out.chunks_exact_mut(out_width * channels).enumerate() {
            let row = &pixels[(row_first + r) * width * channels..][..width * channels];
            for x in 0..out_width {
                let (lo, w) = taps.of(x);
                for c in 0..channels {
                    let mut acc = 1i32 << (PRECISION_BITS - 1);
                    for (i, &k) in w.iter().enumerate() {
                        acc += i32::from(row[(lo + i) * channels + c]) * k;
                    }
                    out_row[x * channels + c] = clip8(acc);
                }
            }
        }
        out
    } else {
        pixels[row_first * width * channels..row_end * width * channels].to_vec()
    };
    let Some(vertical) = vertical else {
        return wide;
    };
    let stride = out_width * channels;
    let mut out = vec![0u8; out_height * stride];
    for (y, out_row) in out.chunks_exact_mut(stride).enumerate() {
        let (lo, w) = vertical.of(y);
        let lo = lo - row_first;
        for (i, px) in out_row.iter_mut().enumerate() {
            let mut acc = 1i32 << (PRECISION_BITS - 1);
            for (j, &k) in w.iter().enumerate() {
                acc += i32::from(wide[(lo + j) * stride + i]) * k;
            }
            *px = clip8(acc);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_of_every_output_pixel_sum_to_one_in_fixed_point() {
        for (inp, out) in [(17, 5), (5, 17), (100, 33), (33, 100), (7, 7)] {
            for filter in [Filter::Bilinear, Filter::Bicubic] {
                let taps = Taps::new(inp, out, filter);
                for o in 0..out {
                    let sum: i64 = taps.of(o).1.iter().map(|&w| i64::from(w)).sum();
                    // Each weight rounds on its own: a few units of 2^-22 either way.
                    assert!(
                        (sum - (1 << PRECISION_BITS)).abs() <= taps.taps as i64,
                        "{sum}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_flat_image_stays_flat_at_any_size() {
        let img = vec![173u8; 9 * 13 * 3];
        for size in [(4, 5), (28, 56), (9, 13), (1, 1)] {
            let out = resize(&img, 3, (9, 13), size, Filter::Bicubic);
            assert!(out.iter().all(|&v| v == 173), "{size:?}");
        }
    }
}
