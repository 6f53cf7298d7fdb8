//! Text ⇄ token ids, built on the `tokenizers` crate: loaded from `tokenizer.json`, or
//! assembled from GGUF metadata (gpt2 byte-level BPE with llama.cpp's `pre` regex
//! variants; llama SentencePiece-style BPE with scores and byte fallback).

use std::collections::HashSet;
use std::path::Path;

use tokenizers::decoders::DecoderWrapper;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::normalizers::prepend::Prepend;
use tokenizers::normalizers::replace::Replace;
use tokenizers::normalizers::{NormalizerWrapper, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use super::gguf::{GgufFile, MetaValue};
use crate::error::{Result, TroupeError};

const GPT2_REGEX: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GGUF `token_type` values (llama.cpp `llama_token_type`).
const TOKEN_TYPE_UNKNOWN: i64 = 2;
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The same tokenizer with special-token strings read as plain text.
    plain: tokenizers::Tokenizer,
    pub bos_id: Option<u32>,
    pub add_bos: bool,
    /// Ids that end generation: EOS and the chat template's end-of-turn tokens.
    pub stop_ids: Vec<u32>,
}

fn tok_err(e: impl std::fmt::Display) -> TroupeError {
    TroupeError::Tokenizer(e.to_string())
}

/// Tokens that close a turn in the chat formats we know; added to the stop set when the
/// vocabulary has them, as llama.cpp and transformers' generation configs do.
const END_OF_TURN_TOKENS: &[&str] = &[
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
];

impl Tokenizer {
    /// The underlying HF tokenizer (special tokens on), for encoders that drive it.
    #[cfg(feature = "deepseek-encoding")]
    pub fn hf(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    pub fn from_hf_dir(
        dir: &Path,
        bos: Option<&str>,
        add_bos: bool,
        eos_ids: Vec<u32>,
    ) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        // The tokenizers crate panics on some malformed files (a nesting past serde's
        // recursion limit in a decoder): an untrusted file's panic is its error.
        let read = std::panic::catch_unwind(|| tokenizers::Tokenizer::from_file(&path));
        let inner = read
            .map_err(|p| {
                let why = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                TroupeError::Tokenizer(format!("{}: malformed: {why}", path.display()))
            })?
            .map_err(|e| TroupeError::Tokenizer(format!("{}: {e}", path.display())))?;
        let bos_id = bos.and_then(|b| inner.token_to_id(b));
        Ok(Self::finish(inner, bos_id, add_bos, eos_ids))
    }

    fn finish(
        inner: tokenizers::Tokenizer,
        bos_id: Option<u32>,
        add_bos: bool,
        mut stop_ids: Vec<u32>,
    ) -> Self {
        for t in END_OF_TURN_TOKENS {
            if let Some(id) = inner.token_to_id(t)
                && !stop_ids.contains(&id)
            {
                stop_ids.push(id);
            }
        }
        let mut plain = inner.clone();
        plain.set_encode_special_tokens(true);
        Tokenizer {
            inner,
            plain,
            bos_id,
            add_bos: add_bos && bos_id.is_some(),
            stop_ids,
        }
    }

    pub fn from_gguf(gguf: &GgufFile) -> Result<Self> {
        let model = gguf.meta_str("tokenizer.ggml.model").ok_or_else(|| {
            tok_err("GGUF has no `tokenizer.ggml.model`; pass --prompt-ids instead")
        })?;
        let tokens: Vec<String> = string_array(gguf, "tokenizer.ggml.tokens")?;
        let token_types: Vec<i64> = match gguf
            .meta("tokenizer.ggml.token_type")
            .and_then(MetaValue::as_array)
        {
            Some(a) => a
                .iter()
                .map(|v| v.as_u64().map(|x| x as i64).unwrap_or(1))
                .collect(),
            None => vec![1; tokens.len()],
        };
        let id_of = |key: &str| gguf.meta_u64(key).map(|v| v as u32);
        let bos_id = id_of("tokenizer.ggml.bos_token_id");
        let eos_id = id_of("tokenizer.ggml.eos_token_id");
        let eot_id = id_of("tokenizer.ggml.eot_token_id");
        let (inner, default_add_bos) = match model {
            "gpt2" => (gpt2_tokenizer(gguf, &tokens)?, false),
            "llama" => (spm_tokenizer(gguf, &tokens, &token_types)?, true),
            other => {
                return Err(tok_err(format!(
                    "unsupported GGUF tokenizer model `{other}` (supported: gpt2, llama)"
                )));
            }
        };
        let mut inner = inner;
        let specials: Vec<AddedToken> = tokens
            .iter()
            .zip(&token_types)
            .filter(|&(_, &ty)| ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED)
            .map(|(t, &ty)| AddedToken::from(t.clone(), ty == TOKEN_TYPE_CONTROL))
            .collect();
        inner.add_special_tokens(specials).map_err(tok_err)?;
        let add_bos = gguf
            .meta("tokenizer.ggml.add_bos_token")
            .and_then(MetaValue::as_bool)
            .unwrap_or(default_add_bos);
        let stop_ids = eos_id.into_iter().chain(eot_id).collect();
        Ok(Self::finish(inner, bos_id, add_bos, stop_ids))
    }

