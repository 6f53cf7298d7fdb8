//! Incremental output text: what of a request's decoded text may be sent now. Text is
//! held back while it ends inside a multi-byte character (the decoder shows U+FFFD there)
//! or could still be the start of a stop string; a stop string ends the text before it,
//! even when it spans token boundaries.

use crate::model::tokenizer::Tokenizer;

/// Detokenizes a growing token list in O(new tokens) per step: each step decodes only a
/// short window (the last emitted token onwards) and keeps what the window adds. The
/// window keeps one earlier token so decoders that treat a sequence's first token
/// specially (SentencePiece's leading-space strip) see the same context as a full decode.
#[derive(Debug, Default)]
pub struct IncrementalDecoder {
    prefix_offset: usize,
    read_offset: usize,
    /// Everything decoded so far.
    pub text: String,
    /// Special tokens stay in the text (DeepSeek-V4 writes its tool calls and reasoning
    /// with them).
    pub keep_special_tokens: bool,
}

impl IncrementalDecoder {
    pub fn keeping_special_tokens() -> Self {
        IncrementalDecoder {
            keep_special_tokens: true,
            ..Self::default()
        }
    }

    /// Appends what `ids` (the whole output so far) adds to `text`; with `is_final`, also
    /// a trailing partial character.
    pub fn update(&mut self, tok: &Tokenizer, ids: &[u32], is_final: bool) {
        let prefix = tok
            .decode(
                &ids[self.prefix_offset..self.read_offset],
                !self.keep_special_tokens,
            )
            .unwrap_or_default();
        let full = tok
            .decode(&ids[self.prefix_offset..], !self.keep_special_tokens)
            .unwrap_or_default();
        if full.len() <= prefix.len() || !full.is_char_boundary(prefix.len()) {
            return;
        }
        if full.ends_with('\u{FFFD}') && !is_final {
            return; // a character split across tokens: wait for the rest
        }
        self.text.push_str(&full[prefix.len()..]);
        self.prefix_offset = self.read_offset;
        self.read_offset = ids.len();
    }
}

/// One completion's text as its tokens stream in: decoded incrementally, held back where
/// it could still be a stop string's start, cut where one matched.
#[derive(Debug)]
pub struct ChoiceText {
    decoded: IncrementalDecoder,
    text: TextStream,
    token_ids: Vec<u32>,
    /// Ids that end the completion: with special tokens kept as text, the one that ended
    /// it is still left out.
    stop_ids: Vec<u32>,
}

impl ChoiceText {
    pub fn new(stop: Vec<String>, stop_ids: Vec<u32>, keep_special_tokens: bool) -> Self {
        ChoiceText {
            decoded: if keep_special_tokens {
                IncrementalDecoder::keeping_special_tokens()
            } else {
                IncrementalDecoder::default()
            },
            text: TextStream::new(stop),
            token_ids: Vec::new(),
            stop_ids,
        }
    }

    /// Takes `tokens`, the completion's next ones: the new piece of text and whether a
    /// stop string ended it. Without a tokenizer there is no text (and no stop string).
    pub fn push(
        &mut self,
        tok: Option<&Tokenizer>,
        tokens: &[u32],
        is_final: bool,
    ) -> (String, bool) {
        self.token_ids.extend_from_slice(tokens);
        let Some(tok) = tok else {
            return (String::new(), false);
        };
        let ids = match self.token_ids.split_last() {
            Some((last, rest))
                if self.decoded.keep_special_tokens && self.stop_ids.contains(last) =>
            {
                rest
            }
            _ => &self.token_ids[..],
        };
        self.decoded.update(tok, ids, is_final);
        self.text.next(&self.decoded.text, is_final)
    }

    /// The stop string that ended the text, if one did.
    pub fn matched(&self) -> Option<&str> {
        self.text.matched()
    }
}

#[derive(Debug, Default)]
pub struct TextStream {
    stop: Vec<String>,
    /// Bytes of the decoded text already handed out.
    num_sent_bytes: usize,
    /// Longest stop string minus one: a suffix this long may be a stop string's start.
    num_holdback_bytes: usize,
    /// The stop string that ended the text, once one has.
    matched: Option<String>,
}

