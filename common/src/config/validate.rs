//! From the serde layer to the typed model: every check that needs no I/O,
//! each error naming the field and its line in the file.

use super::raw::{RawConfig, SinkKind, TransportKind};
use super::*;

impl RawConfig {
    /// Checks what needs no I/O and builds the typed [`Config`]; an error
    /// names the field and, when `text` (the file) is given, its line.
    pub(crate) fn validate(self, text: &str, file: &str) -> Result<Config> {
        let err = |path: &[PathStep], message: String| Error::ConfigInvalid {
            file: file.into(),
            field: render_path(path),
            line: locate_line(text, path),
            message,
        };
        use PathStep::{Idx, Key};
        if !is_identifier(&self.name) {
            return Err(err(
                &[Key("name")],
                "use letters, digits, `_`, `-` or `.` only".into(),
            ));
        }
        if self.source.kind == SourceKind::Postgres {
            for (field, v) in [
                ("slot", &self.source.slot),
                ("publication", &self.source.publication),
            ] {
                if !is_identifier(v) || v.contains(['-', '.']) {
                    return Err(err(
                        &[Key("source"), Key(field)],
                        format!("`{v}` must be a plain identifier (letters, digits, `_`)"),
                    ));
                }
            }
        }
        if self.source.kind == SourceKind::Sqlserver && self.source.poll_interval_ms == 0 {
            return Err(err(
                &[Key("source"), Key("poll_interval_ms")],
                "must be at least 1".into(),
            ));
        }
        if let Some(tz) = &self.source.time_zone {
            let field = [Key("source"), Key("time_zone")];
            if self.source.kind != SourceKind::Sqlserver {
                return Err(err(
                    &field,
                    "only a SQL Server source takes a time zone (PostgreSQL's commit times \
                     are UTC already); remove it"
                        .into(),
                ));
            }
            if tz.trim().is_empty() || tz.trim() != tz || tz.chars().count() > 128 {
                return Err(err(
                    &field,
                    format!(
                        "`{tz}` is not a time zone name: give the server's Windows time zone \
                         as `SELECT name FROM sys.time_zone_info` lists it, e.g. \
                         `W. Europe Standard Time` (at most 128 characters, no leading or \
                         trailing spaces)"
                    ),
                ));
            }
            if tz.chars().any(char::is_control) {
                return Err(err(
                    &field,
                    "a time zone name has no control characters".into(),
                ));
            }
            if tz.contains('/') {
                return Err(err(
                    &field,
                    format!(
                        "`{tz}` looks like an IANA name; SQL Server names time zones as Windows \
                         does (`SELECT name FROM sys.time_zone_info`), e.g. `W. Europe Standard \
                         Time` for Europe/Berlin, `Eastern Standard Time` for America/New_York"
                    ),
                ));
            }
        }
        if self.transport.partitions == 0 || self.transport.partitions > 1024 {
            return Err(err(
                &[Key("transport"), Key("partitions")],
                "must be between 1 and 1024".into(),
            ));
        }
        if self.transport.channel_capacity == 0 {
            return Err(err(
                &[Key("transport"), Key("channel_capacity")],
                "must be at least 1".into(),
            ));
        }
        if self.transport.kind == TransportKind::Kafka
            && (self.transport.brokers.is_none() || self.transport.topic.is_none())
        {
            return Err(err(
                &[Key("transport"), Key("kind")],
                "kind `kafka` needs `brokers` and `topic`".into(),
            ));
        }
        if self.sink.kind == SinkKind::File && self.sink.path.is_none() {
            return Err(err(
                &[Key("sink"), Key("path")],
                "sink kind `file` needs `path`".into(),
            ));
        }
        if self.sink.kind == SinkKind::Kafka && self.sink.topic_prefix.is_none() {
            return Err(err(
                &[Key("sink"), Key("topic_prefix")],
                "sink kind `kafka` needs `topic_prefix`".into(),
            ));
        }
        if self.transport.kind == TransportKind::Kafka {
            // The change producer must never fail one record alone: a
            // record that failed while a later one of its partition was
            // written leaves a gap the appliers cannot see (they drop the
            // re-sent record as applied). librdkafka guarantees that only
            // with `enable.gapless.guarantee`, no message timeout and
            // retries without end.
            for (prop, ok) in [
                ("message.timeout.ms", "0"),
                ("delivery.timeout.ms", "0"),
                ("enable.gapless.guarantee", "true"),
                ("enable.idempotence", "true"),
                // Retries without end: a record whose retries ran out on
                // transient errors fails alone, gapless or not.
                ("retries", "2147483647"),
                ("message.send.max.retries", "2147483647"),
            ] {
                if let Some(v) = self.transport.kafka_properties.get(prop) {
                    if v.expose() != ok {
                        return Err(err(
                            &[Key("transport"), Key("kafka_properties"), Key(prop)],
                            format!(
                                "skein's change producer needs `{prop}: \"{ok}\"` (its default; \
                                 remove the property): otherwise a record that fails while a \
                                 later one of its partition is written leaves a gap the \
                                 appliers cannot see, and its change is lost"
                            ),
                        ));
                    }
                }
            }
        }
        if self.transport.kind == TransportKind::Kafka && self.transport.max_batch_records == 0 {
            return Err(err(
                &[Key("transport"), Key("max_batch_records")],
                "must be at least 1".into(),
            ));
        }
        if self.transport.kind == TransportKind::Kafka && self.transport.records_per_message == 0 {
            return Err(err(
                &[Key("transport"), Key("records_per_message")],
                "must be at least 1 (1: each change record in a message of its own)".into(),
            ));
        }
        if self.sink.kind == SinkKind::Kafka && self.sink.brokers.is_none() {
            return Err(err(
                &[Key("sink"), Key("brokers")],
                "sink kind `kafka` needs `brokers`".into(),
            ));
        }
        if self.sink.kind == SinkKind::Kafka {
            if let Some(i) = self.entities.iter().position(|e| e.name == "dlq") {
                return Err(err(
                    &[Key("entities"), Idx(i), Key("name")],
                    "`dlq` would share the Kafka sink's dead-letter topic `<topic_prefix>.dlq`; \
                     rename the entity"
                        .into(),
                ));
            }
        }
        if self.sink.relay_batch < 1 {
            return Err(err(
                &[Key("sink"), Key("relay_batch")],
                "must be at least 1".into(),
            ));
        }
        if self.metrics.refresh_ms == 0 {
            return Err(err(
                &[Key("metrics"), Key("refresh_ms")],
                "must be at least 1".into(),
            ));
        }
        if let Some(a) = &self.metrics.addr {
            if a.rsplit_once(':')
                .is_none_or(|(h, p)| h.is_empty() || p.parse::<u16>().is_err())
            {
                return Err(err(
                    &[Key("metrics"), Key("addr")],
                    format!("`{a}` is not HOST:PORT (e.g. 0.0.0.0:9187)"),
                ));
            }
        }
        if self.sink.relay_poll_ms == 0 {
            return Err(err(
                &[Key("sink"), Key("relay_poll_ms")],
                "must be at least 1".into(),
            ));
        }
        if self.extractor.max_batch_changes == 0 {
            return Err(err(
                &[Key("extractor"), Key("max_batch_changes")],
                "must be at least 1".into(),
            ));
        }
        if self.extractor.max_batches_in_flight == 0 {
            return Err(err(
                &[Key("extractor"), Key("max_batches_in_flight")],
                "must be at least 1 (1: each batch waits for the one before)".into(),
            ));
        }
        let f = self.extractor.retention_warn_fraction;
        if !(f > 0.0 && f <= 1.0) {
            return Err(err(
                &[Key("extractor"), Key("retention_warn_fraction")],
                format!("must be above 0 and at most 1 (got {f})"),
            ));
        }
        if self.entities.is_empty() {
            return Err(err(
                &[Key("entities")],
                "configure at least one entity".into(),
            ));
        }
        for (ei, e) in self.entities.iter().enumerate() {
            let at = |rest: &[PathStep]| {
                let mut p = vec![Key("entities"), Idx(ei)];
                p.extend_from_slice(rest);
                p
            };
            if !is_identifier(&e.name) {
                return Err(err(
                    &at(&[Key("name")]),
                    "use letters, digits, `_`, `-` or `.` only".into(),
                ));
            }
            if self.entities[..ei].iter().any(|o| o.name == e.name) {
                return Err(err(
                    &at(&[Key("name")]),
                    format!("entity `{}` is configured twice", e.name),
                ));
            }
            if e.global_id_column.is_some() && !e.identifier_mapping {
                return Err(err(
                    &at(&[Key("global_id_column")]),
                    "needs `identifier_mapping: true` on the entity".into(),
                ));
            }
            if matches!(&e.key, Some(k) if k.is_empty()) {
                return Err(err(
                    &at(&[Key("key")]),
                    "must name at least one column".into(),
                ));
            }
            if !e.include_columns.is_empty() && !e.exclude_columns.is_empty() {
                return Err(err(
                    &at(&[Key("exclude_columns")]),
                    "use include_columns or exclude_columns, not both".into(),
                ));
            }
            let mut seen_names = vec![e.name.as_str()];
            for (ji, j) in e.joins.iter().enumerate() {
                let jat = |f: &'static str| at(&[Key("joins"), Idx(ji), Key(f)]);
                if seen_names.contains(&j.name.as_str()) {
                    return Err(err(
                        &jat("name"),
                        format!(
                            "join name `{}` is used twice in entity `{}`",
                            j.name, e.name
                        ),
                    ));
                }
                seen_names.push(&j.name);
                if e.resolve_parent(ji).is_none() {
                    return Err(err(
                        &jat("join_to"),
                        format!(
                            "`{}` is neither the root table `{}` nor a join declared above this one",
                            j.join_to.as_deref().unwrap_or_default(),
                            e.table
                        ),
                    ));
                }
                if j.on.is_empty() {
                    return Err(err(
                        &jat("on"),
                        "a join needs at least one column pair".into(),
                    ));
                }
                if matches!(&j.key, Some(k) if k.is_empty()) {
                    return Err(err(
                        &jat("key"),
                        "must name at least one column (leave it out for the primary key)".into(),
                    ));
                }
                if !j.include_columns.is_empty() && !j.exclude_columns.is_empty() {
                    return Err(err(
                        &jat("exclude_columns"),
                        "use include_columns or exclude_columns, not both".into(),
                    ));
                }
            }
        }
        Ok(self.into_model())
    }

