//! Images between engines (E/P/D, issue 64): the router asks an encode engine to encode a
//! request's images (`EncodeAsk`, the image files as the client sent them); the encode
//! engine makes the patches as every engine of the model makes them, encodes them and
//! sends each image's rows, keyed by the image's content hash, to the engines that will
//! prefill the request (`AgentMsg::PutImageRows`), before the router forwards it there.
//! An engine that gets no rows (an encode engine gone, rows past a frame) encodes the image
//! itself: the split only ever moves work.

use base64::Engine as _;
use serde::{Deserialize, Serialize};

use super::kv_transfer::MAX_BLOCK_BYTES;
use crate::api::PromptImage;
use crate::engine::{EngineHandle, ImageEngine};
use crate::model::vision::{DecodeLimits, RgbImage};
use crate::protocol::conversation::ImageInput;
use crate::protocol::images::expand_inputs;

/// Where an encode engine sends an image's rows: a peer engine, over the cluster's
/// transport (the agent's `PutImageRows`).
pub trait RowsPeer {
    /// Once the peer keeps the rows (`encode_rows`' payload).
    fn put(&self, payload: Vec<u8>)
    -> impl std::future::Future<Output = Result<(), String>> + Send;
}

/// The router's ask to an encode engine (JSON over the cluster transport).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EncodeAsk {
    /// Each image's file, base64, and the MIME type it was declared with.
    pub images: Vec<(String, Option<String>)>,
    /// The engines whose prefills read the rows, by node name.
    pub deliver_to: Vec<String>,
}

/// What the encode engine answers: images encoded and patches run, or why not.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct EncodeDone {
    pub num_images: usize,
    pub num_patches: usize,
    pub error: Option<String>,
}

/// One image's rows as a `PutImageRows` payload: its hash, then the rows (f32, LE).
pub fn encode_rows(hash: u64, rows: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + rows.len() * 4);
    out.extend_from_slice(&hash.to_le_bytes());
    out.extend_from_slice(bytemuck::cast_slice(rows));
    out
}

pub fn decode_rows(bytes: &[u8]) -> Result<(u64, Vec<f32>), String> {
    if bytes.len() < 8 || !(bytes.len() - 8).is_multiple_of(4) {
        return Err(format!("image rows of {} bytes are malformed", bytes.len()));
    }
    let hash = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    let rows = bytes[8..]
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
        .collect();
    Ok((hash, rows))
}

/// A prefill ask's prompt (one placeholder per image) widened to its images' tokens, and
/// the images, made as the engine's own chat route makes them.
pub async fn prompt_with_images(
    engine: &EngineHandle,
    prompt_ids: Vec<u32>,
    files: &[(String, Option<String>)],
) -> Result<(Vec<u32>, Vec<PromptImage>), String> {
    if files.is_empty() {
        return Ok((prompt_ids, Vec::new()));
    }
    let b64 = base64::engine::general_purpose::STANDARD;
    let inputs = (files.iter().enumerate())
        .map(|(i, (data, mime))| {
            Ok(ImageInput {
                bytes: (b64.decode(data)).map_err(|e| format!("image {i}: invalid base64: {e}"))?,
                url: None,
                mime: mime.clone(),
                field: format!("images[{i}]"),
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    let text = engine.text_shared();
    // Decoding and resampling take milliseconds of CPU: off the async workers.
    tokio::task::spawn_blocking(move || {
        expand_inputs(&inputs, "prompt_ids", &text, prompt_ids)
            .map_err(|r| format!("{}: {}", r.field, r.message))
    })
    .await
    .map_err(|e| e.to_string())?
}

/// The encode engine's side of `ask`: its images encoded as one batch, each one's rows
/// sent to `peers` (the engines `ask.deliver_to` names).
pub async fn encode_for_peers(
    images: &ImageEngine,
    ask: &EncodeAsk,
    peers: &[impl RowsPeer],
) -> EncodeDone {
    let mut done = EncodeDone {
        num_images: 0,
        num_patches: 0,
        error: None,
    };
    if let Err(e) = encode_each(images, ask, peers, &mut done).await {
        done.error = Some(e);
    }
    done
}

async fn encode_each(
    engine: &ImageEngine,
    ask: &EncodeAsk,
    peers: &[impl RowsPeer],
    done: &mut EncodeDone,
) -> Result<(), String> {
    let processor = engine.vision().processor.clone();
    let files = ask.images.clone();
    // Decoding and resampling take milliseconds of CPU: off the async workers.
    let images = tokio::task::spawn_blocking(move || {
        let b64 = base64::engine::general_purpose::STANDARD;
        (files.iter().enumerate())
            .map(|(i, (data, mime))| {
                let bytes =
                    (b64.decode(data)).map_err(|e| format!("image {i}: invalid base64: {e}"))?;
                let image = RgbImage::decode(&bytes, mime.as_deref(), DecodeLimits::default())
                    .map_err(|e| format!("image {i}: {e}"))?;
                let patches = processor
                    .patches(&image)
                    .map_err(|e| format!("image {i}: {e}"))?;
                Ok(PromptImage::new(
                    0,
                    patches.grid,
                    patches.merge_size,
                    patches.values,
                ))
            })
            .collect::<Result<Vec<_>, String>>()
    })
    .await
    .map_err(|e| e.to_string())??;
    let rows = engine.rows(images.clone()).await?;
    for (image, rows) in images.iter().zip(rows) {
        let payload = encode_rows(image.hash, &rows);
        if payload.len() > MAX_BLOCK_BYTES {
            // Past a frame of the transport: the peers encode this one themselves.
            continue;
        }
        for peer in peers {
            peer.put(payload.clone()).await?;
        }
        done.num_images += 1;
        done.num_patches += image.grid.iter().product::<usize>();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_round_trip_and_malformed_payloads_are_refused() {
        let rows: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 2.0).collect();
        let bytes = encode_rows(0xdead_beef_0123, &rows);
        assert_eq!(decode_rows(&bytes), Ok((0xdead_beef_0123, rows)));
        for bad in [&bytes[..7], &bytes[..bytes.len() - 1]] {
            assert!(decode_rows(bad).is_err());
        }
    }
}
