//! Engine outputs → what a reply is made of, for every API: per choice, the parser that
//! splits generated text into reasoning, text and tool calls, fed incrementally when
//! streaming and once with the whole text otherwise.

use super::output_parser::{OutputEvent, OutputParser, ParseSpec};
use crate::engine::{FinishReason, RequestOutput};

#[derive(Debug, Clone, PartialEq)]
pub struct CallOut {
    pub name: String,
    pub arguments: String,
}

/// One choice, whole.
#[derive(Debug, Clone)]
pub struct Reply {
    pub text: String,
    pub reasoning: String,
    pub calls: Vec<CallOut>,
    pub finish: Option<FinishReason>,
}

impl Reply {
    pub fn from_events(
        events: impl IntoIterator<Item = OutputEvent>,
        finish: Option<FinishReason>,
    ) -> Self {
        let mut r = Reply {
            text: String::new(),
            reasoning: String::new(),
            calls: Vec::new(),
            finish,
        };
        for e in events {
            match e {
                OutputEvent::Text(t) => r.text.push_str(&t),
                OutputEvent::Reasoning(t) => r.reasoning.push_str(&t),
                OutputEvent::CallStart { name, .. } => r.calls.push(CallOut {
                    name,
                    arguments: String::new(),
                }),
                OutputEvent::CallArgs { index, delta } => {
                    if let Some(c) = r.calls.get_mut(index) {
                        c.arguments.push_str(&delta);
                    }
                }
                OutputEvent::CallEnd { .. } => {}
            }
        }
        // A call the token budget cut off is not a call: its arguments do not parse. The
        // reply says `length`, and carries no call with broken arguments.
        let cut = matches!(finish, Some(FinishReason::Length | FinishReason::Preempted))
            && r.calls
                .last()
                .is_some_and(|c| serde_json::from_str::<serde_json::Value>(&c.arguments).is_err());
        if cut {
            r.calls.pop();
        }
        r
    }

    /// A finished output's reply.
    pub fn parse(o: &RequestOutput, spec: ParseSpec) -> Self {
        let mut p = spec.parser();
        let mut events = p.push(&o.text);
        events.extend(p.finish());
        Self::from_events(events, o.finish_reason)
    }
}

/// The parsers of a streamed request's choices.
pub struct ChoiceStreams {
    parsers: Vec<OutputParser>,
    spec: ParseSpec,
}

impl ChoiceStreams {
    pub fn new(spec: ParseSpec) -> Self {
        ChoiceStreams {
            parsers: Vec::new(),
            spec,
        }
    }

    /// The events of one output; a final one flushes its choice.
    pub fn feed(&mut self, o: &RequestOutput) -> Vec<OutputEvent> {
        while self.parsers.len() <= o.index {
            self.parsers.push(self.spec.parser());
        }
        let p = &mut self.parsers[o.index];
        let mut events = p.push(&o.text);
        if o.is_final() {
            events.extend(p.finish());
        }
        events
    }

    pub fn num_calls(&self, index: usize) -> usize {
        self.parsers.get(index).map_or(0, |p| p.num_calls())
    }
}

/// A tool call's id: unique per server run, stable within a reply.
pub fn call_id(prefix: &str, request_id: u64, choice: usize, call: usize) -> String {
    format!("{prefix}{request_id:x}{choice:02x}{call:02x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(text: &str, finish: FinishReason) -> Reply {
        let mut p = ParseSpec::generic(true, false).parser();
        let mut events = p.push(text);
        events.extend(p.finish());
        Reply::from_events(events, Some(finish))
    }

    #[test]
    fn a_call_cut_by_the_budget_is_no_call() {
        let whole = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        for cut_at in [40, 52, 60] {
            let r = reply(&whole[..cut_at], FinishReason::Length);
            assert!(r.calls.is_empty(), "cut at {cut_at}: {:?}", r.calls);
        }
        // Whole arguments stay a call even when the budget ended the reply.
        let r = reply(&whole[..whole.len() - 3], FinishReason::Length);
        assert_eq!(r.calls.len(), 1, "{r:?}");
        assert_eq!(r.calls[0].arguments, "{\"city\": \"Paris\"}");
        let r = reply(whole, FinishReason::Stop);
        assert_eq!(r.calls[0].name, "get_weather");
    }
}
