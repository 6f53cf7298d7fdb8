//! The protocol layer: one conversation type, a codec per API, the HTTP server.

pub mod anthropic;
pub mod api;
pub mod call_syntax;
pub mod completions;
pub mod conversation;
#[cfg(feature = "deepseek-encoding")]
pub mod deepseek_v4_prompt;
mod fields;
pub mod guard;
pub mod http;
pub mod images;
pub mod jsonl;
pub mod metrics;
pub mod openai;
pub mod output_parser;
mod prompt;
pub mod reply;
pub mod responses;
pub mod serve_options;
pub mod server;
pub mod tokenize;
pub mod trace_context;
