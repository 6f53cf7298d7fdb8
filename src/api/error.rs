//! `EngineError`: why the engine refused or could not serve a request.

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("request rejected: {0}")]
    Rejected(String),
    #[error("engine unavailable: {0}")]
    Unavailable(String),
    /// An actor did not answer a call in time: a hung actor is an error, not a hang.
    #[error("engine unavailable: the {actor} did not answer within {waited_ms} ms")]
    Unresponsive { actor: &'static str, waited_ms: u64 },
    #[error("engine failed to start: {0}")]
    Spawn(String),
    #[error(transparent)]
    Model(#[from] crate::error::TroupeError),
}
