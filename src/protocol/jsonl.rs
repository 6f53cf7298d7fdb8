//! The offline batch format: one JSON object per line in (`--prompts-file`), one per
//! prompt out (`--json`).

use serde::{Deserialize, Serialize};

use crate::error::{Result, TroupeError};
use crate::structured::GrammarSpec;

/// One line of `--prompts-file`. Fields left out take the command-line values.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromptLine {
    pub prompt: Option<String>,
    pub prompt_ids: Option<Vec<u32>>,
    pub max_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub seed: Option<u64>,
    pub top_logprobs: Option<usize>,
    pub chat: Option<bool>,
    pub system: Option<String>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub min_tokens: Option<usize>,
    pub stop: Option<Vec<String>>,
    pub stop_token_ids: Option<Vec<u32>>,
    /// OpenAI's form: token id (as a string) → bias in [-100, 100].
    pub logit_bias: Option<std::collections::BTreeMap<String, f32>>,
    /// Structured output: the JSON schema, regular expression or Lark grammar the whole
    /// output must match (at most one).
    pub json_schema: Option<serde_json::Value>,
    pub regex: Option<String>,
    pub lark: Option<String>,
    /// The line of the file it was read from (from 1), for errors.
    #[serde(skip)]
    pub line: Option<usize>,
}

impl PromptLine {
    /// How errors name the prompt: its line of `file`, or `the prompt` for one given on
    /// the command line.
    pub fn label(&self, file: Option<&std::path::Path>) -> String {
        match (self.line, file) {
            (Some(n), Some(f)) => format!("{} line {n}", f.display()),
            _ => "the prompt".into(),
        }
    }
}

impl PromptLine {
    /// `logit_bias` with its keys read as token ids.
    pub fn logit_bias_ids(&self) -> Result<Vec<(u32, f32)>> {
        let Some(map) = &self.logit_bias else {
            return Ok(Vec::new());
        };
        map.iter()
            .map(|(k, &v)| {
                k.parse::<u32>().map(|id| (id, v)).map_err(|_| {
                    TroupeError::InvalidSampling(format!("logit_bias key `{k}` is not a token id"))
                })
            })
            .collect()
    }
}

impl PromptLine {
    /// The line's grammar, if it gives one.
    pub fn grammar(&self) -> Result<Option<GrammarSpec>> {
        let given = [
            self.json_schema.clone().map(GrammarSpec::JsonSchema),
            self.regex.clone().map(GrammarSpec::Regex),
            self.lark.clone().map(GrammarSpec::Lark),
        ];
        let mut given = given.into_iter().flatten();
        let first = given.next();
        if given.next().is_some() {
            return Err(TroupeError::InvalidInput(
                "give at most one of `json_schema`, `regex` and `lark`".into(),
            ));
        }
        Ok(first)
    }
}

pub fn parse_prompts_file(text: &str, file_name: &str) -> Result<Vec<PromptLine>> {
    let mut lines = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |reason: String| {
            TroupeError::InvalidInput(format!("{file_name} line {}: {reason}", i + 1))
        };
        let mut p: PromptLine = serde_json::from_str(line).map_err(|e| {
            bad(format!(
                "malformed JSON object: {}",
                crate::protocol::api::json_terms(&e.to_string())
            ))
        })?;
        p.line = Some(i + 1);
        match (&p.prompt, &p.prompt_ids) {
            (Some(_), Some(_)) => {
                return Err(bad("give either `prompt` or `prompt_ids`, not both".into()));
            }
            (None, None) => {
                return Err(bad(
                    "needs `prompt` (text) or `prompt_ids` (token ids)".into()
                ));
            }
            _ => {}
        }
        p.grammar().map_err(|e| bad(e.to_string()))?;
        lines.push(p);
    }
    if lines.is_empty() {
        return Err(TroupeError::InvalidInput(format!(
            "{file_name} holds no prompts"
        )));
    }
    Ok(lines)
}

#[derive(Debug, Serialize)]
pub struct OutputLine<'a> {
    pub prompt_ids: &'a [u32],
    pub token_ids: &'a [u32],
    pub text: String,
    pub finish_reason: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<Vec<Vec<(u32, f32)>>>,
    /// The seed the prompt ran with: pass it back to reproduce the output.
    pub seed: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_parse_and_errors_name_the_line() {
        let ok = parse_prompts_file(
            "{\"prompt\":\"hi\",\"max_tokens\":3}\n\n{\"prompt_ids\":[1,2]}\n",
            "p.jsonl",
        )
        .unwrap();
        assert_eq!(ok.len(), 2);
        assert_eq!(ok[1].prompt_ids.as_deref(), Some(&[1, 2][..]));
        let err = parse_prompts_file("{\"prompt\":\"a\"}\n{oops\n", "p.jsonl")
            .unwrap_err()
            .to_string();
        assert!(err.contains("p.jsonl line 2"), "{err}");
        let err = parse_prompts_file("{\"max_tokens\":3}\n", "p.jsonl")
            .unwrap_err()
            .to_string();
        assert!(err.contains("prompt_ids"), "{err}");
        let err = parse_prompts_file("{\"prompt\":\"a\",\"temprature\":1}\n", "p.jsonl")
            .unwrap_err()
            .to_string();
        assert!(err.contains("temprature"), "{err}");
        let both = "{\"prompt\":\"a\",\"regex\":\"a+\",\"lark\":\"start: \\\"a\\\"\"}\n";
        let err = parse_prompts_file(both, "p.jsonl").unwrap_err().to_string();
        assert!(
            err.contains("at most one") && err.contains("line 1"),
            "{err}"
        );
        let one = parse_prompts_file("{\"prompt\":\"a\",\"regex\":\"a+\"}\n", "p.jsonl").unwrap();
        assert_eq!(
            one[0].grammar().unwrap(),
            Some(GrammarSpec::Regex("a+".into()))
        );
    }
}
