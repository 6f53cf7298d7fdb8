//! Images into the patches a Qwen2-VL-family encoder reads, as transformers'
//! `Qwen2VLImageProcessor` makes them: decoded to RGB, resized (`smart_resize`: both sides
//! multiples of patch × merge, the pixel count within bounds, the aspect kept) with Pillow's
//! filter, rescaled and normalised in f32, cut into patches repeated over the temporal patch.

use std::io::Cursor;
use std::path::Path;

use serde::Deserialize;

use super::VisionError;
use super::resample::{Filter, resize};

/// What decoding may cost: an image whose header claims more is refused before its
/// pixels are allocated (a decompression bomb is a few bytes that claim gigapixels).
#[derive(Debug, Clone, Copy)]
pub struct DecodeLimits {
    pub max_side_px: u32,
    pub max_alloc_bytes: u64,
}

impl Default for DecodeLimits {
    fn default() -> Self {
        DecodeLimits {
            max_side_px: 16_384,
            max_alloc_bytes: 256 << 20,
        }
    }
}

/// A decoded image: interleaved RGB, 8 bits a channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbImage {
    pub height: usize,
    pub width: usize,
    pub pixels: Vec<u8>,
}

impl RgbImage {
    /// Decodes PNG, JPEG, WebP or GIF bytes (the format read from the bytes; where the
    /// caller names a MIME type, it must agree) and converts to RGB as Pillow's
    /// `convert("RGB")` does (alpha dropped, grey replicated).
    pub fn decode(
        bytes: &[u8],
        mime: Option<&str>,
        limits: DecodeLimits,
    ) -> Result<RgbImage, VisionError> {
        let reader = image::ImageReader::new(Cursor::new(bytes))
            .with_guessed_format()
            .map_err(|e| VisionError::Decode(e.to_string()))?;
        let Some(format) = reader.format() else {
            return Err(VisionError::UnknownFormat);
        };
        if let Some(mime) = mime {
            let declared = image::ImageFormat::from_mime_type(mime)
                .ok_or_else(|| VisionError::UnsupportedMime(mime.to_string()))?;
            if declared != format {
                return Err(VisionError::MimeMismatch {
                    declared: mime.to_string(),
                    found: format.to_mime_type().to_string(),
                });
            }
        }
        let mut reader = reader;
        let mut image_limits = image::Limits::default();
        image_limits.max_image_width = Some(limits.max_side_px);
        image_limits.max_image_height = Some(limits.max_side_px);
        image_limits.max_alloc = Some(limits.max_alloc_bytes);
        reader.limits(image_limits);
        let decoded = reader.decode().map_err(|e| match e {
            image::ImageError::Limits(l) => VisionError::TooLarge(l.to_string()),
            other => VisionError::Decode(other.to_string()),
        })?;
        let rgb = decoded.into_rgb8();
        Ok(RgbImage {
            height: rgb.height() as usize,
            width: rgb.width() as usize,
            pixels: rgb.into_raw(),
        })
    }
}

/// `preprocessor_config.json` of a Qwen2-VL-family model, the fields that shape pixels.
#[derive(Debug, Clone, Deserialize)]
pub struct ImageProcessorConfig {
    #[serde(default = "default_patch")]
    pub patch_size: usize,
    #[serde(default = "default_temporal_patch")]
    pub temporal_patch_size: usize,
    #[serde(default = "default_merge")]
    pub merge_size: usize,
    #[serde(default)]
    pub min_pixels: Option<usize>,
    #[serde(default)]
    pub max_pixels: Option<usize>,
    #[serde(default)]
    pub size: Option<SizeBounds>,
    #[serde(default = "default_mean")]
    pub image_mean: [f32; 3],
    #[serde(default = "default_std")]
    pub image_std: [f32; 3],
    #[serde(default = "default_rescale")]
    pub rescale_factor: f64,
    #[serde(default = "default_resample")]
    pub resample: u64,
    #[serde(default = "yes")]
    pub do_resize: bool,
    #[serde(default = "yes")]
    pub do_rescale: bool,
    #[serde(default = "yes")]
    pub do_normalize: bool,
}

#[derive(Debug, Clone, Deserialize)]
pub struct SizeBounds {
    pub shortest_edge: Option<usize>,
    pub longest_edge: Option<usize>,
}

