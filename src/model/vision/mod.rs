//! Images for vision-language models (Qwen2.5-VL): decoding and the processor's pixels
//! (`preprocess`, with Pillow's resampling in `resample`), the vision encoder (`encoder`)
//! and the language model's multimodal RoPE positions (`mrope`).

pub mod encoder;
pub mod mrope;
pub mod preprocess;
pub mod resample;

pub use encoder::{VisionConfig, VisionEncoder};
pub use mrope::{ImageSpan, MropeSection};
pub use preprocess::{DecodeLimits, ImagePatches, ImageProcessorConfig, RgbImage};

/// Why an image or a vision model's files were refused; each names the problem.
#[derive(Debug, thiserror::Error)]
pub enum VisionError {
    #[error("the image's format is not one of PNG, JPEG, WebP or GIF")]
    UnknownFormat,
    #[error(
        "image MIME type {0:?} is not supported (image/png, image/jpeg, image/webp, image/gif)"
    )]
    UnsupportedMime(String),
    #[error("the image was declared {declared} but its bytes are {found}")]
    MimeMismatch { declared: String, found: String },
    #[error("the image could not be decoded: {0}")]
    Decode(String),
    #[error("the image is larger than this server decodes: {0}")]
    TooLarge(String),
    #[error("image {width}x{height}: the aspect ratio must be below 200")]
    AspectRatio { height: usize, width: usize },
    #[error("image resized to {width}x{height} is not a whole number of merged patches")]
    Shape { height: usize, width: usize },
    #[error("vision model configuration: {0}")]
    Config(String),
    #[error("vision weights: {0}")]
    Weights(String),
}
