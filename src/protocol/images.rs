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
    if url.starts_with("http://") || url.starts_with("https://") {
        return Ok(ImageInput {
            bytes: Vec::new(),
            url: Some(url.to_string()),
            mime: None,
            field: format!("{field}.image_url.url"),
        });
    }
    let Some(rest) = url.strip_prefix("data:") else {
        return Err(ImageRefusal::bad(
            &url_field,
            "an image URL is a base64 `data:` URL or an http(s) URL",
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
        url: None,
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
        Some("url") => {
            let url = source["url"]
                .as_str()
                .filter(|u| u.starts_with("http://") || u.starts_with("https://"));
            let url = url.ok_or_else(|| {
                ImageRefusal::bad(
                    &format!("{source_field}.url"),
                    "an http(s) `url` is required",
                )
            })?;
            return Ok(ImageInput {
                bytes: Vec::new(),
                url: Some(url.to_string()),
                mime: None,
                field: format!("{source_field}.url"),
            });
        }
        other => {
            return Err(ImageRefusal::bad(
                &format!("{source_field}.type"),
                format!("image source {other:?} is not supported (base64, url)"),
            ));
        }
    }
    let data = source["data"]
        .as_str()
        .ok_or_else(|| ImageRefusal::bad(&format!("{source_field}.data"), "`data` is required"))?;
    Ok(ImageInput {
        bytes: decode_base64(data, &format!("{source_field}.data"))?,
        url: None,
        mime: source["media_type"].as_str().map(str::to_string),
        field: field.to_string(),
    })
}

/// How long fetching one image may take, start to last byte.
const FETCH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The bytes of every image given by URL, fetched where its host is one of `allowed`
/// (`--allowed-media-domains`; no redirects, `MAX_IMAGE_BYTES` at most, `FETCH_TIMEOUT`);
/// any other host is refused by name. Blocking: run off the async workers.
pub fn fetch_remote(conv: &mut Conversation, allowed: &[String]) -> Result<(), ImageRefusal> {
    for input in conv.images.iter_mut() {
        let Some(url) = input.url.take() else {
            continue;
        };
        let host = url
            .split_once("://")
            .map(|(_, rest)| rest.split(['/', '?', '#']).next().unwrap_or(""))
            .map(|authority| authority.rsplit('@').next().unwrap_or(""))
            .map(|hostport| match hostport.rsplit_once(':') {
                Some((h, port)) if port.chars().all(|c| c.is_ascii_digit()) => h,
                _ => hostport,
            })
            .unwrap_or("");
        if !allowed.iter().any(|a| a.eq_ignore_ascii_case(host)) {
            return Err(ImageRefusal::bad(
                &input.field,
                format!(
                    "images are fetched only from the hosts --allowed-media-domains names; `{host}` is not one (or send a base64 data: URL)"
                ),
            ));
        }
        let agent = ureq::AgentBuilder::new()
            .timeout(FETCH_TIMEOUT)
            .redirects(0)
            .build();
        let response = agent.get(&url).call().map_err(|e| {
            ImageRefusal::bad(&input.field, format!("fetching the image failed: {e}"))
        })?;
        input.mime = response
            .header("content-type")
            .map(|m| m.split(';').next().unwrap_or("").trim().to_string())
            .filter(|m| m.starts_with("image/"));
        let mut bytes = Vec::new();
        use std::io::Read;
        response
            .into_reader()
            .take(MAX_IMAGE_BYTES as u64 + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| {
                ImageRefusal::bad(&input.field, format!("reading the image failed: {e}"))
            })?;
        if bytes.len() > MAX_IMAGE_BYTES {
            return Err(ImageRefusal::bad(
                &input.field,
                format!("the image is over {} MiB", MAX_IMAGE_BYTES >> 20),
            ));
        }
        input.bytes = bytes;
    }
    Ok(())
}

/// `prompt_ids` (rendered with one placeholder per image, in order) widened to each
/// image's tokens, and the images as the engine takes them.
pub fn expand(
    conv: &Conversation,
    text: &ModelText,
    prompt_ids: Vec<u32>,
) -> Result<(Vec<u32>, Vec<PromptImage>), ImageRefusal> {
    expand_inputs(&conv.images, "messages", text, prompt_ids)
}

/// `expand` of images given beside a prompt (the Python package's `multi_modal_data`):
/// `field` is named where the prompt's placeholders and the images do not pair up.
pub fn expand_inputs(
    inputs: &[ImageInput],
    field: &str,
    text: &ModelText,
    prompt_ids: Vec<u32>,
) -> Result<(Vec<u32>, Vec<PromptImage>), ImageRefusal> {
    if inputs.is_empty() {
        return Ok((prompt_ids, Vec::new()));
    }
    let Some(vision) = &text.vision else {
        return Err(ImageRefusal::bad(
            &inputs[0].field,
            "this model takes no images (it is not a vision-language model)",
        ));
    };
    let placeholder = vision.image_token_id;
    let found = prompt_ids.iter().filter(|&&t| t == placeholder).count();
    if found != inputs.len() {
        return Err(ImageRefusal::bad(
            field,
            format!(
                "the prompt has {found} image placeholders for {} images",
                inputs.len()
            ),
        ));
    }
    let mut ids = Vec::with_capacity(prompt_ids.len());
    let mut images = Vec::with_capacity(inputs.len());
    let mut next = inputs.iter();
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
