//! Generated text → reasoning, text and tool calls, incrementally: each API streams the
//! events in its own format, and a non-streamed reply is the same events collected.
//!
//! Tool calls are `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (the
//! generic format, also Hermes' and Qwen's) or, as Llama 3.1 writes them, a reply that is
//! one JSON object with `name` and `parameters`. Arguments stream as they are generated
//! when `name` comes first (it does under the tool-call grammar); otherwise a call is
//! reported whole when it closes. Reasoning is a leading `<think>...</think>` block.
//!
//! DeepSeek-V4 (`ParseSpec::deepseek_v4`) writes its calls as DSML blocks (its special
//! tokens kept in the text), reported whole when the block closes, and in thinking mode
//! its reply starts inside the reasoning: the prompt ended with `<think>`.

const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";
const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const DSML_CALLS_OPEN: &str = "<｜DSML｜tool_calls>";
const DSML_CALLS_CLOSE: &str = "</｜DSML｜tool_calls>";
const MISTRAL_CALLS: &str = "[TOOL_CALLS]";

/// How a reply's calls are delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallMarkup {
    /// `<tool_call>` JSON blocks, or a reply that is one bare JSON call.
    Tagged,
    /// DeepSeek-V4's DSML blocks.
    Dsml,
    /// Mistral's `[TOOL_CALLS]` to the end of the reply: a JSON list of calls, or
    /// `name[ARGS]{…}` pairs.
    Mistral,
}

/// How a reply's text is read.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ParseSpec {
    pub tools: bool,
    pub reasoning: bool,
    pub markup: CallMarkup,
    /// The text starts inside a reasoning block (its `<think>` was in the prompt).
    pub starts_in_reasoning: bool,
    /// The text starts inside a call block (the prompt opened it: a forced DSML call).
    pub starts_in_call: bool,
}

impl ParseSpec {
    pub fn generic(tools: bool, reasoning: bool) -> Self {
        ParseSpec {
            tools,
            reasoning,
            markup: CallMarkup::Tagged,
            starts_in_reasoning: false,
            starts_in_call: false,
        }
    }

    /// DeepSeek-V4 with `tools` in the request, in thinking mode or not.
    pub fn deepseek_v4(tools: bool, thinking: bool) -> Self {
        ParseSpec {
            tools,
            reasoning: true,
            markup: CallMarkup::Dsml,
            starts_in_reasoning: thinking,
            starts_in_call: false,
        }
    }

