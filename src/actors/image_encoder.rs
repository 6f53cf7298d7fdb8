//! The encoder actor (vision-language models): each request's images, encoded as it arrives
//! (ahead of its prefill) into the `ImageEncoder` cache the ranks read; a rank that reaches
//! an image first encodes it itself, so the actor only ever moves work earlier.

use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::runner::image_encoder::ImageEncoder;
use crate::step::PromptImage;
use crate::sync::Shared;

pub enum EncoderMsg {
    /// A request's images.
    Encode(Vec<PromptImage>),
}

impl ractor::Message for EncoderMsg {}

pub struct EncoderActor;

impl Actor for EncoderActor {
    type Msg = EncoderMsg;
    type State = Shared<ImageEncoder>;
    type Arguments = Shared<ImageEncoder>;

    async fn pre_start(
        &self,
        _myself: ActorRef<EncoderMsg>,
        encoder: Shared<ImageEncoder>,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(encoder)
    }

    async fn handle(
        &self,
        _myself: ActorRef<EncoderMsg>,
        msg: EncoderMsg,
        encoder: &mut Shared<ImageEncoder>,
    ) -> Result<(), ActorProcessingErr> {
        let EncoderMsg::Encode(images) = msg;
        let encoder = encoder.clone();
        // Seconds of CPU: off the async workers. A failed batch leaves the ranks its images.
        if let Err(e) = tokio::task::spawn_blocking(move || encoder.encode_ahead(&images)).await {
            tracing::warn!("the image encoder failed a batch: {e}");
        }
        Ok(())
    }
}