    /// The typed model of a validated file: what validation guaranteed
    /// (a Kafka transport's brokers and topic, a file sink's path, …) is
    /// no longer optional.
    fn into_model(self) -> Config {
        let s = self.source;
        let source = match s.kind {
            SourceKind::Postgres => Source::Postgres(PostgresSource {
                url: s.url,
                slot: s.slot,
                publication: s.publication,
            }),
            SourceKind::Sqlserver => Source::SqlServer(SqlServerSource {
                url: s.url,
                capture_instances: s.capture_instances,
                poll_interval_ms: s.poll_interval_ms,
                time_zone: s.time_zone,
            }),
        };
        let t = self.transport;
        let transport = match (t.kind, t.brokers, t.topic) {
            (TransportKind::Kafka, Some(brokers), Some(topic)) => {
                Transport::Kafka(KafkaTransport {
                    partitions: t.partitions,
                    brokers,
                    topic,
                    replication_factor: t.replication_factor,
                    group: t.group.unwrap_or_else(|| format!("skein-{}", self.name)),
                    max_batch_records: t.max_batch_records,
                    records_per_message: t.records_per_message,
                    batch_wait_ms: t.batch_wait_ms,
                    relay_in_apply: t.relay_in_apply,
                    kafka_properties: t.kafka_properties,
                })
            }
            // Validation refused a Kafka transport without both.
            _ => Transport::InProcess(InProcessTransport {
                partitions: t.partitions,
                channel_capacity: t.channel_capacity,
            }),
        };
        let k = self.sink;
        let sink = match (k.kind, k.path, k.brokers, k.topic_prefix) {
            (SinkKind::File, Some(path), _, _) => Sink::File {
                path,
                also_stdout: k.also_stdout,
            },
            (SinkKind::Kafka, _, Some(brokers), Some(topic_prefix)) => Sink::Kafka {
                brokers,
                topic_prefix,
                mode: k.mode,
                kafka_properties: k.kafka_properties,
            },
            // Validation refused a file sink without a path and a Kafka
            // sink without brokers or a prefix.
            _ => Sink::Stdout,
        };
        Config {
            name: self.name,
            source,
            sidecar: self.sidecar,
            transport,
            sink,
            relay_batch: k.relay_batch,
            relay_poll_ms: k.relay_poll_ms,
            on_reject: k.on_reject,
            events: self.events,
            state_dir: self.state_dir,
            extractor: self.extractor,
            metrics: self.metrics,
            entities: self.entities,
        }
    }
}

