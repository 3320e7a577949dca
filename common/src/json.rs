//! Canonical JSON and the version hash.
//!
//! Frozen: the etag of an entity is `hex(SHA-256(canonical_json(entity)))`
//! where canonical JSON has object keys sorted by their UTF-8 bytes, no
//! insignificant white space, numbers as `serde_json` prints them and strings
//! escaped as `serde_json` escapes them. Value formats (timestamps, numerics,
//! bytes) are fixed earlier, when the source row is read; see the README.

use serde_json::Value;
use sha2::{Digest, Sha256};

/// Writes `v` as canonical JSON (sorted keys, compact), whatever the key
/// order of the maps inside it.
pub fn canonical_json(v: &Value) -> String {
    let mut out = String::new();
    write_canonical(v, &mut out);
    out
}

fn write_canonical(v: &Value, out: &mut String) {
    match v {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push(':');
                write_canonical(&map[k], out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// The version hash (etag) of an entity value.
pub fn etag(v: &Value) -> String {
    hex::encode(Sha256::digest(canonical_json(v).as_bytes()))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn canonical_json_sorts_keys_at_every_depth() {
        let a = json!({"b": 1, "a": {"z": [ {"y": 2, "x": 1} ], "c": null}, "é": "ü"});
        assert_eq!(
            canonical_json(&a),
            r#"{"a":{"c":null,"z":[{"x":1,"y":2}]},"b":1,"é":"ü"}"#
        );
    }

    #[test]
    fn etag_is_frozen() {
        // Pinned: changing the hash input is a migration (every stored version changes).
        let expected = "7c39773024ce083aff97c5f266e930a90a7801a330b614945e195ff450205016";
        assert_eq!(etag(&json!({"id": 1, "name": "x"})), expected);
        assert_eq!(etag(&json!({"name": "x", "id": 1})), expected);
        assert_ne!(etag(&json!({"name": "y", "id": 1})), expected);
    }
}