fn default_patch() -> usize {
    14
}
fn default_temporal_patch() -> usize {
    2
}
fn default_merge() -> usize {
    2
}
fn default_mean() -> [f32; 3] {
    [0.481_454_66, 0.457_827_5, 0.408_210_73]
}
fn default_std() -> [f32; 3] {
    [0.268_629_54, 0.261_302_6, 0.275_777_1]
}
fn default_rescale() -> f64 {
    1.0 / 255.0
}
fn default_resample() -> u64 {
    3
}
fn yes() -> bool {
    true
}

impl Default for ImageProcessorConfig {
    fn default() -> Self {
        serde_json::from_str("{}").expect("every field has a default")
    }
}

/// An image as the encoder reads it: `grid[1] * grid[2]` patches (one temporal patch) of
/// `3 * temporal_patch * patch * patch` values each, in the processor's order.
#[derive(Debug, Clone, PartialEq)]
pub struct ImagePatches {
    pub values: Vec<f32>,
    /// (temporal, height, width) in patches.
    pub grid: [usize; 3],
    pub merge_size: usize,
}

impl ImagePatches {
    /// Tokens the image takes in the prompt: its patches merged `merge × merge`.
    pub fn num_tokens(&self) -> usize {
        self.grid.iter().product::<usize>() / (self.merge_size * self.merge_size)
    }

    pub fn patch_len(&self) -> usize {
        self.values.len() / (self.grid[0] * self.grid[1] * self.grid[2])
    }
}

