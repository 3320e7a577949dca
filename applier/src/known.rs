//! The stored versions a partition owner knows without asking the sidecar.
//!
//! Only the applier that owns a partition writes the versions of its
//! aggregates, each in a fenced batch transaction: while it owns the
//! partition, what it read or wrote last *is* the stored version. So a
//! batch asks the sidecar only for the keys it does not know. The memory
//! is forgotten whenever another writer may have moved on: a fence, a
//! change of owner (the caller clears it, with the coverage memory), and
//! it holds only what committed (the caller records a batch's versions
//! after its transaction committed). A rewind (`skein replay`) that forgets
//! versions moves the progress too, so the running owner's next commit is
//! fenced and nothing it decided on the old versions is written.
//!
//! Bounded: past [`MAX_KEYS`] aggregates the memory starts over.

use std::collections::HashMap;

use crate::decide::Stored;

/// Aggregates remembered per partition at most.
pub const MAX_KEYS: usize = 50_000;

/// Per (entity, canonical key): the stored version, or `None` when none is
/// stored.
#[derive(Debug, Default)]
pub struct KnownVersions {
    /// Entity → key → version: looked up by borrowed names. Long-lived and
    /// keyed by the source's keys, so std's SipHash (not [`crate::FastMap`]).
    by_entity: HashMap<String, HashMap<String, Option<Stored>>>,
    /// Keys held, over every entity.
    len: usize,
}

impl KnownVersions {
    /// Forgets everything.
    pub fn clear(&mut self) {
        self.by_entity.clear();
        self.len = 0;
    }

    /// Of `keys` of `entity`: what is known (each key's version, `None`
    /// when none is stored), and the keys to read from the sidecar.
    pub fn split(
        &self,
        entity: &str,
        keys: &[String],
    ) -> (HashMap<String, Option<Stored>>, Vec<String>) {
        let mut known = HashMap::new();
        let mut unknown = vec![];
        let of_entity = self.by_entity.get(entity);
        for k in keys {
            match of_entity.and_then(|m| m.get(k)) {
                Some(v) => {
                    known.insert(k.clone(), v.clone());
                }
                None => unknown.push(k.clone()),
            }
        }
        (known, unknown)
    }

    /// Records versions as stored now (read from the sidecar, or written
    /// by a committed batch).
    pub fn record(&mut self, versions: impl IntoIterator<Item = (String, String, Option<Stored>)>) {
        for (entity, key, v) in versions {
            if self.len >= MAX_KEYS {
                self.clear();
            }
            if self
                .by_entity
                .entry(entity)
                .or_default()
                .insert(key, v)
                .is_none()
            {
                self.len += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(etag: &str) -> Option<Stored> {
        Some(Stored {
            etag: Some(etag.into()),
            is_deleted: false,
        })
    }

    #[test]
    fn known_keys_are_answered_and_the_rest_asked() {
        let mut k = KnownVersions::default();
        k.record([
            ("customer".into(), "[\"1\"]".into(), stored("a")),
            ("customer".into(), "[\"2\"]".into(), None),
            ("order".into(), "[\"3\"]".into(), stored("b")),
        ]);
        let keys: Vec<String> = ["[\"1\"]", "[\"2\"]", "[\"3\"]"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let (known, unknown) = k.split("customer", &keys);
        assert_eq!(known.len(), 2);
        assert_eq!(known["[\"1\"]"], stored("a"));
        assert_eq!(known["[\"2\"]"], None);
        assert_eq!(unknown, ["[\"3\"]"]);
        k.record([("customer".into(), "[\"1\"]".into(), stored("c"))]);
        assert_eq!(k.split("customer", &keys).0["[\"1\"]"], stored("c"));
        k.clear();
        assert_eq!(k.split("customer", &keys).1.len(), 3);
    }

    #[test]
    fn memory_is_bounded() {
        let mut k = KnownVersions::default();
        k.record((0..MAX_KEYS + 5).map(|i| ("e".to_string(), i.to_string(), None)));
        let held: usize = k.by_entity.values().map(|m| m.len()).sum();
        assert_eq!(held, k.len);
        assert!(held <= MAX_KEYS);
    }
}
