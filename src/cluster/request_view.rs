//! What the router reads of a request before it forwards it unchanged: the prompt's token
//! ids, as the engines' prefix caches hash them, and a chat's images, each body parsed once.

use base64::Engine as _;
use serde_json::Value;

use crate::model::ModelText;
use crate::protocol::anthropic::{MessagesRequest, conversation as anthropic_conversation};
use crate::protocol::conversation::Conversation;
use crate::protocol::openai::{ChatRequest, chat_conversation};

/// One image as the client sent it: its file in base64, its MIME type, and its patches
/// ((width / patch) × (height / patch)), what the encode engines' loads are counted in.
#[derive(Debug, Clone)]
pub struct SentImage {
    pub data: String,
    pub mime: Option<String>,
    pub num_patches: usize,
    /// Its placeholder tokens, about (the processor may resize it).
    pub num_tokens: usize,
}

/// A request as the router reads it.
#[derive(Debug, Default)]
pub struct RequestView {
    /// The prompt's token ids (a chat's with one placeholder per image) where the router
    /// can render them.
    pub prompt: Option<Vec<u32>>,
    /// A chat's images sent as data (the engine fetches those given by URL).
    pub images: Vec<SentImage>,
    /// Whether the chat names images by URL: only the answering engine may fetch them, so
    /// such a request is prefilled where it is answered.
    pub fetches_images: bool,
}

impl RequestView {
    pub fn read(text: &ModelText, path: &str, body: &[u8]) -> RequestView {
        let conversation = match path {
            "/v1/completions" => {
                return RequestView {
                    prompt: completion_prompt(text, body),
                    ..RequestView::default()
                };
            }
            "/v1/chat/completions" => serde_json::from_slice::<ChatRequest>(body)
                .ok()
                .and_then(|r| chat_conversation(&r).ok()),
            "/v1/messages" => serde_json::from_slice::<MessagesRequest>(body)
                .ok()
                .and_then(|r| anthropic_conversation(&r).ok()),
            _ => None,
        };
        let Some(conv) = conversation else {
            return RequestView::default();
        };
        RequestView {
            prompt: conv.to_prompt_ids(text).ok(),
            images: sent_images(text, &conv),
            fetches_images: conv.images.iter().any(|i| i.url.is_some()),
        }
    }

    /// The images as an encode or prefill engine takes them: (base64 file, MIME type).
    pub fn image_files(&self) -> Vec<(String, Option<String>)> {
        let files = self.images.iter();
        files.map(|i| (i.data.clone(), i.mime.clone())).collect()
    }

    pub fn num_patches(&self) -> usize {
        self.images.iter().map(|i| i.num_patches).sum()
    }

    /// The prompt's length with each image widened to its tokens, what a hand-off is
    /// weighed by.
    pub fn num_prompt_tokens(&self) -> Option<usize> {
        let widened = self.images.iter().map(|i| i.num_tokens.saturating_sub(1));
        Some(self.prompt.as_ref()?.len() + widened.sum::<usize>())
    }
}

fn completion_prompt(text: &ModelText, body: &[u8]) -> Option<Vec<u32>> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let prompt = match &v["prompt"] {
        Value::Array(items) if items.first().is_some_and(|x| !x.is_number()) => items[0].clone(),
        other => other.clone(),
    };
    match prompt {
        Value::String(s) => {
            let tok = text.tokenizer.as_ref()?;
            tok.encode_request_prompt(&s, false, true).ok()
        }
        Value::Array(ids) => ids.iter().map(|x| x.as_u64().map(|x| x as u32)).collect(),
        _ => None,
    }
}

fn sent_images(text: &ModelText, conv: &Conversation) -> Vec<SentImage> {
    let Some(vision) = &text.vision else {
        return Vec::new();
    };
    let patch = vision.processor.patch_size.max(1) as u64;
    let merged = (vision.processor.merge_size.max(1) as u64).pow(2);
    let b64 = base64::engine::general_purpose::STANDARD;
    (conv.images.iter())
        .filter(|i| i.url.is_none())
        .map(|i| {
            let (w, h) = image::ImageReader::new(std::io::Cursor::new(&i.bytes))
                .with_guessed_format()
                .ok()
                .and_then(|r| r.into_dimensions().ok())
                .unwrap_or((0, 0));
            let patches = (u64::from(w) / patch) * (u64::from(h) / patch);
            SentImage {
                data: b64.encode(&i.bytes),
                mime: i.mime.clone(),
                num_patches: patches as usize,
                num_tokens: (patches / merged).max(1) as usize,
            }
        })
        .collect()
}
