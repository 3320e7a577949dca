//! Explicit runs (`skein explicit`, `extractor.initial_load`): publish
//! aggregates on demand through the same outbox, versioning and ordering as
//! the stream.
//!
//! A run selects root keys of one entity (all of them, a key list, or a
//! filter on the root) and queues them in the sidecar, a chunk per
//! transaction together with the run's cursor, so a killed run resumes
//! after its last chunk. Each key is queued for the partition the stream
//! keys its aggregate by; that partition's applier takes its queued keys
//! between deliveries and publishes them in its own fenced batch
//! transaction, which also takes them off the queue ([`Applier::explicit_once`]).
//!
//! Consistency with a stream running at the same time: events carry state,
//! not changes, and the state is read when the event is built. Every event
//! of an aggregate, streamed or explicit, is built and committed by the one
//! applier of its partition, one batch after the other, each from a
//! snapshot read after the previous batch committed; so no explicit event
//! can carry an older state than the event before it, and a change after
//! the read reaches the same applier later and publishes its state then.
//! DBLog's low/high watermarks exist to stop a snapshot's *rows* from
//! overwriting newer log events; here no row read by the selection is ever
//! published (only its key is queued), so no watermark window is needed.
//!
//! [`Applier::explicit_once`]: crate::Applier::explicit_once

use serde::{Deserialize, Serialize};
use skein_common::config::Config;
use skein_common::failpoint::failpoint;
use skein_common::record::{partition_for, transport_key};
use skein_common::RootKey;
use skein_sql::Catalog;

use crate::error::{Error, Result};
use crate::hydrate::Source;
use crate::sidecar::{ExplicitChunk, ExplicitRun, NewRun, Sidecar};

/// What an explicit run selects of its entity.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Selection {
    /// Every aggregate (`--entity` alone, or the initial load).
    All,
    /// These root keys (`--keys`, `--keys-from`), in the given order.
    Keys(Vec<RootKey>),
    /// Roots matching an SQL condition (`--where`).
    Where(String),
}

impl Selection {
    /// The stored form (`explicit_run.selection`): a repeated command with
    /// the same selection finds its unfinished run by it.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a selection always serializes")
    }

    /// Parses [`Selection::to_json`].
    pub fn from_json(s: &str) -> Result<Selection> {
        serde_json::from_str(s)
            .map_err(|e| Error::Data(format!("stored explicit selection `{s}`: {e}")))
    }
}

/// Parses one key as given on the command line or in a keys file: a JSON
/// array of the key's column values for a composite key (`[1, "EU"]`),
/// else the one column's value as text (`42`, `"42"` unquoted).
pub fn parse_key(text: &str, columns: usize) -> std::result::Result<RootKey, String> {
    let t = text.trim();
    let values: Vec<Option<String>> = if t.starts_with('[') {
        let v: Vec<serde_json::Value> =
            serde_json::from_str(t).map_err(|e| format!("key `{t}` is not a JSON array: {e}"))?;
        v.into_iter()
            .map(|x| match x {
                serde_json::Value::Null => None,
                serde_json::Value::String(s) => Some(s),
                other => Some(other.to_string()),
            })
            .collect()
    } else {
        vec![Some(t.trim_matches('"').to_string())]
    };
    if values.len() != columns {
        return Err(format!(
            "key `{t}` has {} value(s); the entity's root key has {columns} column(s) \
             (write a composite key as a JSON array, e.g. [1, \"EU\"])",
            values.len()
        ));
    }
    Ok(RootKey(values))
}

/// One explicit run being queued.
pub struct Run<'a> {
    /// The configuration.
    pub cfg: &'a Config,
    /// The source catalog (the root's key columns and types).
    pub catalog: &'a Catalog,
    /// The progress topic the appliers key their work by.
    pub topic: String,
    /// Entity name.
    pub entity: String,
    /// What it selects.
    pub selection: Selection,
    /// Publish even when the etag is unchanged.
    pub republish: bool,
    /// Started by `extractor.initial_load`.
    pub initial: bool,
    /// Keys per chunk (one sidecar transaction each).
    pub chunk: usize,
}

