//! Why a request is refused at [`Scheduler::add`](super::Scheduler::add). Each variant is
//! final: the request is not queued and not retried.

use super::SeqId;

#[derive(Debug, thiserror::Error)]
pub enum SchedError {
    #[error(
        "request {seq_id} needs {num_blocks_needed} KV blocks for its prompt plus max_tokens, \
         but the pool has only {num_blocks_total}: lower max_tokens or shorten the prompt"
    )]
    NeverFits {
        seq_id: SeqId,
        num_blocks_needed: usize,
        num_blocks_total: usize,
    },
    #[error(
        "request {seq_id} has {num_prompt_tokens} prompt tokens, which leaves no room to \
         generate within the {max_context_tokens}-token context: shorten the prompt"
    )]
    PromptTooLong {
        seq_id: SeqId,
        num_prompt_tokens: usize,
        max_context_tokens: usize,
    },
    #[error("request {seq_id} has an empty prompt: at least one token is needed")]
    EmptyPrompt { seq_id: SeqId },
    #[error("request {seq_id} reuses the id of a request that is still running")]
    DuplicateId { seq_id: SeqId },
    #[error(
        "request {seq_id} needs a per-sequence state slot but the pool has zero: \
         configure num_state_slots > 0"
    )]
    NoStateSlots { seq_id: SeqId },
    #[error("request {seq_id} asks for max_tokens = 0: at least one token must be generated")]
    ZeroMaxTokens { seq_id: SeqId },
}
