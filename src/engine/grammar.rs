//! Structured output's grammars for the engine handle: one compiler for the model's
//! vocabulary, built on the first request that needs it, and its compiled grammars cached.

use super::EngineHandle;
use crate::api::{EngineError, RequestError};
use crate::structured::{CompiledGrammar, GrammarCompiler, GrammarSpec};
use crate::sync::Shared;

impl EngineHandle {
    /// Compiles `request.grammar` (cached), or says why it cannot be served.
    pub(super) fn compile_grammar(
        &self,
        spec: &GrammarSpec,
    ) -> Result<Shared<CompiledGrammar>, EngineError> {
        let compiler = self.grammars.get_or_init(|| {
            let tok = self
                .text
                .tokenizer
                .clone()
                .ok_or_else(|| crate::structured::StructuredError::NoTokenizer.to_string())?;
            let eos_id = self.text.stop_ids.first().copied().unwrap_or(0);
            GrammarCompiler::new(tok, eos_id)
                .map(Shared::new)
                .map_err(|e| e.to_string())
        });
        let compiler = compiler
            .as_ref()
            .map_err(|e| RequestError::Grammar(e.clone()))?;
        compiler
            .compile(spec)
            .map_err(|e| RequestError::Grammar(e.to_string()).into())
    }
}
