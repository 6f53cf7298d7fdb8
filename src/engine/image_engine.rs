//! The vision side of an engine: a vision-language model's encoder (`ImageEncoder`, its
//! rows cached by image hash) and the actor that encodes requests' images ahead of their
//! prefills. Every engine of such a model has one; an encode engine (`serve --role
//! encode`, E/P/D) runs one alone, with the vision tower's weights and none of the
//! language model's.

use std::path::Path;

use ractor::{Actor, ActorRef};

use super::{Device, EngineError, EngineStatus};
use crate::actors::image_encoder::{EncoderActor, EncoderMsg};
use crate::api::PromptImage;
use crate::model::vision::VisionText;
use crate::runner::image_encoder::{EncoderStats, ImageEncoder};
use crate::sync::Shared;

#[derive(Clone)]
pub struct ImageEngine {
    vision: Shared<VisionText>,
    encoder: Shared<ImageEncoder>,
    ahead: ActorRef<EncoderMsg>,
}

impl ImageEngine {
    /// The encoder of the model at `path` alone, on `device`: its config, its image
    /// processor's and the vision tower's weights are read, nothing of the language model.
    pub async fn load(path: &Path, device: Device) -> Result<ImageEngine, EngineError> {
        let spawn = |what: String| EngineError::Spawn(format!("{what} ({})", path.display()));
        let config = path.join("config.json");
        let not_vision =
            || spawn("the model takes no images (it is not a vision-language model)".into());
        if !config.is_file() {
            return Err(not_vision());
        }
        let text = std::fs::read_to_string(&config)
            .map_err(|e| spawn(format!("cannot read config.json: {e}")))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| spawn(format!("config.json: {e}")))?;
        let vision = VisionText::from_hf_dir(path, &json)
            .map_err(|e| spawn(e.to_string()))?
            .ok_or_else(not_vision)?;
        let owned = path.to_path_buf();
        // Seconds of reading and uploading weights: off the async workers.
        let encoder = tokio::task::spawn_blocking(move || ImageEncoder::load(&owned, device))
            .await
            .map_err(|e| spawn(format!("loading the encoder: {e}")))?
            .map_err(|e| spawn(e.to_string()))?
            .ok_or_else(|| spawn("no vision encoder weights".into()))?;
        ImageEngine::start(Shared::new(vision), Shared::new(encoder)).await
    }

    /// `encoder` with its actor started.
    pub(super) async fn start(
        vision: Shared<VisionText>,
        encoder: Shared<ImageEncoder>,
    ) -> Result<ImageEngine, EngineError> {
        let (ahead, _) = Actor::spawn(None, EncoderActor, encoder.clone())
            .await
            .map_err(|e| EngineError::Spawn(format!("the image encoder's actor: {e}")))?;
        Ok(ImageEngine {
            vision,
            encoder,
            ahead,
        })
    }

    /// The model's image processing (how files become patches) and image token.
    pub fn vision(&self) -> &VisionText {
        &self.vision
    }

    /// `images` encoded by the actor as one batch, ahead of whoever reads their rows.
    pub fn encode_ahead(&self, images: Vec<PromptImage>) {
        if !images.is_empty() {
            let _ = self.ahead.cast(EncoderMsg::Encode(images));
        }
    }

    /// Each image's rows: cached, encoded as one batch, or waited for while another
    /// encodes them.
    pub async fn rows(&self, images: Vec<PromptImage>) -> Result<Vec<Shared<Vec<f32>>>, String> {
        let encoder = self.encoder.clone();
        tokio::task::spawn_blocking(move || {
            encoder.encode_ahead(&images);
            images.iter().map(|i| encoder.rows(i)).collect()
        })
        .await
        .map_err(|e| format!("the image encoder failed: {e}"))
    }

    /// Keeps the rows of image `hash` a peer encoded, for this engine's prefills.
    pub fn put_rows(&self, hash: u64, rows: Vec<f32>) -> Result<(), String> {
        self.encoder.insert(hash, rows)
    }

    pub fn stats(&self) -> EncoderStats {
        self.encoder.stats()
    }

    /// An encode engine's status: its encoder's counts, and no language model's.
    pub fn status(&self) -> EngineStatus {
        let stats = self.stats();
        EngineStatus {
            num_encoded_images: stats.num_encoded,
            num_image_cache_hits: stats.num_hits,
            num_received_images: stats.num_received,
            ..EngineStatus::default()
        }
    }

    /// Stops the actor (images it was given are left to whoever reads them).
    pub async fn stop(&self) {
        let _ = self.ahead.stop_and_wait(None, None).await;
    }
}
