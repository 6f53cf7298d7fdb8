//! Images for vision-language models (Qwen2.5-VL): decoding and the processor's pixels
//! (`preprocess`, with Pillow's resampling in `resample`), the vision encoder (`encoder`, on
//! any backend; its windows and rotary angles in `windows`)
//! and the language model's multimodal RoPE positions (`mrope`).

pub mod encoder;
pub mod mrope;
pub mod preprocess;
pub mod resample;
mod windows;

pub use encoder::{VisionConfig, VisionEncoder};
pub use mrope::{ImageSpan, MropeSection};
pub use preprocess::{DecodeLimits, ImagePatches, ImageProcessorConfig, RgbImage};

use std::path::Path;

use super::loader::SafetensorsSource;
use crate::error::TroupeError;

/// What the request side needs of a vision-language model: how images become patches and
/// which token stands for each of an image's merged patches.
#[derive(Debug, Clone)]
pub struct VisionText {
    pub processor: ImageProcessorConfig,
    /// `<|image_pad|>`: repeated once per token of an image.
    pub image_token_id: u32,
    /// The values of one patch (3 × temporal patch × patch²).
    pub patch_len: usize,
}

impl VisionText {
    /// A model directory's vision side: `None` for a text-only model (no `vision_config`).
    pub fn from_hf_dir(
        dir: &Path,
        config: &serde_json::Value,
    ) -> Result<Option<VisionText>, VisionError> {
        if !config["vision_config"].is_object() {
            return Ok(None);
        }
        let vision = VisionConfig::from_hf_json(config)?;
        let processor = ImageProcessorConfig::from_file(&dir.join("preprocessor_config.json"))?;
        if processor.patch_size != vision.patch_size
            || processor.merge_size != vision.spatial_merge_size
            || processor.temporal_patch_size != vision.temporal_patch_size
        {
            return Err(VisionError::Config(format!(
                "preprocessor_config.json's patch {}, merge {} and temporal patch {} differ from the encoder's {}, {} and {}",
                processor.patch_size,
                processor.merge_size,
                processor.temporal_patch_size,
                vision.patch_size,
                vision.spatial_merge_size,
                vision.temporal_patch_size
            )));
        }
        let image_token_id = config["image_token_id"]
            .as_u64()
            .ok_or_else(|| VisionError::Config("config.json has no `image_token_id`".into()))?
            as u32;
        Ok(Some(VisionText {
            patch_len: 3
                * processor.temporal_patch_size
                * processor.patch_size
                * processor.patch_size,
            processor,
            image_token_id,
        }))
    }
}

/// The vision encoder of the model at `path` on the host and its image token; `None` for a
/// text-only model or a GGUF file.
pub fn load_encoder(path: &Path) -> Result<Option<(VisionEncoder, u32)>, TroupeError> {
    let host = crate::kernels::cpu::CpuBackend {
        exact_activations: true,
        ..Default::default()
    };
    load_encoder_on(path, host)
}

/// `load_encoder` with the encoder's weights on `backend`.
pub fn load_encoder_on<B: crate::kernels::Backend>(
    path: &Path,
    backend: B,
) -> Result<Option<(VisionEncoder<B>, u32)>, TroupeError> {
    let config = path.join("config.json");
    if !path.is_dir() || !config.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&config).map_err(|e| TroupeError::io(&config, e))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| TroupeError::ModelFormat {
            path: config.clone(),
            reason: format!("invalid JSON: {e}"),
        })?;
    let invalid = |e: VisionError| TroupeError::InvalidInput(e.to_string());
    let Some(vision) = VisionText::from_hf_dir(path, &json).map_err(invalid)? else {
        return Ok(None);
    };
    let cfg = VisionConfig::from_hf_json(&json).map_err(invalid)?;
    let src = SafetensorsSource::open_dir(path)?;
    let encoder = VisionEncoder::load_on(cfg, &src, backend).map_err(invalid)?;
    Ok(Some((encoder, vision.image_token_id)))
}

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
