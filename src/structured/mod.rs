//! Structured output: grammars (JSON schema, regex, Lark) compiled by llguidance against
//! the model's vocabulary, and per-sequence constraints whose token masks the sampler
//! applies — the host's, or the device's as bits (`SeqConstraint::allowed_bits`). Masks for
//! step N+1 are computed while step N+1's forward pass runs (on a worker pool after the
//! host's sampler, or side by side on the rank after the pass is launched), so the
//! scheduler's critical path never waits on a grammar.

mod compiler;
mod constraint;
mod strict;
mod token_env;

pub use compiler::{CompiledGrammar, GrammarCompiler};
pub use constraint::{SeqConstraint, allows, mask_with_bits};
pub use strict::strict_objects;
pub use token_env::Vocabulary;

/// The message a caught panic carried (`panic!` with a literal or a formatted string).
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// `work`'s result, or the message of its panic: user grammars drive llguidance, and a
/// panic there must end one request, not the process or the thread it ran on.
pub(crate) fn unless_panic<T>(work: impl FnOnce() -> T) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(work))
        .map_err(|p| panic_message(p.as_ref()))
}

/// What a request's output must match.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// Any JSON object.
    JsonObject,
    /// A JSON schema (strict: unknown keywords are an error, not ignored, and an object
    /// that names its properties gets no others unless it allows them: `strict_objects`).
    JsonSchema(serde_json::Value),
    /// A regular expression (Rust `regex` syntax) the whole output must match.
    Regex(String),
    /// A grammar in llguidance's Lark dialect.
    Lark(String),
}

#[derive(Debug, thiserror::Error)]
pub enum StructuredError {
    #[error("structured output needs a tokenizer; this model has none")]
    NoTokenizer,
    #[error("cannot build the token table for structured output: {0}")]
    TokenTable(String),
    #[error("unsupported {kind}: {reason}")]
    Unsupported { kind: &'static str, reason: String },
}

impl GrammarSpec {
    pub fn kind(&self) -> &'static str {
        match self {
            GrammarSpec::JsonObject | GrammarSpec::JsonSchema(_) => "JSON schema",
            GrammarSpec::Regex(_) => "regex",
            GrammarSpec::Lark(_) => "grammar",
        }
    }

    /// The llguidance grammar. JSON is compact (no free whitespace between tokens): small
    /// models otherwise wander off into endless newlines inside an object.
    fn to_llguidance(&self) -> llguidance::api::TopLevelGrammar {
        use llguidance::api::TopLevelGrammar;
        match self {
            GrammarSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"})))
            }
            GrammarSpec::JsonSchema(schema) => {
                TopLevelGrammar::from_json_schema(compact(strict_objects(schema)))
            }
            GrammarSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            GrammarSpec::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        }
    }
}

fn compact(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(obj) = schema.as_object_mut()
        && !obj.contains_key("x-guidance")
    {
        obj.insert(
            "x-guidance".into(),
            serde_json::json!({"whitespace_flexible": false}),
        );
    }
    schema
}

/// Lark for a JSON value matching `schema` (its objects closed as `strict_objects` says),
/// for embedding in larger grammars.
pub fn lark_json(schema: &serde_json::Value) -> String {
    format!("%json {}", compact(strict_objects(schema)))
}

#[cfg(test)]
mod panic_tests {
    #[test]
    fn a_panic_becomes_its_message_and_a_result_passes_through() {
        assert_eq!(super::unless_panic(|| 3), Ok(3));
        let n = 7;
        let caught = super::unless_panic(|| -> u32 { panic!("matcher broke at {n}") });
        assert_eq!(caught, Err("matcher broke at 7".to_string()));
        assert_eq!(
            super::unless_panic(|| -> u32 { panic!("plain") }),
            Err("plain".to_string())
        );
    }
}