impl Run<'_> {
    /// Finds the unfinished identical run to resume, or creates one.
    pub async fn start<S: Sidecar>(&self, sidecar: &mut S) -> Result<ExplicitRun> {
        if !self.cfg.entities.iter().any(|e| e.name == self.entity) {
            return Err(Error::Data(format!(
                "no entity `{}` in the config (entities: {})",
                self.entity,
                self.cfg
                    .entities
                    .iter()
                    .map(|e| e.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        sidecar
            .explicit_start(&NewRun {
                group: self.cfg.name.clone(),
                entity: self.entity.clone(),
                selection: self.selection.to_json(),
                republish: self.republish,
                initial: self.initial,
            })
            .await
    }

    /// Queues the run's keys after its cursor, a chunk per transaction,
    /// until the selection is exhausted; `progress` hears the total queued
    /// after each chunk. Returns the total queued.
    pub async fn queue<S: Sidecar>(
        &self,
        run: &ExplicitRun,
        sidecar: &mut S,
        source: &mut Source,
        mut progress: impl FnMut(i64),
    ) -> Result<i64> {
        let entity = self
            .cfg
            .entities
            .iter()
            .find(|e| e.name == self.entity)
            .ok_or_else(|| Error::Data(format!("no entity `{}` in the config", self.entity)))?;
        let root = entity
            .nodes()
            .into_iter()
            .next()
            .ok_or_else(|| Error::Data(format!("entity `{}` has no root", self.entity)))?;
        let partitions = self.cfg.transport.partitions();
        let chunk = self.chunk.max(1);
        let mut cursor = run.cursor.clone();
        let mut queued = run.queued;
        loop {
            let (keys, next, done) = match &self.selection {
                Selection::Keys(list) => {
                    let start = match &cursor {
                        Some(c) => c.parse::<usize>().map_err(|_| {
                            Error::Data(format!(
                                "explicit run {}: cursor `{c}` is no index",
                                run.id
                            ))
                        })?,
                        None => 0,
                    };
                    let end = (start + chunk).min(list.len());
                    let keys = source
                        .normalize_keys(
                            &root,
                            self.catalog,
                            list.get(start..end).unwrap_or_default(),
                        )
                        .await?;
                    (keys, Some(end.to_string()), end >= list.len())
                }
                Selection::All | Selection::Where(_) => {
                    let after = match &cursor {
                        Some(c) => Some(RootKey::from_canonical(c).ok_or_else(|| {
                            Error::Data(format!("explicit run {}: cursor `{c}` is no key", run.id))
                        })?),
                        None => None,
                    };
                    let filter = match &self.selection {
                        Selection::Where(f) => Some(f.as_str()),
                        _ => None,
                    };
                    let keys = source
                        .root_keys(&root, self.catalog, filter, after.as_ref(), chunk as i64)
                        .await?;
                    let next = keys.last().map(RootKey::canonical).or(cursor.clone());
                    let done = keys.len() < chunk;
                    (keys, next, done)
                }
            };
            let items: Vec<(u32, String)> = keys
                .iter()
                .map(|k| {
                    (
                        partition_for(&transport_key(&self.entity, k), partitions),
                        k.canonical(),
                    )
                })
                .collect();
            let n = items.len() as i64;
            sidecar
                .explicit_enqueue(&ExplicitChunk {
                    run: run.id,
                    group: self.cfg.name.clone(),
                    topic: self.topic.clone(),
                    entity: self.entity.clone(),
                    republish: self.republish,
                    from: cursor.clone(),
                    to: next.clone(),
                    keys: items,
                    done,
                })
                .await?;
            queued += n;
            progress(queued);
            if done {
                return Ok(queued);
            }
            failpoint("explicit.after_chunk");
            cursor = next;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_parse_as_one_value_or_a_json_array() {
        assert_eq!(
            parse_key(" 42 ", 1).unwrap(),
            RootKey(vec![Some("42".into())])
        );
        assert_eq!(
            parse_key("[1, \"EU\", null]", 3).unwrap(),
            RootKey(vec![Some("1".into()), Some("EU".into()), None])
        );
        let e = parse_key("[1]", 2).unwrap_err();
        assert!(e.contains("2 column(s)"), "{e}");
        assert!(parse_key("[1,", 2).is_err());
    }

    #[test]
    fn a_selection_is_stored_and_read_back() {
        for s in [
            Selection::All,
            Selection::Keys(vec![RootKey(vec![Some("1".into())])]),
            Selection::Where("region = 'EU'".into()),
        ] {
            assert_eq!(Selection::from_json(&s.to_json()).unwrap(), s);
        }
    }
}
