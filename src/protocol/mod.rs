//! Request/response types for the CLI's `--json` output; the HTTP server's codecs
//! (OpenAI, Anthropic) join them with the server issue.

pub mod jsonl;
