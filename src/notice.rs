//! What a process tells its operator (serving on ..., loaded, draining): plain `troupe:`
//! lines on stderr, or under `serve --log-format json` one JSON object a line in the shape
//! of the tracing logs beside them, so that a log collector reads every line of stderr.

use crate::sync::OnceLock;

static JSON: OnceLock<bool> = OnceLock::new();

/// Notices from here on are JSON lines (set once, when the logs are set up).
pub fn use_json(json: bool) {
    let _ = JSON.set(json);
}

/// Tells the operator `message`.
pub fn notice(message: &str) {
    eprintln!("{}", line(message, JSON.get().copied().unwrap_or(false)));
}

fn line(message: &str, json: bool) -> String {
    if !json {
        return format!("troupe: {message}");
    }
    let timestamp = time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default();
    serde_json::json!({"timestamp": timestamp, "level": "INFO",
        "fields": {"message": message}, "target": "troupe"})
    .to_string()
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_notice_is_a_plain_line_or_a_log_shaped_json_object() {
        assert_eq!(super::line("loaded", false), "troupe: loaded");
        let v: serde_json::Value = serde_json::from_str(&super::line("a \"b\"\nc", true)).unwrap();
        assert_eq!(v["fields"]["message"], "a \"b\"\nc");
        assert_eq!(v["level"], "INFO");
        assert!(v["timestamp"].as_str().unwrap().ends_with('Z'), "{v}");
    }
}