impl ImageProcessorConfig {
    pub fn from_file(path: &Path) -> Result<ImageProcessorConfig, VisionError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| VisionError::Config(format!("{}: {e}", path.display())))?;
        let cfg: ImageProcessorConfig = serde_json::from_str(&text)
            .map_err(|e| VisionError::Config(format!("{}: {e}", path.display())))?;
        cfg.check()?;
        Ok(cfg)
    }

    fn check(&self) -> Result<(), VisionError> {
        let bad = |why: String| Err(VisionError::Config(why));
        if self.patch_size == 0 || self.merge_size == 0 || self.temporal_patch_size == 0 {
            return bad("patch_size, merge_size and temporal_patch_size must be positive".into());
        }
        if Filter::from_pil_code(self.resample).is_none() {
            return bad(format!(
                "resample {} is not built (2: bilinear, 3: bicubic)",
                self.resample
            ));
        }
        let (lo, hi) = self.pixel_bounds();
        if lo > hi {
            return bad(format!("min pixels {lo} above max pixels {hi}"));
        }
        Ok(())
    }

    /// (min, max) pixels: `size` wins over the older `min_pixels` / `max_pixels`, as the
    /// processor's constructor has it.
    pub fn pixel_bounds(&self) -> (usize, usize) {
        let size = self.size.as_ref();
        let lo = size
            .and_then(|s| s.shortest_edge)
            .or(self.min_pixels)
            .unwrap_or(56 * 56);
        let hi = size
            .and_then(|s| s.longest_edge)
            .or(self.max_pixels)
            .unwrap_or(28 * 28 * 1280);
        (lo, hi)
    }

    /// transformers' `smart_resize`: the size the image is resized to.
    pub fn target_size(&self, height: usize, width: usize) -> Result<(usize, usize), VisionError> {
        let factor = (self.patch_size * self.merge_size) as f64;
        let (min_px, max_px) = self.pixel_bounds();
        let (h, w) = (height as f64, width as f64);
        if h.max(w) / h.min(w) > 200.0 {
            return Err(VisionError::AspectRatio { height, width });
        }
        // Python's round(): half to even.
        let mut h_bar = (h / factor).round_ties_even() * factor;
        let mut w_bar = (w / factor).round_ties_even() * factor;
        if h_bar * w_bar > max_px as f64 {
            let beta = ((h * w) / max_px as f64).sqrt();
            h_bar = factor.max((h / beta / factor).floor() * factor);
            w_bar = factor.max((w / beta / factor).floor() * factor);
        } else if h_bar * w_bar < min_px as f64 {
            let beta = (min_px as f64 / (h * w)).sqrt();
            h_bar = (h * beta / factor).ceil() * factor;
            w_bar = (w * beta / factor).ceil() * factor;
        }
        Ok((h_bar as usize, w_bar as usize))
    }

    /// The processor's `pixel_values` rows and `image_grid_thw` for one image.
    pub fn patches(&self, image: &RgbImage) -> Result<ImagePatches, VisionError> {
        let (p, m, t) = (self.patch_size, self.merge_size, self.temporal_patch_size);
        let (height, width) = if self.do_resize {
            self.target_size(image.height, image.width)?
        } else {
            (image.height, image.width)
        };
        if height % (p * m) != 0 || width % (p * m) != 0 {
            return Err(VisionError::Shape { height, width });
        }
        let filter = Filter::from_pil_code(self.resample).expect("checked at load");
        let resized;
        let pixels = if (height, width) != (image.height, image.width) {
            resized = resize(
                &image.pixels,
                3,
                (image.height, image.width),
                (height, width),
                filter,
            );
            &resized
        } else {
            &image.pixels
        };
        // np_rescale: u8 → f64 × factor → f32; np_normalize: (x - mean) / std in f32.
        let value = |v: u8, c: usize| -> f32 {
            let mut x = if self.do_rescale {
                (f64::from(v) * self.rescale_factor) as f32
            } else {
                f32::from(v)
            };
            if self.do_normalize {
                x = (x - self.image_mean[c]) / self.image_std[c];
            }
            x
        };
        let (gh, gw) = (height / p, width / p);
        let patch_len = 3 * t * p * p;
        let mut values = Vec::with_capacity(gh * gw * patch_len);
        for bh in 0..gh / m {
            for bw in 0..gw / m {
                for mh in 0..m {
                    for mw in 0..m {
                        let (y0, x0) = ((bh * m + mh) * p, (bw * m + mw) * p);
                        for c in 0..3 {
                            for _ in 0..t {
                                for py in 0..p {
                                    let row = &pixels[((y0 + py) * width + x0) * 3..];
                                    values.extend((0..p).map(|px| value(row[px * 3 + c], c)));
                                }
                            }
                        }
                    }
                }
            }
        }
        Ok(ImagePatches {
            values,
            grid: [1, gh, gw],
            merge_size: m,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smart_resize_keeps_bounds_and_factor() {
        let cfg = ImageProcessorConfig::default();
        for (h, w) in [(1, 1), (27, 1000), (4000, 3000), (224, 224), (57, 91)] {
            let (th, tw) = cfg.target_size(h, w).unwrap();
            assert_eq!((th % 28, tw % 28), (0, 0), "{h}x{w}");
            let (lo, hi) = cfg.pixel_bounds();
            assert!(
                th * tw <= hi && th * tw >= lo.min(28 * 28),
                "{h}x{w} → {th}x{tw}"
            );
        }
        assert!(matches!(
            cfg.target_size(1, 201),
            Err(VisionError::AspectRatio { .. })
        ));
    }

    #[test]
    fn a_bomb_is_refused_before_its_pixels_are_allocated() {
        // A PNG header claiming 100 000 × 100 000 pixels, followed by nothing.
        let mut png = Vec::new();
        let img = image::RgbImage::new(1, 1);
        img.write_to(&mut Cursor::new(&mut png), image::ImageFormat::Png)
            .unwrap();
        // IHDR's width and height sit at bytes 16..24, its CRC (over type and data) after.
        png[16..20].copy_from_slice(&100_000u32.to_be_bytes());
        png[20..24].copy_from_slice(&100_000u32.to_be_bytes());
        let crc = crc32fast::hash(&png[12..29]);
        png[29..33].copy_from_slice(&crc.to_be_bytes());
        let err = RgbImage::decode(&png, None, DecodeLimits::default()).unwrap_err();
        assert!(matches!(err, VisionError::TooLarge(_)), "{err:?}");
    }

    #[test]
    fn a_declared_mime_type_must_match_the_bytes() {
        let mut png = Vec::new();
        image::RgbImage::new(2, 2)
            .write_to(&mut Cursor::new(&mut png), image::ImageFormat::Png)
            .unwrap();
        assert!(RgbImage::decode(&png, Some("image/png"), DecodeLimits::default()).is_ok());
        let err = RgbImage::decode(&png, Some("image/jpeg"), DecodeLimits::default()).unwrap_err();
        assert!(matches!(err, VisionError::MimeMismatch { .. }), "{err:?}");
        let err = RgbImage::decode(b"not an image", None, DecodeLimits::default()).unwrap_err();
        assert!(matches!(err, VisionError::UnknownFormat), "{err:?}");
    }
}
