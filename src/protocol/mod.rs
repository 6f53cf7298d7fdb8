//! The protocol layer: one conversation type inside, and a codec per API around it
//! (`--prompts-file` JSONL for the CLI; OpenAI Chat Completions and Completions over HTTP).

pub mod conversation;
pub mod jsonl;
pub mod metrics;
pub mod openai;
pub mod server;
