//! DeepSeek-V4 chat prompts, rendered and tokenized by `deepseek-recipe-encoding` exactly as
//! DeepSeek's own API renders them: the model's special tokens (`<｜User｜>`,
//! `<｜Assistant｜>`, the thinking markers), tools as DSML definitions in the system turn,
//! earlier tool calls as DSML blocks. Request text is plain text to the encoding: a special
//! token's spelling typed by a user encodes as its characters, never as the control token.
//!
//! Thinking mode is off unless the request asks for a reasoning effort (DeepSeek's API
//! thinks only when asked); a named tool choice keeps that tool alone and requires a call.

use deepseek_recipe_core::conversation::{
    Conversation as DsConversation, ReasoningEffort, ResponseFormat,
};
use deepseek_recipe_core::messages::{InputMessage, ToolCall as DsToolCall};
use deepseek_recipe_core::prompt::Prompt;
use deepseek_recipe_core::tools::{ToolChoice as DsToolChoice, ToolDefinition};
use deepseek_recipe_encoding::dsv4::DeepseekV4Encoding;
use deepseek_recipe_encoding::{PromptEncoding, PromptTokenizer};

use super::conversation::{Conversation, Role, ToolChoice};
use crate::error::{Result, TroupeError};
use crate::model::tokenizer::Tokenizer;

/// Prompt token ids for `conv`, ending with the opening of the assistant's turn.
pub fn prompt_ids(conv: &Conversation, tok: &Tokenizer) -> Result<Vec<u32>> {
    let encoding = DeepseekV4Encoding::new().with_tokenizer(PromptTokenizer::new(tok.hf()));
    encoding
        .encode(&to_deepseek(conv)?)
        .map_err(|e| TroupeError::InvalidInput(format!("DeepSeek-V4 prompt encoding: {e}")))
}

/// The prompt as text, special tokens spelled out (for tests and `--print-prompt`-style
/// inspection).
pub fn render(conv: &Conversation) -> Result<String> {
    Ok(DeepseekV4Encoding::new()
        .render_conversation(&to_deepseek(conv)?)
        .prompt)
}

fn reasoning_effort(effort: &str) -> Result<ReasoningEffort> {
    Ok(match effort {
        "minimal" | "low" => ReasoningEffort::Low,
        "medium" | "high" => ReasoningEffort::High,
        "xhigh" => ReasoningEffort::Xhigh,
        "max" => ReasoningEffort::Max,
        other => {
            return Err(TroupeError::InvalidInput(format!(
                "reasoning_effort {other:?} is not one of minimal, low, medium, high, xhigh, max"
            )));
        }
    })
}

fn to_deepseek(conv: &Conversation) -> Result<DsConversation> {
    let messages = conv
        .messages
        .iter()
        .map(|m| match m.role {
            Role::System => InputMessage::System {
                content: Prompt::plain(m.content.as_str()),
                image_sources: Vec::new(),
                tools: None,
            },
            Role::User => InputMessage::User {
                content: Prompt::plain(m.content.as_str()),
                image_sources: Vec::new(),
            },
            Role::Assistant => InputMessage::Assistant {
                content: m.content.clone(),
                reasoning_content: None,
                tool_calls: (!m.tool_calls.is_empty()).then(|| {
                    m.tool_calls
                        .iter()
                        .map(|c| DsToolCall {
                            id: c.id.clone(),
                            name: c.name.clone(),
                            arguments: c.arguments.clone(),
                        })
                        .collect()
                }),
                prefix: false,
            },
            Role::Tool => InputMessage::Tool {
                content: Prompt::plain(m.content.as_str()),
                image_sources: Vec::new(),
                tool_call_id: m.tool_call_id.clone(),
            },
        })
        .collect();
    let named = match &conv.tool_choice {
        ToolChoice::Named(name) => Some(name.as_str()),
        _ => None,
    };
    let tools = conv
        .tools
        .iter()
        .filter(|t| named.is_none_or(|n| n == t.name))
        .map(|t| ToolDefinition {
            name: t.name.clone(),
            description: Some(t.description.clone()).filter(|d| !d.is_empty()),
            parameters: t.parameters.clone(),
            strict: Some(t.strict),
            defer_loading: false,
        })
        .collect();
    let tool_choice = match conv.tool_choice {
        ToolChoice::None => DsToolChoice::None,
        ToolChoice::Auto => DsToolChoice::Auto,
        ToolChoice::Required | ToolChoice::Named(_) => DsToolChoice::Required,
    };
    Ok(DsConversation {
        messages,
        thinking_mode: conv.reasoning_effort.is_some(),
        tools,
        tool_choice,
        reasoning_effort: conv
            .reasoning_effort
            .as_deref()
            .map(reasoning_effort)
            .transpose()?,
        response_format: ResponseFormat::Text,
    })
}