impl TextStream {
    pub fn new(stop: Vec<String>) -> Self {
        let stop: Vec<String> = stop.into_iter().filter(|s| !s.is_empty()).collect();
        let num_holdback_bytes = stop.iter().map(String::len).max().unwrap_or(1) - 1;
        TextStream {
            stop,
            num_sent_bytes: 0,
            matched: None,
            num_holdback_bytes,
        }
    }

    /// Given the whole text decoded so far, the new piece to send, and whether a stop
    /// string matched (the text then ends where it starts; nothing more will be sent).
    /// The stop string that ended the text, if one did.
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    pub fn next(&mut self, text: &str, is_final: bool) -> (String, bool) {
        // A stop string can only end in the unsent text: search from just before it.
        let mut search_from = self
            .num_sent_bytes
            .saturating_sub(self.num_holdback_bytes)
            .min(text.len());
        while !text.is_char_boundary(search_from) {
            search_from -= 1;
        }
        let stop_at = self
            .stop
            .iter()
            .filter_map(|s| {
                text[search_from..]
                    .find(s.as_str())
                    .map(|i| (search_from + i, s))
            })
            .min_by_key(|&(i, _)| i);
        let (end, stopped) = match stop_at {
            Some((i, s)) => {
                self.matched = Some(s.clone());
                (i, true)
            }
            None if is_final => (text.len(), false),
            None if text.ends_with('\u{FFFD}') => return (String::new(), false),
            None => {
                let mut end = text.len().saturating_sub(self.num_holdback_bytes);
                while !text.is_char_boundary(end) {
                    end -= 1;
                }
                (end, false)
            }
        };
        if end <= self.num_sent_bytes {
            return (String::new(), stopped);
        }
        let piece = text[self.num_sent_bytes..end].to_string();
        self.num_sent_bytes = end;
        (piece, stopped)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stream: &mut TextStream, prefixes: &[&str]) -> (String, bool) {
        let mut out = String::new();
        for (i, p) in prefixes.iter().enumerate() {
            let (piece, stopped) = stream.next(p, i + 1 == prefixes.len());
            out.push_str(&piece);
            if stopped {
                return (out, true);
            }
        }
        (out, false)
    }

    #[test]
    fn a_stop_string_spanning_pieces_ends_the_text_before_it() {
        let mut s = TextStream::new(vec!["END".into()]);
        let (out, stopped) = run(
            &mut s,
            &["abc E", "abc EN", "abc ENDxyz", "abc ENDxyz more"],
        );
        assert_eq!((out.as_str(), stopped), ("abc ", true));
    }

    #[test]
    fn the_earliest_stop_string_is_reported() {
        let mut s = TextStream::new(vec!["zz".into(), "b".into(), "cd".into()]);
        assert_eq!(s.matched(), None);
        let (out, stopped) = run(&mut s, &["a", "acd", "acdbzz"]);
        assert_eq!(
            (out.as_str(), stopped, s.matched()),
            ("a", true, Some("cd"))
        );
        let mut none = TextStream::new(vec!["q".into()]);
        run(&mut none, &["abc", "abcd"]);
        assert_eq!(none.matched(), None);
    }

    #[test]
    fn held_back_text_is_released_when_no_stop_follows() {
        let mut s = TextStream::new(vec!["STOP".into()]);
        let (first, _) = s.next("hello ST", false);
        assert_eq!(first, "hello"); // " ST" may begin "STOP"
        let (rest, stopped) = s.next("hello STAR", true);
        assert_eq!((rest.as_str(), stopped), (" STAR", false));
    }

    #[test]
    fn a_partial_character_is_never_sent() {
        let mut s = TextStream::new(Vec::new());
        assert_eq!(s.next("caf\u{FFFD}", false).0, "");
        assert_eq!(s.next("café", false).0, "café");
    }
}
