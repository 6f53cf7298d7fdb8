//! Request fields as the codecs read them: every field of a body is one a pass reads, or
//! the request is refused naming it. A field the server does not know used to be dropped
//! with a 200 (`"frobnicate": 1`, or vLLM's older `guided_regex`, whose output then came
//! back unconstrained); a client learns of a typo or a feature we lack only from a 400.

use std::collections::BTreeSet;

use serde::de::DeserializeOwned;
use serde_json::Value;

use super::api::{ApiError, parse_value};

/// A body read by one or more passes (a request struct, then the sampling fields read from
/// the same body): collects what each pass left unread.
pub struct Passes<'a> {
    body: &'a Value,
    /// Per pass, the paths it left unread.
    unread: Vec<BTreeSet<String>>,
}

impl<'a> Passes<'a> {
    pub fn new(body: &'a Value) -> Self {
        Passes {
            body,
            unread: Vec::new(),
        }
    }

    /// `T` from the body, remembering which of its fields `T` does not have.
    pub fn pass<T: DeserializeOwned>(&mut self) -> Result<T, ApiError> {
        let mut unread = BTreeSet::new();
        let read = serde_ignored::deserialize(self.body, |path| {
            unread.insert(path_name(&path));
        });
        match read {
            Ok(v) => {
                self.unread.push(unread);
                Ok(v)
            }
            // The path-naming error of the same read.
            Err(_) => parse_value(self.body),
        }
    }

    /// Refuses the first field no pass read, naming it, unless it is `null` (a client
    /// library's way of leaving a field out) or one of `tolerated` (fields a client sends
    /// back unchanged from a reply, named by their path).
    pub fn finish(self, tolerated: &[&str]) -> Result<(), ApiError> {
        let Some((first, rest)) = self.unread.split_first() else {
            return Ok(());
        };
        for path in first {
            // A top-level field one pass skipped may be another pass's; a nested one lies
            // inside a field its pass read, so no other pass sees it.
            let nested = path.contains(['.', '[']);
            if !nested && !rest.iter().all(|u| u.contains(path)) {
                continue;
            }
            if tolerated.iter().any(|t| tolerates(t, path)) || at(self.body, path).is_null() {
                continue;
            }
            let field = path.rsplit(['.', ']']).next().unwrap_or(path);
            return Err(ApiError::bad(
                path,
                format!("`{path}`: unknown field `{field}` (refused rather than ignored)"),
            ));
        }
        Ok(())
    }
}

/// `messages[3].refusal` as the path a tolerance names (`messages[].refusal`).
fn tolerates(pattern: &str, path: &str) -> bool {
    let mut plain = String::with_capacity(path.len());
    let mut in_index = false;
    for c in path.chars() {
        match c {
            '[' => {
                in_index = true;
                plain.push('[');
            }
            ']' => {
                in_index = false;
                plain.push(']');
            }
            _ if in_index => {}
            c => plain.push(c),
        }
    }
    plain == pattern
}

/// A path as errors write them: `messages[0].foo`.
fn path_name(path: &serde_ignored::Path) -> String {
    use serde_ignored::Path;
    match path {
        Path::Root => String::new(),
        Path::Seq { parent, index } => format!("{}[{index}]", path_name(parent)),
        Path::Map { parent, key } => match path_name(parent) {
            p if p.is_empty() => key.clone(),
            p => format!("{p}.{key}"),
        },
        Path::Some { parent }
        | Path::NewtypeStruct { parent }
        | Path::NewtypeVariant { parent } => path_name(parent),
    }
}

/// The value at `path` (as `path_name` writes it) in `body`.
fn at<'v>(body: &'v Value, path: &str) -> &'v Value {
    let mut v = body;
    for part in path.split('.') {
        let (key, indices) = part.split_once('[').unwrap_or((part, ""));
        if !key.is_empty() {
            v = &v[key];
        }
        for i in indices.split('[') {
            if let Ok(i) = i.trim_end_matches(']').parse::<usize>() {
                v = &v[i];
            }
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;
    use serde_json::json;

    #[derive(Deserialize)]
    #[allow(dead_code)]
    struct Outer {
        model: Option<String>,
        messages: Vec<Inner>,
    }
    #[derive(Deserialize)]
    #[allow(dead_code)]
    struct Inner {
        role: String,
    }
    #[derive(Deserialize)]
    #[allow(dead_code)]
    struct Sampling {
        temperature: Option<f32>,
    }

    fn check(body: Value, tolerated: &[&str]) -> Result<(), ApiError> {
        let mut p = Passes::new(&body);
        p.pass::<Outer>()?;
        p.pass::<Sampling>()?;
        p.finish(tolerated)
    }

    #[test]
    fn a_field_no_pass_reads_is_refused_by_its_path() {
        let ok = json!({"model": "m", "messages": [{"role": "user"}], "temperature": 0.5});
        check(ok, &[]).unwrap();
        let e = check(json!({"messages": [], "frobnicate": 1}), &[]).unwrap_err();
        assert_eq!((e.status, e.param.as_deref()), (400, Some("frobnicate")));
        assert!(
            e.message.contains("unknown field `frobnicate`"),
            "{}",
            e.message
        );
        let e = check(
            json!({"messages": [{"role": "user"}, {"role": "user", "refusl": "x"}]}),
            &[],
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[1].refusl"));
        // A null is a field left out; a tolerated echo passes at any index.
        check(json!({"messages": [], "frobnicate": null}), &[]).unwrap();
        let echoed = json!({"messages": [{"role": "user"}, {"role": "a", "refusal": "no"}]});
        check(echoed.clone(), &["messages[].refusal"]).unwrap();
        assert!(check(echoed, &["messages[].audio"]).is_err());
        // A read that fails still names its field.
        let e = check(json!({"messages": [{"role": 3}]}), &[]).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
    }
}
