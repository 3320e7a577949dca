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
    String::from_utf8(canonical_bytes(v)).expect("serde_json writes UTF-8")
}

/// The version hash (etag) of an entity value.
pub fn etag(v: &Value) -> String {
    hex::encode(Sha256::digest(canonical_bytes(v)))
}

fn canonical_bytes(v: &Value) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    write_canonical(v, &mut out);
    out
}

/// Appends the canonical JSON of `v` to `out`. Keys, strings and scalars
/// go through `serde_json`'s own compact writer, so each is written exactly
/// as `serde_json::to_string` writes it, without a string of its own.
fn write_canonical(v: &Value, out: &mut Vec<u8>) {
    match v {
        Value::Object(map) => write_object(map.iter(), out),
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(item, out);
            }
            out.push(b']');
        }
        other => write_scalar(other, out),
    }
}

/// Writes an object of `entries` with its keys sorted. serde_json's map
/// iterates in key order unless its `preserve_order` feature is on; only
/// then are the entries gathered and sorted here.
fn write_object<'a, I>(entries: I, out: &mut Vec<u8>)
where
    I: Iterator<Item = (&'a String, &'a Value)> + Clone,
{
    out.push(b'{');
    if entries.clone().map(|(k, _)| k).is_sorted() {
        write_entries(entries, out);
    } else {
        let mut sorted: Vec<(&String, &Value)> = entries.collect();
        sorted.sort_unstable_by(|a, b| a.0.cmp(b.0));
        write_entries(sorted.into_iter(), out);
    }
    out.push(b'}');
}

fn write_entries<'a>(entries: impl Iterator<Item = (&'a String, &'a Value)>, out: &mut Vec<u8>) {
    for (i, (k, v)) in entries.enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write_scalar(k, out);
        out.push(b':');
        write_canonical(v, out);
    }
}

fn write_scalar<T: serde::Serialize + ?Sized>(v: &T, out: &mut Vec<u8>) {
    serde_json::to_writer(out, v).expect("a JSON scalar serialises into memory");
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

    /// The writer before it wrote into one buffer: a string per key and
    /// scalar, keys sorted here. Kept to pin the bytes of the new one.
    fn reference(v: &Value) -> String {
        match v {
            Value::Object(map) => {
                let mut keys: Vec<&String> = map.keys().collect();
                keys.sort();
                let parts: Vec<String> = keys
                    .into_iter()
                    .map(|k| format!("{}:{}", Value::String(k.clone()), reference(&map[k])))
                    .collect();
                format!("{{{}}}", parts.join(","))
            }
            Value::Array(items) => {
                let parts: Vec<String> = items.iter().map(reference).collect();
                format!("[{}]", parts.join(","))
            }
            other => other.to_string(),
        }
    }

    #[test]
    fn canonical_json_writes_what_the_string_per_value_writer_wrote() {
        let values = [
            json!(null),
            json!(true),
            json!(-0.0),
            json!(1.5e300),
            json!(0.1),
            json!(u64::MAX),
            json!(i64::MIN),
            json!(""),
            json!("quote \" backslash \\ tab \t nl \n nul \u{0} del \u{7f} é 😀 \u{2028}"),
            json!({}),
            json!([]),
            json!({"Z": 1, "a": 2, "B": [3, {"é": 4, "e": 5, "\u{1}": null}], "": {"": ""}}),
            json!([[[]], [{}], {"k\"ey": [1.0, -1, "x"]}]),
        ];
        for v in values {
            assert_eq!(canonical_json(&v), reference(&v), "{v:?}");
        }
    }

    #[test]
    fn an_object_whose_entries_come_unsorted_is_written_sorted() {
        // serde_json's own maps come sorted (no `preserve_order`): this is
        // the path a dependency turning that feature on would take.
        let (b, a, e, ee) = (
            "b".to_string(),
            "a".to_string(),
            "é".to_string(),
            "e".to_string(),
        );
        let (one, two) = (json!(1), json!({"y": [2], "x": null}));
        let entries = [(&b, &one), (&e, &two), (&a, &two), (&ee, &one)];
        let mut out = vec![];
        write_object(entries.iter().copied(), &mut out);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            r#"{"a":{"x":null,"y":[2]},"b":1,"e":1,"é":{"x":null,"y":[2]}}"#
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
