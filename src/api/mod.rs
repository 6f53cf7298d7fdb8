//! The engine's vocabulary, below the actors that produce it and the engine that hands it
//! to callers: requests and their outputs, the streamed text, errors, the engine's status.

mod error;
mod request;
mod request_ids;
mod status;
mod text_stream;

pub use error::{EngineError, RequestError};
pub use request::{
    EngineRequest, FinishReason, ImageLimits, MAX_CHOICES, PromptImage, RequestLimits,
    RequestOutput, choice_seed,
};
pub use request_ids::RequestIds;
pub use status::{EngineStatus, KvStoreStats, MAX_SPEC_POSITIONS};
pub use text_stream::{ChoiceText, IncrementalDecoder, TextStream};
