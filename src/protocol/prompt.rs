//! Which renderer turns a conversation into the model's prompt: DeepSeek-V4's own
//! encoding (`deepseek_v4_prompt.rs`) for DeepSeek-V4, the model's chat template
//! (`conversation.rs`) for the others.

use super::conversation::Conversation;
use crate::error::{Result, TroupeError};
use crate::model::ModelText;

impl Conversation {
    /// Prompt token ids for the model, ending with the assistant turn's opening.
    pub fn to_prompt_ids(&self, text: &ModelText) -> Result<Vec<u32>> {
        let tok = text.tokenizer.as_ref().ok_or_else(|| {
            TroupeError::InvalidInput("the model has no tokenizer: use token ids".into())
        })?;
        if text.deepseek_v4.is_some() {
            #[cfg(feature = "deepseek-encoding")]
            return super::deepseek_v4_prompt::prompt_ids(self, tok);
            #[cfg(not(feature = "deepseek-encoding"))]
            return Err(TroupeError::InvalidInput(
                "DeepSeek-V4 chat prompts need troupe built with `--features deepseek-encoding`; \
                 without it, give token ids"
                    .into(),
            ));
        }
        self.template_prompt_ids(tok, text)
    }
}
