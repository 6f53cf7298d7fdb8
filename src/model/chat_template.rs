//! Chat templates: the model's own Jinja template rendered with minijinja, with the
//! Python-compatible methods (`.strip()`, `.items()`, ...) and the globals that
//! transformers provides (`raise_exception`, `strftime_now`).

use minijinja::{Environment, Error, ErrorKind, Value, context};
use serde::Serialize;

use crate::error::{Result, TroupeError};

#[derive(Debug, Clone, Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

pub struct ChatTemplate {
    env: Environment<'static>,
    /// The template renders a `tools` list (it has its own tool-call syntax).
    supports_tools: bool,
    bos_token: String,
    eos_token: String,
    /// The Jinja text, as `/tokenizer_info` hands it to clients that render chats.
    source: String,
}

fn raise_exception(msg: String) -> std::result::Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// transformers' `strftime_now`: the current UTC time through a C `strftime` format.
fn strftime_now(format: String) -> String {
    let now = time::OffsetDateTime::now_utc();
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out += &now.year().to_string(),
            Some('y') => out += &format!("{:02}", now.year() % 100),
            Some('m') => out += &format!("{:02}", u8::from(now.month())),
            Some('d') => out += &format!("{:02}", now.day()),
            Some('B') => out += &now.month().to_string(),
            Some('b') => out += &now.month().to_string()[..3],
            Some('A') => out += &now.weekday().to_string(),
            Some('a') => out += &now.weekday().to_string()[..3],
            Some('H') => out += &format!("{:02}", now.hour()),
            Some('M') => out += &format!("{:02}", now.minute()),
            Some('S') => out += &format!("{:02}", now.second()),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Instructions (about 64 bytes of data each) a render may spend: tens of thousands of
/// messages' worth for the chat templates models ship, about a second and 320 MB at most.
const TEMPLATE_FUEL: u64 = 5_000_000;

impl ChatTemplate {
    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = Environment::new();
        // transformers renders with these two on; templates are written for them.
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .expect("default delimiters are valid"),
        );
        // A template comes with the model files, which are untrusted: one that loops for
        // ever or builds a huge string runs out of fuel (minijinja's instruction and
        // allocation budget, per render) instead of holding a worker; recursion is
        // capped by minijinja's own limit.
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        minijinja_contrib::add_to_environment(&mut env);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| TroupeError::ChatTemplate(format!("cannot parse: {e}")))?;
        Ok(ChatTemplate {
            env,
            supports_tools: source.contains("tools"),
            source: source.to_string(),
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
        })
    }

    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let messages = serde_json::to_value(messages).expect("messages serialize");
        self.render_json(&messages, None, add_generation_prompt)
    }

    pub fn supports_tools(&self) -> bool {
        self.supports_tools
    }

    /// Renders messages in transformers' JSON shape (with `tool_calls`, `tool_call_id`),
    /// and `tools` as OpenAI function definitions when given.
    pub fn render_json(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let tmpl = self
            .env
            .get_template("chat")
            .expect("template added in new");
        tmpl.render(context! {
            messages => Value::from(minijinja::value::Serde(messages)),
            tools => tools.map(|t| Value::from(minijinja::value::Serde(t))),
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })
        .map_err(|e| TroupeError::ChatTemplate(format!("cannot render: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_renders_with_generation_prompt() {
        let src = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content.strip() }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
        let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
        let out = t
            .render(&[ChatMessage::new("user", "  hi ")], true)
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn raise_exception_is_a_clear_error() {
        let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}", "", "").unwrap();
        let err = t.render(&[], false).unwrap_err().to_string();
        assert!(err.contains("roles must alternate"), "{err}");
    }

    /// Templates that loop for ever, build huge strings or recurse without end end in
    /// bounded time with an error; a long ordinary chat still renders.
    #[test]
    fn hostile_templates_end_with_an_error_in_bounded_time() {
        for src in [
            "{% for i in range(1000000000) %}x{% endfor %}",
            "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
            "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
            "{% for m in messages %}{% for n in messages %}{% for o in messages %}{{ m.content }}{% endfor %}{% endfor %}{% endfor %}",
        ] {
            let t = ChatTemplate::new(src, "", "").unwrap();
            let messages = vec![ChatMessage::new("user", "hello"); 400];
            let started = std::time::Instant::now();
            let err = t.render(&messages, false).unwrap_err().to_string();
            assert!(
                started.elapsed() < std::time::Duration::from_secs(20),
                "{src}"
            );
            assert!(err.contains("cannot render"), "{src}: {err}");
        }
        let chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}";
        let t = ChatTemplate::new(chatml, "", "").unwrap();
        let long = vec![ChatMessage::new("user", "hello"); 20_000];
        assert!(t.render(&long, false).unwrap().len() > 20_000 * 20);
    }

    #[test]
    fn strftime_now_formats_a_date() {
        let s = strftime_now("%d %B %Y".into());
        assert_eq!(s.split(' ').count(), 3, "{s}");
        assert!(s.ends_with(&time::OffsetDateTime::now_utc().year().to_string()));
    }
}
