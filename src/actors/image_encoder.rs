//! The encoder actor (vision-language models): the images of each request as it arrives,
//! encoded on a blocking thread ahead of the prefill that needs them, one batch a message,
//! into the engine's `ImageEncoder` cache the ranks read. A rank whose step reaches an
//! image first encodes it itself (or waits while this actor finishes it), so the actor
//! only ever moves work earlier.

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
        // Seconds of CPU a batch: off the async workers. A failed batch costs only time:
        // the ranks encode what it left.
        if let Err(e) = tokio::task::spawn_blocking(move || encoder.encode_ahead(&images)).await {
            tracing::warn!("the image encoder failed a batch: {e}");
        }
        Ok(())
    }
}
