//! Images in requests: OpenAI's `image_url` parts and Anthropic's `image` blocks read into
//! the conversation (base64 data), then, when the prompt is rendered, decoded under limits,
//! made into the model's patches and each image's one placeholder widened to its tokens.

use base64::Engine as _;
use serde_json::Value;

use super::conversation::{Conversation, ImageInput, Message, Part};
use crate::api::PromptImage;
use crate::model::ModelText;
use crate::model::vision::{DecodeLimits, RgbImage};

/// Why a request's image was refused, and the field it came in (an `ApiError` for the
/// client).
#[derive(Debug)]
pub struct ImageRefusal {
    pub field: String,
    pub message: String,
}

impl ImageRefusal {
    fn bad(field: &str, message: impl Into<String>) -> ImageRefusal {
        ImageRefusal {
            field: field.to_string(),
            message: message.into(),
        }
    }
}

/// Encoded bytes one image may take (a base64 string a third larger).
const MAX_IMAGE_BYTES: usize = 20 << 20;

/// Appends image `input` to a conversation's `images` as the next part of `msg`.
pub fn push_image(images: &mut Vec<ImageInput>, msg: &mut Message, input: ImageInput) {
    if msg.parts.is_empty() && !msg.content.is_empty() {
        msg.parts.push(Part::Text(msg.content.clone()));
    }
    msg.parts.push(Part::Image(images.len()));
    images.push(input);
}

/// Appends text to `msg`, as a part where it holds images.
pub fn push_text(msg: &mut Message, text: &str) {
    if !msg.parts.is_empty() {
        msg.parts.push(Part::Text(text.to_string()));
    }
    msg.content.push_str(text);
}

fn decode_base64(data: &str, field: &str) -> Result<Vec<u8>, ImageRefusal> {
    if data.len() > MAX_IMAGE_BYTES / 3 * 4 + 4 {
        return Err(ImageRefusal::bad(
            field,
            format!("the image is over {} MiB", MAX_IMAGE_BYTES >> 20),
        ));
    }
    base64::engine::general_purpose::STANDARD
        .decode(data.trim())
        .map_err(|e| ImageRefusal::bad(field, format!("the image's base64 data is invalid: {e}")))
}

/// OpenAI's `{"type": "image_url", "image_url": {"url": ..., "detail": ...}}`: a
/// `data:<mime>;base64,<data>` URL. Remote URLs are refused by name: this server fetches
/// nothing.
pub fn openai_image(part: &Value, field: &str) -> Result<ImageInput, ImageRefusal> {
    let spec = &part["image_url"];
    let url = spec
        .as_str()
        .or_else(|| spec["url"].as_str())
        .ok_or_else(|| ImageRefusal::bad(&format!("{field}.image_url"), "`url` is required"))?;
    if let Some(detail) = spec["detail"]
        .as_str()
        .filter(|d| !matches!(*d, "auto" | "high"))
    {
        return Err(ImageRefusal::bad(
            &format!("{field}.image_url.detail"),
            format!("detail `{detail}` is not supported: images are seen whole (auto, high)"),
        ));
    }
    let url_field = format!("{field}.image_url.url");
    let Some(rest) = url.strip_prefix("data:") else {
        return Err(ImageRefusal::bad(
            &url_field,
            "only `data:` URLs are taken (base64 images); this server fetches no remote URL",
        ));
    };
    let (head, data) = rest
        .split_once(',')
        .ok_or_else(|| ImageRefusal::bad(&url_field, "a data URL needs a `,` before its data"))?;
    let Some(mime) = head.strip_suffix(";base64") else {
        return Err(ImageRefusal::bad(
            &url_field,
            "a data URL's image must be base64 (`;base64,`)",
        ));
    };
    Ok(ImageInput {
        bytes: decode_base64(data, &url_field)?,
        mime: (!mime.is_empty()).then(|| mime.to_string()),
        field: field.to_string(),
    })
}

/// Anthropic's `{"type": "image", "source": {"type": "base64", "media_type", "data"}}`.
pub fn anthropic_image(block: &Value, field: &str) -> Result<ImageInput, ImageRefusal> {
    let source = &block["source"];
    let source_field = format!("{field}.source");
    match source["type"].as_str() {
        Some("base64") => {}
        other => {
            return Err(ImageRefusal::bad(
                &format!("{source_field}.type"),
                format!("image source {other:?} is not supported (base64)"),
            ));
        }
    }
    let data = source["data"]
        .as_str()
        .ok_or_else(|| ImageRefusal::bad(&format!("{source_field}.data"), "`data` is required"))?;
    Ok(ImageInput {
        bytes: decode_base64(data, &format!("{source_field}.data"))?,
        mime: source["media_type"].as_str().map(str::to_string),
        field: field.to_string(),
    })
}

/// `prompt_ids` (rendered with one placeholder per image, in order) widened to each
/// image's tokens, and the images as the engine takes them.
pub fn expand(
    conv: &Conversation,
    text: &ModelText,
    prompt_ids: Vec<u32>,
) -> Result<(Vec<u32>, Vec<PromptImage>), ImageRefusal> {
    if conv.images.is_empty() {
        return Ok((prompt_ids, Vec::new()));
    }
    let Some(vision) = &text.vision else {
        return Err(ImageRefusal::bad(
            &conv.images[0].field,
            "this model takes no images (it is not a vision-language model)",
        ));
    };
    let placeholder = vision.image_token_id;
    let found = prompt_ids.iter().filter(|&&t| t == placeholder).count();
    if found != conv.images.len() {
        return Err(ImageRefusal::bad(
            "messages",
            format!(
                "the chat template placed {found} image placeholders for {} images",
                conv.images.len()
            ),
        ));
    }
    let mut ids = Vec::with_capacity(prompt_ids.len());
    let mut images = Vec::with_capacity(conv.images.len());
    let mut next = conv.images.iter();
    for id in prompt_ids {
        if id != placeholder {
            ids.push(id);
            continue;
        }
        let input = next.next().expect("counted above");
        let bad =
            |e: crate::model::vision::VisionError| ImageRefusal::bad(&input.field, e.to_string());
        let decoded =
            RgbImage::decode(&input.bytes, input.mime.as_deref(), DecodeLimits::default())
                .map_err(bad)?;
        let patches = vision.processor.patches(&decoded).map_err(bad)?;
        let image = PromptImage::new(ids.len(), patches.grid, patches.merge_size, patches.values);
        ids.extend(std::iter::repeat_n(placeholder, image.num_tokens()));
        images.push(image);
    }
    Ok((ids, images))
}
