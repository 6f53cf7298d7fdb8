//! The model's vocabulary as llguidance sees it: every token's bytes in a trie, and the
//! tokenizer for the few strings a grammar needs tokenized.

use crate::sync::Shared as Arc;

use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use super::StructuredError;

/// What a grammar needs of the model's tokenizer (the model layer implements it, so the
/// structured-output core stays below the model).
pub trait Vocabulary: Send + Sync {
    /// The tokenizer in `tokenizer.json` form, where llguidance reads every token's bytes.
    fn tokenizer_json(&self) -> Result<String, String>;
    /// Ids of plain text (special tokens not recognised).
    fn encode_plain_text(&self, text: &str) -> Result<Vec<u32>, String>;
    fn vocab_size(&self) -> usize;
}

struct TroupeTokEnv {
    tokenizer: Arc<dyn Vocabulary>,
    trie: TokTrie,
}

impl TokenizerEnv for TroupeTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        // Grammar literals are text; request text never reaches here as special tokens.
        self.tokenizer
            .encode_plain_text(&String::from_utf8_lossy(s))
            .unwrap_or_default()
    }
}

/// The token environment for `tokenizer`; `eos_id` is the token that ends a grammar.
pub fn token_env(tokenizer: Arc<dyn Vocabulary>, eos_id: u32) -> Result<TokEnv, StructuredError> {
    let json = tokenizer
        .tokenizer_json()
        .map_err(StructuredError::TokenTable)?;
    let value: serde_json::Value =
        serde_json::from_str(&json).map_err(|e| StructuredError::TokenTable(e.to_string()))?;
    // llguidance asserts on odd vocabularies; a panic here must become an error.
    let words = std::panic::catch_unwind(|| llguidance::token_bytes_from_tokenizer_json(&value))
        .map_err(|_| {
            StructuredError::TokenTable("the vocabulary has malformed byte tokens".into())
        })?
        .map_err(|e| StructuredError::TokenTable(e.to_string()))?;
    let mut words = words;
    words.resize(tokenizer.vocab_size().max(words.len()), Vec::new());
    let info = TokRxInfo::new(words.len() as u32, eos_id);
    let trie = TokTrie::from(&info, &words);
    Ok(Arc::new(TroupeTokEnv { tokenizer, trie }))
}
