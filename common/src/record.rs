//! The unit the transporter carries: one source change resolved to the
//! aggregate root it belongs to.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::position::ChangePosition;

/// What happened to a row, as seen by the root it belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    /// The row was inserted.
    Insert,
    /// The row was updated (or a child of the root changed).
    Update,
    /// The row was deleted.
    Delete,
    /// The table was truncated (`on_truncate: recheck`). The extractor
    /// sends one notice per partition ([`ChangeRecord::truncate_notice`]):
    /// it cannot name the rows, so each partition's applier re-checks the
    /// aggregates of the entity it published; gone → deleted.
    Truncate,
}

/// The primary key of an aggregate root, as the text the source prints for
/// each key column (`None` for SQL NULL), in key-column order.
///
/// Text is used on purpose: it is what both the change stream and a `::text`
/// cast in the hydration query give, so keys compare equal without knowing
/// column types.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RootKey(pub Vec<Option<String>>);

impl RootKey {
    /// Canonical, unambiguous form: a JSON array of strings/nulls.
    /// Used as the transport key and in the version table.
    pub fn canonical(&self) -> String {
        serde_json::to_string(&self.0).expect("a vector of strings always serializes")
    }

    /// Parses [`RootKey::canonical`] back.
    pub fn from_canonical(s: &str) -> Option<RootKey> {
        serde_json::from_str(s).ok().map(RootKey)
    }

    /// Whether any key column is NULL (such a key can never match a row).
    pub fn has_null(&self) -> bool {
        self.0.iter().any(Option::is_none)
    }
}

impl fmt::Display for RootKey {
    /// The user-facing form used in CloudEvent `subject` and `key`:
    /// composite keys joined with `,`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, v) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            f.write_str(v.as_deref().unwrap_or(""))?;
        }
        Ok(())
    }
}

/// One change resolved to its aggregate root: `{entity, root_key, table, op,
/// position, tx_id, commit_time}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChangeRecord {
    /// Entity name from the config.
    pub entity: String,
    /// The root the change belongs to.
    pub root_key: RootKey,
    /// `schema.table` the change was read from.
    pub table: String,
    /// The operation, from the root's point of view (a child change is an
    /// [`Op::Update`] of its root unless it is the root table itself).
    pub op: Op,
    /// Where the change is in the source order.
    pub position: ChangePosition,
    /// Source transaction id.
    pub tx_id: u64,
    /// Source commit time, microseconds since the Unix epoch.
    pub commit_time_micros: i64,
}

impl ChangeRecord {
    /// The transport key: entity plus canonical root key. Every change of one
    /// aggregate has the same key, so it lands in one partition, in order.
    pub fn transport_key(&self) -> String {
        transport_key(&self.entity, &self.root_key)
    }

    /// A TRUNCATE of `table` (of `entity`) addressed to `partition`: its
    /// root key is the partition number, as text. Sent to every partition,
    /// in the truncating transaction's order, so each applier re-checks the
    /// aggregates it owns after everything before the TRUNCATE.
    pub fn truncate_notice(
        entity: &str,
        table: &str,
        partition: u32,
        position: ChangePosition,
        tx_id: u64,
        commit_time_micros: i64,
    ) -> ChangeRecord {
        ChangeRecord {
            entity: entity.to_string(),
            root_key: RootKey(vec![Some(partition.to_string())]),
            table: table.to_string(),
            op: Op::Truncate,
            position,
            tx_id,
            commit_time_micros,
        }
    }

    /// The partition this record travels in: the hash of its transport key
    /// ([`partition_for`]), or for a truncate notice the partition it names.
    pub fn partition(&self, partitions: u32) -> u32 {
        if self.op == Op::Truncate {
            if let [Some(p)] = self.root_key.0.as_slice() {
                if let Ok(p) = p.parse::<u32>() {
                    if p < partitions {
                        return p;
                    }
                }
            }
        }
        partition_for(&self.transport_key(), partitions)
    }
}

/// See [`ChangeRecord::transport_key`].
pub fn transport_key(entity: &str, key: &RootKey) -> String {
    format!("{entity}\u{1f}{}", key.canonical())
}

/// Partition for a transport key: FNV-1a 64 over the key bytes, modulo the
/// partition count. Frozen: the in-process and Kafka transports must agree,
/// and changing it moves aggregates between partitions.
pub fn partition_for(key: &str, partitions: u32) -> u32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    (h % u64::from(partitions.max(1))) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_canonical_and_displayable() {
        let k = RootKey(vec![Some("1".into()), None, Some("a,b".into())]);
        assert_eq!(k.canonical(), r#"["1",null,"a,b"]"#);
        assert_eq!(RootKey::from_canonical(&k.canonical()), Some(k.clone()));
        assert_eq!(k.to_string(), "1,,a,b");
        assert!(k.has_null());
    }

    #[test]
    fn partitioning_is_frozen() {
        // Pinned values: changing the hash moves aggregates between partitions.
        let k = transport_key("customer", &RootKey(vec![Some("1".into())]));
        assert_eq!(partition_for(&k, 4), partition_for(&k, 4));
        let spread: std::collections::HashSet<u32> = (0..100)
            .map(|i| partition_for(&transport_key("c", &RootKey(vec![Some(i.to_string())])), 4))
            .collect();
        assert_eq!(spread.len(), 4, "100 keys must reach all 4 partitions");
        assert_eq!(partition_for("", 7), (0xcbf2_9ce4_8422_2325u64 % 7) as u32);
    }
}