    /// Encodes text; special-token strings in it become their special ids.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode_fast(text, false).map_err(tok_err)?;
        Ok(enc.get_ids().to_vec())
    }

    /// Encodes text with special-token strings read as the characters they are: what
    /// untrusted text (a user's message) must go through.
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.plain.encode_fast(text, false).map_err(tok_err)?;
        Ok(enc.get_ids().to_vec())
    }

    /// Encodes a prompt: BOS first when the model wants one and the text lacks it.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = self.encode(text)?;
        if let (true, Some(bos)) = (self.add_bos, self.bos_id)
            && ids.first() != Some(&bos)
        {
            ids.insert(0, bos);
        }
        Ok(ids)
    }

    /// Encodes a request's text prompt: control-token strings are text unless
    /// `parse_special_tokens`, and BOS goes first when the model wants one and
    /// `add_special_tokens`.
    pub fn encode_request_prompt(
        &self,
        text: &str,
        parse_special_tokens: bool,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>> {
        let mut ids = if parse_special_tokens {
            self.encode(text)?
        } else {
            self.encode_plain(text)?
        };
        if let (true, true, Some(bos)) = (add_special_tokens, self.add_bos, self.bos_id)
            && ids.first() != Some(&bos)
        {
            ids.insert(0, bos);
        }
        Ok(ids)
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner.decode(ids, skip_special_tokens).map_err(tok_err)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The special (control) tokens' strings, longest first.
    pub fn special_tokens(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .inner
            .get_added_tokens_decoder()
            .values()
            .filter(|t| t.special && !t.content.is_empty())
            .map(|t| t.content.clone())
            .collect();
        v.sort_by(|a, b| b.len().cmp(&a.len()).then(a.cmp(b)));
        v.dedup();
        v
    }

    /// The tokenizer in `tokenizer.json` form (also for GGUF-built ones).
    pub fn to_json(&self) -> Result<String> {
        self.inner.to_string(false).map_err(tok_err)
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

fn string_array(gguf: &GgufFile, key: &str) -> Result<Vec<String>> {
    let arr = gguf
        .meta(key)
        .and_then(MetaValue::as_array)
        .ok_or_else(|| tok_err(format!("GGUF metadata `{key}` is missing")))?;
    arr.iter()
        .map(|v| {
            v.as_str()
                .map(str::to_string)
                .ok_or_else(|| tok_err(format!("`{key}` holds a non-string")))
        })
        .collect()
}

fn split(regex: &str) -> Result<PreTokenizerWrapper> {
    let s = Split::new(
        SplitPattern::Regex(regex.into()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(tok_err)?;
    Ok(s.into())
}

/// Byte-level BPE as GPT-2 has it; the split regex depends on `tokenizer.ggml.pre`, as in
/// llama.cpp's `llama_vocab::load`.
fn gpt2_tokenizer(gguf: &GgufFile, tokens: &[String]) -> Result<tokenizers::Tokenizer> {
    let merges: Vec<(String, String)> = string_array(gguf, "tokenizer.ggml.merges")?
        .into_iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| tok_err(format!("malformed merge `{m}`")))
        })
        .collect::<Result<_>>()?;
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(tok_err)?;
    let byte_level = ByteLevel::new(false, false, false);
    let pre = gguf.meta_str("tokenizer.ggml.pre").unwrap_or("default");
    let pre_tokenizer: PreTokenizerWrapper = match pre {
        "llama-bpe" | "llama3" | "falcon3" | "pixtral" | "dbrx" | "smaug-bpe" => {
            PreSequence::new(vec![split(LLAMA3_REGEX)?, byte_level.into()]).into()
        }
        "qwen2" | "deepseek-r1-qwen" | "qwen35" => {
            PreSequence::new(vec![split(QWEN2_REGEX)?, byte_level.into()]).into()
        }
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => {
            PreSequence::new(vec![
                Digits::new(true).into(),
                split(GPT2_REGEX)?,
                byte_level.into(),
            ])
            .into()
        }
        "default" | "gpt2" | "gpt-2" | "mpt" | "olmo" | "jais" | "phi-2" => {
            PreSequence::new(vec![split(GPT2_REGEX)?, byte_level.into()]).into()
        }
        other => {
            return Err(tok_err(format!(
                "unsupported `tokenizer.ggml.pre` variant `{other}`"
            )));
        }
    };
    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(pre_tokenizer));
    tok.with_decoder(Some(ByteLevelDecoder::default()));
    Ok(tok)
}

/// SentencePiece BPE: a merge's priority is the score of the piece it produces, which is
/// how SentencePiece itself picks the next pair.
fn spm_tokenizer(
    gguf: &GgufFile,
    tokens: &[String],
    token_types: &[i64],
) -> Result<tokenizers::Tokenizer> {
    let scores: Vec<f32> = match gguf
        .meta("tokenizer.ggml.scores")
        .and_then(MetaValue::as_array)
    {
        Some(a) => a.iter().map(|v| v.as_f64().unwrap_or(0.0) as f32).collect(),
        None => vec![0.0; tokens.len()],
    };
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let mergeable: HashSet<&str> = tokens
        .iter()
        .zip(token_types)
        .filter(|&(_, &ty)| ty == 1 || ty == TOKEN_TYPE_USER_DEFINED)
        .map(|(t, _)| t.as_str())
        .collect();
    let mut merges: Vec<(f32, u32, u32, String, String)> = Vec::new();
    for (id, piece) in tokens.iter().enumerate() {
        if !mergeable.contains(piece.as_str()) || piece.chars().count() < 2 {
            continue;
        }
        for (split_at, _) in piece.char_indices().skip(1) {
            let (l, r) = piece.split_at(split_at);
            if let (Some(&lid), Some(&rid)) = (vocab.get(l), vocab.get(r))
                && mergeable.contains(l)
                && mergeable.contains(r)
            {
                merges.push((scores[id], lid, rid, l.to_string(), r.to_string()));
            }
        }
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let merges: Vec<(String, String)> = merges.into_iter().map(|m| (m.3, m.4)).collect();
    let unk = token_types
        .iter()
        .position(|&t| t == TOKEN_TYPE_UNKNOWN)
        .map(|i| tokens[i].clone())
        .unwrap_or_else(|| "<unk>".into());
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .unk_token(unk)
        .fuse_unk(true)
        .byte_fallback(true)
        .build()
        .map_err(tok_err)?;
    let add_space_prefix = gguf
        .meta("tokenizer.ggml.add_space_prefix")
        .and_then(MetaValue::as_bool)
        .unwrap_or(true);
    // SentencePiece prefixes a space unconditionally, even before a leading space;
    // Metaspace's own prepend skips such text, so the prefix is a normalizer here.
    let mut normalizers: Vec<NormalizerWrapper> = Vec::new();
    if add_space_prefix {
        normalizers.push(Prepend::new("▁".into()).into());
    }
    normalizers.push(Replace::new(" ", "▁").map_err(tok_err)?.into());
    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_normalizer(Some(NormalizerSequence::new(normalizers)))
        .map_err(tok_err)?;
    // A word is a run of `▁` and the text after it: SentencePiece keeps whitespace runs
    // with the following word (`▁▁b`), and no piece crosses from text into `▁`.
    tok.with_pre_tokenizer(Some(split("▁*[^▁]+|▁+")?));
    let mut decoders: Vec<DecoderWrapper> = vec![
        Replace::new("▁", " ").map_err(tok_err)?.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if add_space_prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    tok.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(tok)
}

impl crate::structured::Vocabulary for Tokenizer {
    fn tokenizer_json(&self) -> std::result::Result<String, String> {
        self.to_json().map_err(|e| e.to_string())
    }

    fn encode_plain_text(&self, text: &str) -> std::result::Result<Vec<u32>, String> {
        self.encode_plain(text).map_err(|e| e.to_string())
    }

    fn vocab_size(&self) -> usize {
        Tokenizer::vocab_size(self)
    }
}
