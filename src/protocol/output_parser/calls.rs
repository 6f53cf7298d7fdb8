//! Whole call blocks of the markups that are read at their close: DeepSeek-V4's DSML
//! invokes and Mistral's `[TOOL_CALLS]` forms, as (name, arguments JSON) pairs.

use super::MISTRAL_CALLS;

const DSML_INVOKE: &str = "<｜DSML｜invoke name=\"";
const DSML_INVOKE_CLOSE: &str = "</｜DSML｜invoke>";
const DSML_PARAMETER: &str = "<｜DSML｜parameter name=\"";
const DSML_PARAMETER_CLOSE: &str = "</｜DSML｜parameter>";
const MISTRAL_ARGS: &str = "[ARGS]";

/// The calls of a DSML block: `<｜DSML｜invoke name="f">` holding parameters
/// `<｜DSML｜parameter name="p" string="true|false">v</｜DSML｜parameter>` (a string as
/// is, anything else JSON), as (name, arguments JSON); `None` when `raw` is not one.
pub(super) fn parse_dsml_invokes(raw: &str) -> Option<Vec<(String, String)>> {
    let mut calls = Vec::new();
    let mut rest = raw.trim();
    while !rest.is_empty() {
        let after = rest.strip_prefix(DSML_INVOKE)?;
        let (name, after) = after.split_once("\">")?;
        let (body, after) = after.split_once(DSML_INVOKE_CLOSE)?;
        let mut args = serde_json::Map::new();
        let mut params = body.trim();
        while !params.is_empty() {
            let after = params.strip_prefix(DSML_PARAMETER)?;
            let (key, after) = after.split_once('"')?;
            let (attrs, after) = after.split_once('>')?;
            let (value, after) = after.split_once(DSML_PARAMETER_CLOSE)?;
            let value = if attrs.contains("string=\"true\"") {
                serde_json::Value::String(value.to_string())
            } else {
                serde_json::from_str(value.trim())
                    .unwrap_or_else(|_| serde_json::Value::String(value.to_string()))
            };
            args.insert(key.to_string(), value);
            params = after.trim_start();
        }
        calls.push((
            name.to_string(),
            serde_json::Value::Object(args).to_string(),
        ));
        rest = after.trim_start();
    }
    (!calls.is_empty()).then_some(calls)
}

/// Mistral's calls after `[TOOL_CALLS]`: a JSON list of `{"name", "arguments"}` objects
/// (v3 templates), or `name[ARGS]{…}` with each further call after another `[TOOL_CALLS]`
/// (later ones), as (name, arguments JSON); `None` when `raw` is neither.
pub(super) fn parse_mistral_calls(raw: &str) -> Option<Vec<(String, String)>> {
    let raw = raw.trim();
    if raw.starts_with('[') {
        let list: Vec<serde_json::Value> = serde_json::from_str(raw).ok()?;
        return list
            .iter()
            .map(|c| {
                let name = c.get("name")?.as_str()?.to_string();
                let args = match c.get("arguments")? {
                    serde_json::Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                Some((name, args))
            })
            .collect::<Option<Vec<_>>>()
            .filter(|calls| !calls.is_empty());
    }
    raw.split(MISTRAL_CALLS)
        .map(|call| {
            let (name, args) = call.split_once(MISTRAL_ARGS)?;
            let args: serde_json::Value = serde_json::from_str(args.trim()).ok()?;
            let name = name.trim();
            (!name.is_empty()).then(|| (name.to_string(), args.to_string()))
        })
        .collect()
}
