//! Grammar compilation against the vocabulary, with a bounded cache: a service answering
//! the same schema for every request compiles it once.

use crate::sync::Mutex;
use crate::sync::Shared as Arc;
use std::collections::{HashMap, VecDeque};

use llguidance::toktrie::TokEnv;
use llguidance::{Matcher, ParserFactory, TokenParser};

use super::token_env::{Vocabulary, token_env};
use super::{GrammarSpec, StructuredError};

/// Compiled grammars kept for reuse.
const CACHE_CAPACITY: usize = 128;

/// A grammar ready to start matchers from; cheap to clone into each sequence.
pub struct CompiledGrammar {
    pub(super) parser: TokenParser,
}

impl CompiledGrammar {
    /// Whether `text`, tokenized as plain text, is a whole match of the grammar.
    pub fn accepts(&self, text: &str) -> bool {
        let mut matcher = Matcher::new(Ok(self.parser.clone()));
        let Ok(env) = matcher.tok_env() else {
            return false;
        };
        let tokens = env.tokenize(text);
        matcher.consume_tokens(&tokens).is_ok() && matcher.is_accepting().unwrap_or(false)
    }

    /// Whether the token ids `ids` (special tokens among them) are a whole match.
    pub fn accepts_ids(&self, ids: &[u32]) -> bool {
        let mut matcher = Matcher::new(Ok(self.parser.clone()));
        matcher.consume_tokens(ids).is_ok() && matcher.is_accepting().unwrap_or(false)
    }
}

impl std::fmt::Debug for CompiledGrammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CompiledGrammar")
    }
}

pub struct GrammarCompiler {
    factory: ParserFactory,
    cache: Mutex<Cache>,
}

#[derive(Default)]
struct Cache {
    by_key: HashMap<String, Arc<CompiledGrammar>>,
    /// Keys oldest first, for eviction.
    order: VecDeque<String>,
}

impl GrammarCompiler {
    /// `eos_id`: the token a finished grammar allows (the sampler widens it to every
    /// stop id of the request).
    pub fn new(tokenizer: Arc<dyn Vocabulary>, eos_id: u32) -> Result<Self, StructuredError> {
        let env: TokEnv = token_env(tokenizer, eos_id)?;
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| StructuredError::TokenTable(e.to_string()))?;
        factory.quiet();
        Ok(GrammarCompiler {
            factory,
            cache: Mutex::new(Cache::default()),
        })
    }

    pub fn compile(&self, spec: &GrammarSpec) -> Result<Arc<CompiledGrammar>, StructuredError> {
        let grammar = spec.to_llguidance();
        let key = serde_json::to_string(&grammar).unwrap_or_default();
        if let Some(hit) = self.lock().by_key.get(&key) {
            return Ok(hit.clone());
        }
        // llguidance reports bad grammars as errors; a panic on an odd one must not take
        // the server down either.
        let parser = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.factory.create_parser(grammar)
        }))
        .map_err(|_| StructuredError::Unsupported {
            kind: spec.kind(),
            reason: "the grammar compiler failed on it".into(),
        })?
        .map_err(|e| StructuredError::Unsupported {
            kind: spec.kind(),
            reason: one_line(&e.to_string()),
        })?;
        let compiled = Arc::new(CompiledGrammar { parser });
        let mut cache = self.lock();
        // Another request compiled the same grammar meanwhile: one entry, one grammar.
        if let Some(first) = cache.by_key.get(&key) {
            return Ok(first.clone());
        }
        if cache.order.len() >= CACHE_CAPACITY
            && let Some(old) = cache.order.pop_front()
        {
            cache.by_key.remove(&old);
        }
        cache.order.push_back(key.clone());
        cache.by_key.insert(key, compiled.clone());
        Ok(compiled)
    }

    pub fn num_cached(&self) -> usize {
        self.lock().by_key.len()
    }

    fn lock(&self) -> crate::sync::MutexGuard<'_, Cache> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The compiler's whole message on one line: a regex error's first line is only
/// `regex parse error:`, its reason and position on the lines after it.
fn one_line(s: &str) -> String {
    let joined = s
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    // A bounded message even for a grammar that echoes a long input back.
    match joined.char_indices().nth(600) {
        Some((at, _)) => format!("{}…", &joined[..at]),
        None => joined,
    }
}