    pub fn parser(&self) -> OutputParser {
        let mut p = OutputParser::new(self.tools, self.reasoning);
        p.markup = self.markup;
        match self.markup {
            CallMarkup::Tagged => {}
            CallMarkup::Dsml => {
                p.call_open = DSML_CALLS_OPEN;
                p.call_close = DSML_CALLS_CLOSE;
            }
            CallMarkup::Mistral => {
                p.call_open = MISTRAL_CALLS;
                p.call_close = "";
            }
        }
        if self.starts_in_call && self.tools {
            p.state = State::CallWhole;
        } else if self.starts_in_reasoning {
            p.state = State::Reasoning;
        }
        p
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum OutputEvent {
    Reasoning(String),
    Text(String),
    CallStart { index: usize, name: String },
    CallArgs { index: usize, delta: String },
    CallEnd { index: usize },
}

#[derive(Debug, PartialEq)]
enum State {
    Start,
    Reasoning,
    Text,
    /// A reply opening with `{`: maybe a bare JSON call, decided at the end.
    BareJson,
    /// After `<tool_call>`, before `"arguments":` is read.
    CallHead,
    CallArgs(JsonScan),
    /// Arguments done; skipping to `</tool_call>`.
    CallTail,
    /// A call whose fields are not in streaming order: parsed whole at its close.
    CallWhole,
}

/// Tracks where a JSON value ends, one character at a time.
#[derive(Debug, PartialEq, Default)]
struct JsonScan {
    depth: usize,
    in_string: bool,
    escaped: bool,
    started: bool,
}

impl JsonScan {
    /// Feeds `c`; true once the value is complete (with `c`).
    fn feed(&mut self, c: char) -> bool {
        if self.in_string {
            if self.escaped {
                self.escaped = false;
            } else if c == '\\' {
                self.escaped = true;
            } else if c == '"' {
                self.in_string = false;
                return self.depth == 0;
            }
            return false;
        }
        match c {
            '{' | '[' => {
                self.depth += 1;
                self.started = true;
            }
            '}' | ']' => {
                self.depth = self.depth.saturating_sub(1);
                return self.depth == 0;
            }
            '"' => {
                self.in_string = true;
                self.started = true;
            }
            _ => {}
        }
        false
    }
}

pub struct OutputParser {
    parse_tools: bool,
    parse_reasoning: bool,
    state: State,
    buf: String,
    num_calls: usize,
    /// Whitespace after a reasoning block or a call is layout, not text.
    trim_text: bool,
    call_open: &'static str,
    call_close: &'static str,
    markup: CallMarkup,
}

impl OutputParser {
    pub fn new(parse_tools: bool, parse_reasoning: bool) -> Self {
        OutputParser {
            parse_tools,
            parse_reasoning,
            state: State::Start,
            buf: String::new(),
            num_calls: 0,
            trim_text: false,
            call_open: CALL_OPEN,
            call_close: CALL_CLOSE,
            markup: CallMarkup::Tagged,
        }
    }

    pub fn num_calls(&self) -> usize {
        self.num_calls
    }

    pub fn push(&mut self, delta: &str) -> Vec<OutputEvent> {
        self.buf.push_str(delta);
        let mut out = Vec::new();
        while self.step(&mut out, false) {}
        out
    }

    /// The text has ended: everything still held back comes out.
    pub fn finish(&mut self) -> Vec<OutputEvent> {
        let mut out = Vec::new();
        while self.step(&mut out, true) {}
        match std::mem::replace(&mut self.state, State::Text) {
            State::BareJson => {
                let raw = std::mem::take(&mut self.buf);
                if !self.emit_whole_call(&raw, &mut out) {
                    out.push(OutputEvent::Text(raw));
                }
            }
            State::CallWhole | State::CallHead => {
                let raw = std::mem::take(&mut self.buf);
                if !self.emit_whole(&raw, &mut out) {
                    out.push(OutputEvent::Text(format!("{}{raw}", self.call_open)));
                }
            }
            State::CallArgs(_) | State::CallTail => {
                out.push(OutputEvent::CallEnd {
                    index: self.num_calls - 1,
                });
            }
            State::Start | State::Reasoning | State::Text => {
                let rest = std::mem::take(&mut self.buf);
                if !rest.is_empty() {
                    out.push(if self.state == State::Reasoning {
                        OutputEvent::Reasoning(rest)
                    } else {
                        OutputEvent::Text(rest)
                    });
                }
            }
        }
        self.buf.clear();
        out
    }

    /// One transition; false when more text is needed.
    fn step(&mut self, out: &mut Vec<OutputEvent>, at_end: bool) -> bool {
        match &mut self.state {
            State::Start => {
                let t = self.buf.trim_start();
                if t.is_empty() && !at_end {
                    return false;
                }
                if self.parse_reasoning && is_partial(t, THINK_OPEN) && !at_end {
                    return false;
                }
                if self.parse_reasoning && t.starts_with(THINK_OPEN) {
                    self.buf = t[THINK_OPEN.len()..].to_string();
                    self.state = State::Reasoning;
                } else if self.parse_tools
                    && self.markup == CallMarkup::Tagged
                    && t.starts_with('{')
                {
                    self.state = State::BareJson;
                } else {
                    self.state = State::Text;
                }
                true
            }
            State::Reasoning => {
                if let Some(at) = self.buf.find(THINK_CLOSE) {
                    let reasoning = self.buf[..at].to_string();
                    self.buf = self.buf[at + THINK_CLOSE.len()..].trim_start().to_string();
                    if !reasoning.is_empty() {
                        out.push(OutputEvent::Reasoning(reasoning));
                    }
                    self.state = State::Text;
                    self.trim_text = true;
                    return true;
                }
                let keep = held_back(&self.buf, THINK_CLOSE);
                let emit: String = self.buf.drain(..self.buf.len() - keep).collect();
                if !emit.is_empty() {
                    out.push(OutputEvent::Reasoning(emit));
                }
                false
            }
            State::Text => {
                if self.trim_text {
                    let t = self.buf.trim_start();
                    if t.is_empty() {
                        self.buf.clear();
                        return false;
                    }
                    self.buf = t.to_string();
                    self.trim_text = false;
                }
                if !self.parse_tools {
                    if !self.buf.is_empty() {
                        out.push(OutputEvent::Text(std::mem::take(&mut self.buf)));
                    }
                    return false;
                }
                if let Some(at) = self.buf.find(self.call_open) {
                    let text = self.buf[..at].to_string();
                    self.buf.drain(..at + self.call_open.len());
                    if !text.trim().is_empty() {
                        out.push(OutputEvent::Text(text));
                    }
                    self.state = if self.markup != CallMarkup::Tagged {
                        State::CallWhole
                    } else {
                        State::CallHead
                    };
                    return true;
                }
                let keep = held_back(&self.buf, self.call_open);
                let emit: String = self.buf.drain(..self.buf.len() - keep).collect();
                if !emit.is_empty() {
                    out.push(OutputEvent::Text(emit));
                }
                false
            }
            State::BareJson => false,
            State::CallHead => match parse_call_head(&self.buf) {
                Head::Incomplete => {
                    if self.buf.contains(CALL_CLOSE) {
                        self.state = State::CallWhole;
                        return true;
                    }
                    false
                }
                Head::Other => {
                    self.state = State::CallWhole;
                    true
                }
                Head::Name { name, args_at } => {
                    out.push(OutputEvent::CallStart {
                        index: self.num_calls,
                        name,
                    });
                    self.num_calls += 1;
                    self.buf.drain(..args_at);
                    self.state = State::CallArgs(JsonScan::default());
                    true
                }
            },
            State::CallArgs(scan) => {
                let was_started = scan.started;
                let mut end = None;
                for (i, c) in self.buf.char_indices() {
                    if scan.feed(c) {
                        end = Some(i + c.len_utf8());
                        break;
                    }
                }
                let index = self.num_calls - 1;
                let cut = end.unwrap_or(self.buf.len());
                let delta: String = self.buf.drain(..cut).collect();
                let delta = if was_started {
                    delta
                } else {
                    delta.trim_start().to_string()
                };
                if !delta.is_empty() {
                    out.push(OutputEvent::CallArgs { index, delta });
                }
                if end.is_some() {
                    self.state = State::CallTail;
                    return true;
                }
                false
            }
            State::CallTail => {
                if let Some(at) = self.buf.find(CALL_CLOSE) {
                    self.buf.drain(..at + CALL_CLOSE.len());
                    out.push(OutputEvent::CallEnd {
                        index: self.num_calls - 1,
                    });
                    self.state = State::Text;
                    self.trim_text = true;
                    return true;
                }
                false
            }
            State::CallWhole => {
                // A block without a close (Mistral's) runs to the end of the reply.
                if self.call_close.is_empty() {
                    return false;
                }
                let Some(at) = self.buf.find(self.call_close) else {
                    return false;
                };
                let raw: String = self.buf[..at].to_string();
                self.buf.drain(..at + self.call_close.len());
                if !self.emit_whole(&raw, out) {
                    let (open, close) = (self.call_open, self.call_close);
                    out.push(OutputEvent::Text(format!("{open}{raw}{close}")));
                }
                self.state = State::Text;
                self.trim_text = true;
                true
            }
        }
    }

    /// A complete call block (a JSON call, or DSML's invokes) as events; false when `raw`
    /// is not one.
    fn emit_whole(&mut self, raw: &str, out: &mut Vec<OutputEvent>) -> bool {
        let calls = match self.markup {
            CallMarkup::Tagged => return self.emit_whole_call(raw, out),
            CallMarkup::Dsml => parse_dsml_invokes(raw),
            CallMarkup::Mistral => parse_mistral_calls(raw),
        };
        let Some(calls) = calls else {
            return false;
        };
        for (name, args) in calls {
            let index = self.num_calls;
            self.num_calls += 1;
            out.push(OutputEvent::CallStart { index, name });
            out.push(OutputEvent::CallArgs { index, delta: args });
            out.push(OutputEvent::CallEnd { index });
        }
        true
    }

    /// A complete call object as events; false when `raw` is not one.
    fn emit_whole_call(&mut self, raw: &str, out: &mut Vec<OutputEvent>) -> bool {
        let Ok(serde_json::Value::Object(obj)) = serde_json::from_str(raw.trim()) else {
            return false;
        };
        let Some(name) = obj.get("name").and_then(|n| n.as_str()) else {
            return false;
        };
        let Some(args) = obj.get("arguments").or_else(|| obj.get("parameters")) else {
            return false;
        };
        let args = match args {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        let index = self.num_calls;
        self.num_calls += 1;
        out.push(OutputEvent::CallStart {
            index,
            name: name.to_string(),
        });
        out.push(OutputEvent::CallArgs { index, delta: args });
        out.push(OutputEvent::CallEnd { index });
        true
    }
}

/// `s` is a proper prefix of `token` (more text may complete it).
fn is_partial(s: &str, token: &str) -> bool {
    s.len() < token.len() && token.starts_with(s)
}

/// How many trailing bytes of `buf` could begin `token`: held back until known.
fn held_back(buf: &str, token: &str) -> usize {
    (1..token.len().min(buf.len() + 1))
        .rev()
        .find(|&k| buf.is_char_boundary(buf.len() - k) && token.starts_with(&buf[buf.len() - k..]))
        .unwrap_or(0)
}

enum Head {
    Incomplete,
    /// Not `{"name": "...", "arguments":` in that order.
    Other,
    Name {
        name: String,
        args_at: usize,
    },
}

/// Reads `{"name": "<name>", "arguments":` (or `"parameters":`) from the start of `s`.
fn parse_call_head(s: &str) -> Head {
    let mut rest = s;
    let expect = |lit: &str, rest: &mut &str| -> Option<bool> {
        let t = rest.trim_start();
        if t.len() < lit.len() {
            return if lit.starts_with(t) {
                None
            } else {
                Some(false)
            };
        }
        if let Some(after) = t.strip_prefix(lit) {
            *rest = after;
            Some(true)
        } else {
            Some(false)
        }
    };
    macro_rules! lit {
        ($l:expr) => {
            match expect($l, &mut rest) {
                None => return Head::Incomplete,
                Some(false) => return Head::Other,
                Some(true) => {}
            }
        };
    }
    lit!("{");
    lit!("\"name\"");
    lit!(":");
    let t = rest.trim_start();
    if t.is_empty() {
        return Head::Incomplete;
    }
    if !t.starts_with('"') {
        return Head::Other;
    }
    let mut scan = JsonScan::default();
    let Some(end) = t
        .char_indices()
        .find(|&(_, c)| scan.feed(c))
        .map(|(i, c)| i + c.len_utf8())
    else {
        return Head::Incomplete;
    };
    let Ok(name) = serde_json::from_str::<String>(&t[..end]) else {
        return Head::Other;
    };
    rest = &t[end..];
    lit!(",");
    let t = rest.trim_start();
    let key = if t.starts_with("\"p") {
        "\"parameters\""
    } else {
        "\"arguments\""
    };
    lit!(key);
    lit!(":");
    Head::Name {
        name,
        args_at: s.len() - rest.len(),
    }
}

mod calls;
use calls::{parse_dsml_invokes, parse_mistral_calls};

#[cfg(test)]
mod tests;
