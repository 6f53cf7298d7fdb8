//! `--api-key`, as `serve` and `router` both take it: one definition, one check.

use crate::error::{Result, TroupeError};

#[derive(clap::Args, Debug, Clone, Default)]
pub struct ApiKeys {
    /// A key clients must send, as `Authorization: Bearer KEY` or `x-api-key: KEY`, on
    /// every route but `/health` (behind a router, the engines check it again); repeat it
    /// (or separate with commas) for several.
    #[arg(
        long = "api-key",
        env = "TROUPE_API_KEY",
        hide_env_values = true,
        value_delimiter = ','
    )]
    api_keys: Vec<String>,
}

impl ApiKeys {
    /// The keys, each refused by name when it is empty or padded with whitespace (a key
    /// pasted with its newline would never match what a client sends).
    pub fn checked(&self) -> Result<Vec<String>> {
        if let Some(bad) = self
            .api_keys
            .iter()
            .find(|k| k.trim().is_empty() || k.trim() != k.as_str())
        {
            return Err(TroupeError::InvalidInput(format!(
                "--api-key: a key may not be empty or start or end with whitespace (got {} characters)",
                bad.len()
            )));
        }
        Ok(self.api_keys.clone())
    }
}
