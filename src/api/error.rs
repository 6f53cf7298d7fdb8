//! `EngineError`: why the engine refused or could not serve a request.

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("request rejected: {0}")]
    Rejected(String),
    #[error("engine unavailable: {0}")]
    Unavailable(String),
    #[error("engine failed to start: {0}")]
    Spawn(String),
    #[error(transparent)]
    Model(#[from] crate::error::TroupeError),
}