pub(crate) fn is_identifier(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
}

/// One step of a field path.
#[derive(Clone, Copy, Debug)]
enum PathStep {
    Key(&'static str),
    Idx(usize),
}

fn render_path(path: &[PathStep]) -> String {
    let mut s = String::new();
    for step in path {
        match step {
            PathStep::Key(k) => {
                if !s.is_empty() {
                    s.push('.');
                }
                s.push_str(k);
            }
            PathStep::Idx(i) => s.push_str(&format!("[{i}]")),
        }
    }
    s
}

/// Finds the 1-based line of a field in block-style YAML by indentation.
/// Flow mappings (`{ a: 1 }`) resolve to the line they are on. Returns
/// `None` when the field is not written in the file (e.g. a default).
fn locate_line(text: &str, path: &[PathStep]) -> Option<usize> {
    let lines: Vec<&str> = text.lines().collect();
    // (line index, column of the node's first key)
    let mut start = 0usize;
    let mut end = lines.len();
    let mut found: Option<usize> = None;
    let significant = |l: &str| {
        let t = l.trim_start();
        !t.is_empty() && !t.starts_with('#')
    };
    let indent = |l: &str| l.len() - l.trim_start().len();
    for step in path {
        let body: Vec<usize> = (start..end).filter(|i| significant(lines[*i])).collect();
        match step {
            PathStep::Key(k) => {
                // Keys of this mapping sit at the smallest key column in range.
                let key_col = |l: &str| {
                    let t = l.trim_start();
                    let dash = t
                        .strip_prefix("- ")
                        .map(|r| r.len() - r.trim_start().len() + 2);
                    indent(l) + dash.unwrap_or(0)
                };
                if let Some(f) = found {
                    if lines[f].contains('{') && lines[f].contains(&format!("{k}:")) {
                        return Some(f + 1);
                    }
                }
                let col = body.iter().map(|i| key_col(lines[*i])).min()?;
                let hit = body.iter().copied().find(|i| {
                    let l = lines[*i];
                    key_col(l) == col
                        && l[col..].starts_with(k)
                        && l[col + k.len()..].trim_start().starts_with(':')
                })?;
                let next = body
                    .iter()
                    .copied()
                    .find(|i| *i > hit && key_col(lines[*i]) <= col)
                    .unwrap_or(end);
                found = Some(hit);
                start = hit;
                end = next;
            }
            PathStep::Idx(n) => {
                let items: Vec<usize> = body
                    .iter()
                    .copied()
                    .filter(|i| lines[*i].trim_start().starts_with("- ") || lines[*i].trim() == "-")
                    .collect();
                let col = items.iter().map(|i| indent(lines[*i])).min()?;
                let items: Vec<usize> = items
                    .into_iter()
                    .filter(|i| indent(lines[*i]) == col)
                    .collect();
                let hit = *items.get(*n)?;
                let next = items.get(n + 1).copied().unwrap_or(end);
                found = Some(hit);
                start = hit;
                end = next;
            }
        }
    }
    found.map(|f| f + 1)
}
