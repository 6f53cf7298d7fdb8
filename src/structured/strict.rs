//! Strict object schemas: an object schema that names its properties allows no others
//! unless it says so. JSON Schema's own default admits any extra key, and small models take
//! the opening: SmolLM2-135M, forced to call a tool, wrote `"type":"string","properties":{…`
//! after its one argument until `max_tokens` ran out. vLLM generates only the named
//! properties (xgrammar's strict default, guidance's `disable-additional-properties`); so do
//! we. A schema that wants extra keys says `additionalProperties` (or
//! `unevaluatedProperties`) itself, and that is kept as written.

use serde_json::Value;

/// Keywords whose value is a map of names to subschemas.
const SCHEMA_MAPS: [&str; 5] = [
    "properties",
    "patternProperties",
    "$defs",
    "definitions",
    "dependentSchemas",
];
/// Keywords whose value is one subschema.
const SCHEMA_ONE: [&str; 11] = [
    "additionalProperties",
    "unevaluatedProperties",
    "items",
    "additionalItems",
    "unevaluatedItems",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
];
/// Keywords whose value is a list of subschemas (`items` in the drafts before 2020-12 too).
const SCHEMA_LISTS: [&str; 5] = ["anyOf", "oneOf", "allOf", "prefixItems", "items"];

/// `schema` with `additionalProperties: false` on every object schema that lists
/// `properties` or `patternProperties` and says nothing of other keys. Only schema
/// positions are walked: a property that happens to be called `properties` is a name, not
/// a schema. The members of an `allOf` are left open, because each of them names only
/// part of the object and closing them would forbid each other's keys; their own nested
/// objects are closed.
pub fn strict_objects(schema: &Value) -> Value {
    let mut out = schema.clone();
    close(&mut out, true);
    out
}

fn close(schema: &mut Value, closable: bool) {
    let Some(obj) = schema.as_object_mut() else {
        return;
    };
    for key in SCHEMA_MAPS {
        if let Some(Value::Object(map)) = obj.get_mut(key) {
            map.values_mut().for_each(|s| close(s, true));
        }
    }
    for key in SCHEMA_ONE {
        if let Some(s @ Value::Object(_)) = obj.get_mut(key) {
            close(s, true);
        }
    }
    for key in SCHEMA_LISTS {
        if let Some(Value::Array(list)) = obj.get_mut(key) {
            list.iter_mut().for_each(|s| close(s, key != "allOf"));
        }
    }
    let names_keys = obj.contains_key("properties") || obj.contains_key("patternProperties");
    let says_so =
        obj.contains_key("additionalProperties") || obj.contains_key("unevaluatedProperties");
    if closable && names_keys && !says_so {
        obj.insert("additionalProperties".into(), Value::Bool(false));
    }
}

#[cfg(test)]
mod tests {
    use super::strict_objects;
    use serde_json::{Value, json};

    /// Every object schema position of `v` (a schema), found by the same keyword lists but
    /// independently of `close`: whether each names keys and whether it is closed.
    fn objects<'a>(v: &'a Value, out: &mut Vec<&'a Value>) {
        let Some(obj) = v.as_object() else { return };
        if obj.contains_key("properties") {
            out.push(v);
        }
        for (k, sub) in obj {
            match (k.as_str(), sub) {
                ("properties" | "$defs", Value::Object(m)) => {
                    m.values().for_each(|s| objects(s, out))
                }
                ("items" | "additionalProperties", s) => objects(s, out),
                ("anyOf" | "oneOf", Value::Array(l)) => l.iter().for_each(|s| objects(s, out)),
                _ => {}
            }
        }
    }

    /// Generated nestings: every object that names properties comes out closed, one that
    /// says `additionalProperties` keeps its word, and nothing else changes.
    #[test]
    fn every_generated_object_is_closed_unless_it_says_otherwise() {
        // A 64-bit LCG (Knuth's constants): generated shapes, no dependency.
        let mut seed = 0x5eed_u64;
        let mut next = |n: u64| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) % n
        };
        fn build(depth: u32, next: &mut dyn FnMut(u64) -> u64) -> Value {
            if depth == 0 {
                let kind = ["string", "integer", "boolean"][next(3) as usize];
                return json!({ "type": kind });
            }
            match next(4) {
                0 => json!({"type": "array", "items": build(depth - 1, next)}),
                1 => json!({"anyOf": [build(depth - 1, next), build(depth - 1, next)]}),
                _ => {
                    let mut props = serde_json::Map::new();
                    for i in 0..1 + next(3) {
                        // Property names that are keywords must stay names.
                        let name = ["properties", "items", "a", "additionalProperties"]
                            [next(4) as usize]
                            .to_string();
                        props.insert(format!("{name}{i}"), build(depth - 1, next));
                        if next(3) == 0 {
                            props.insert(name, build(depth - 1, next));
                        }
                    }
                    let mut o = json!({"type": "object", "properties": props});
                    if next(4) == 0 {
                        o["additionalProperties"] = json!(next(2) == 0);
                    }
                    o
                }
            }
        }
        for _ in 0..200 {
            let schema = build(1 + next(4) as u32, &mut next);
            let strict = strict_objects(&schema);
            let (mut before, mut after) = (Vec::new(), Vec::new());
            objects(&schema, &mut before);
            objects(&strict, &mut after);
            assert_eq!(before.len(), after.len(), "{schema}");
            for (b, a) in before.iter().zip(&after) {
                let want = b
                    .get("additionalProperties")
                    .cloned()
                    .unwrap_or(json!(false));
                assert_eq!(a["additionalProperties"], want, "{schema}");
                assert_eq!(
                    a["properties"].as_object().unwrap().len(),
                    b["properties"].as_object().unwrap().len()
                );
            }
        }
    }

    #[test]
    fn all_of_members_stay_open_and_their_nested_objects_close() {
        let schema = json!({"allOf": [
            {"properties": {"a": {"type": "object", "properties": {"x": {"type": "integer"}}}}},
            {"properties": {"b": {"type": "integer"}}}
        ], "$defs": {"P": {"properties": {"c": {}}, "unevaluatedProperties": true}}});
        let s = strict_objects(&schema);
        assert!(s["allOf"][0].get("additionalProperties").is_none(), "{s}");
        assert!(s["allOf"][1].get("additionalProperties").is_none(), "{s}");
        assert_eq!(
            s["allOf"][0]["properties"]["a"]["additionalProperties"],
            json!(false)
        );
        assert!(s["$defs"]["P"].get("additionalProperties").is_none(), "{s}");
        // Not a schema: left as it is.
        assert_eq!(strict_objects(&json!(true)), json!(true));
        assert_eq!(
            strict_objects(&json!({"type": "object"})),
            json!({"type": "object"})
        );
    }
}
