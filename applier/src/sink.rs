//! Sinks: where the relay sends events.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use skein_common::config::EventMode;

use crate::error::{Error, Result};

/// A destination for CloudEvents.
///
/// Contract: `send` returns `Ok` only once every event is durably handed
/// over (flushed and synced for files). A failed or interrupted `send` may
/// have delivered some events; the relay sends them again with the same id
/// (at-least-once), so receivers dedupe by event id.
/// A sink reports an event it will never take (too large, refused by the
/// broker) as [`Error::SinkRejected`], having delivered every other event
/// of the call; any other error is worth retrying (the broker is away, the
/// disk is full).
pub trait Sink: Send {
    /// Sends events, in order.
    fn send(&mut self, events: &[SinkEvent]) -> Result<()>;

    /// Records rejected events in this sink's dead letter (`sink.on_reject:
    /// dead_letter`), durably before returning.
    fn dead_letter(&mut self, rejected: &[Rejected]) -> Result<()> {
        Err(Error::SinkRejected {
            rejected: rejected.to_vec(),
            hint: "this sink has no dead letter",
        })
    }
}

/// An event a sink rejected for good.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejected {
    /// Its outbox row.
    pub outbox_id: i64,
    /// Its entity.
    pub entity: String,
    /// Why.
    pub reason: String,
}

impl Rejected {
    /// The dead-letter record: outbox id, entity and error as JSON. The
    /// event itself stays in the outbox row (it may be what was too large).
    pub fn record(&self) -> String {
        serde_json::json!({
            "outbox_id": self.outbox_id,
            "entity": self.entity,
            "error": self.reason,
        })
        .to_string()
    }
}

/// `sink.on_reject: dead_letter`: events the inner sink rejects go to its
/// dead letter and the relay goes on; any other failure passes through.
pub struct DeadLettering(pub Box<dyn Sink>);

impl Sink for DeadLettering {
    fn send(&mut self, events: &[SinkEvent]) -> Result<()> {
        match self.0.send(events) {
            Err(Error::SinkRejected { rejected, .. }) => {
                for r in &rejected {
                    tracing::warn!(outbox_id = r.outbox_id, entity = %r.entity, error = %r.reason, "the sink rejected an event; recorded in its dead letter");
                }
                // A dead letter that cannot be written would be retried
                // forever, re-sending the good events each time: stop.
                self.0.dead_letter(&rejected).map_err(|e| {
                    Error::Data(format!(
                        "recording rejected events in the sink's dead letter failed: {e}"
                    ))
                })?;
                metrics::counter!(skein_common::metrics::DEAD_LETTERS, "stage" => "sink")
                    .increment(rejected.len() as u64);
                Ok(())
            }
            other => other,
        }
    }
}

/// One outbox row on its way to a sink.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SinkEvent {
    /// The outbox row's id.
    pub outbox_id: i64,
    /// The entity (the Kafka sink's topic suffix).
    pub entity: String,
    /// The CloudEvent, structured JSON.
    pub event: String,
}

/// One JSON event per line on standard output.
pub struct StdoutSink;

impl Sink for StdoutSink {
    fn send(&mut self, events: &[SinkEvent]) -> Result<()> {
        let mut out = std::io::stdout().lock();
        for e in events {
            writeln!(out, "{}", e.event).map_err(io("writing to stdout"))?;
        }
        out.flush().map_err(io("flushing stdout"))
    }
}

/// JSON Lines file, appended to and synced on every send.
pub struct FileSink {
    file: File,
    path: PathBuf,
    echo_stdout: bool,
}

impl FileSink {
    /// Opens (creating) the file. A last line cut short by a crash is
    /// removed, so the file always holds whole events.
    pub fn open(path: &Path, echo_stdout: bool) -> Result<FileSink> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io("creating the sink directory"))?;
        }
        // Append mode: every write lands at the end, whatever else appends.
        let mut file = OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(path)
            .map_err(io("opening the sink file"))?;
        let len = file.metadata().map_err(io("reading the sink file"))?.len();
        if len > 0 {
            // Find the end of the last complete line.
            let mut keep = len;
            let mut buf = [0u8; 1];
            while keep > 0 {
                file.seek(SeekFrom::Start(keep - 1))
                    .map_err(io("reading the sink file"))?;
                file.read_exact(&mut buf)
                    .map_err(io("reading the sink file"))?;
                if buf[0] == b'\n' {
                    break;
                }
                keep -= 1;
            }
            if keep != len {
                tracing::warn!(path = %path.display(), cut = len - keep, "removing a partial last line left by a crash");
                file.set_len(keep).map_err(io("truncating the sink file"))?;
            }
        }
        file.seek(SeekFrom::End(0))
            .map_err(io("seeking the sink file"))?;
        Ok(FileSink {
            file,
            path: path.to_path_buf(),
            echo_stdout,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Sink for FileSink {
    fn send(&mut self, events: &[SinkEvent]) -> Result<()> {
        let mut buf = String::with_capacity(events.iter().map(|e| e.event.len() + 1).sum());
        for e in events {
            buf.push_str(&e.event);
            buf.push('\n');
        }
        self.file
            .write_all(buf.as_bytes())
            .map_err(io("writing the sink file"))?;
        self.file.sync_data().map_err(io("syncing the sink file"))?;
        if self.echo_stdout {
            StdoutSink.send(events)?;
        }
        Ok(())
    }

    /// `<path>.dlq`, one JSON record per line, synced.
    fn dead_letter(&mut self, rejected: &[Rejected]) -> Result<()> {
        let mut path = self.path.clone().into_os_string();
        path.push(".dlq");
        let mut f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(io("opening the sink's dead-letter file"))?;
        let text: String = rejected.iter().map(|r| r.record() + "\n").collect();
        f.write_all(text.as_bytes())
            .map_err(io("writing the sink's dead-letter file"))?;
        f.sync_data()
            .map_err(io("syncing the sink's dead-letter file"))
    }
}

/// Kafka sink: topic `{topic_prefix}.{entity}`, key = the event's `key`
/// attribute (one aggregate's events stay in order in one partition),
/// CloudEvents Kafka protocol binding in structured or binary mode.
/// Idempotent producer, `acks=all`; `send` returns only when the broker
/// acknowledged every event.
pub struct KafkaSink {
    producer: rdkafka::producer::ThreadedProducer<DeliveryLog>,
    topic_prefix: String,
    mode: EventMode,
}

/// How long a Kafka sink send waits for the broker; also its default
/// `message.timeout.ms`.
const FLUSH_WAIT: std::time::Duration = std::time::Duration::from_secs(50);

/// Collects delivery failures of a send: outbox id, whether the broker
/// will never take the event, and the error; counts the delivery reports,
/// so a send waits for them instead of sleeping.
#[derive(Default)]
pub struct DeliveryLog {
    failures: std::sync::Mutex<Vec<(i64, bool, String)>>,
    reports: std::sync::Mutex<u64>,
    reported: std::sync::Condvar,
}

impl DeliveryLog {
    /// How many delivery reports were served so far.
    fn reports(&self) -> u64 {
        self.reports.lock().map(|n| *n).unwrap_or_default()
    }

    /// Waits at most `max` for a report after the `seen`-th.
    fn wait_report(&self, seen: u64, max: std::time::Duration) {
        if let Ok(n) = self.reports.lock() {
            let _ = self.reported.wait_timeout_while(n, max, |n| *n == seen);
        }
    }
}

impl rdkafka::ClientContext for DeliveryLog {}

impl rdkafka::producer::ProducerContext for DeliveryLog {
    type DeliveryOpaque = Box<i64>;
    fn delivery(&self, result: &rdkafka::message::DeliveryResult<'_>, outbox_id: Box<i64>) {
        self.note(result, *outbox_id);
        if let Ok(mut n) = self.reports.lock() {
            *n += 1;
        }
        self.reported.notify_all();
    }
}

impl DeliveryLog {
    fn note(&self, result: &rdkafka::message::DeliveryResult<'_>, outbox_id: i64) {
        if let Err((e, m)) = result {
            if let Ok(mut f) = self.failures.lock() {
                f.push((
                    outbox_id,
                    is_permanent(e),
                    format!(
                        "{} [{}]: {e}",
                        rdkafka::Message::topic(m),
                        rdkafka::Message::partition(m)
                    ),
                ));
            }
        }
    }
}

/// Errors after which the broker will never take this one event as it is.
/// Authorisation, policy or topic errors are about every event of a topic
/// (an ACL slip, a missing topic), not one event: they are not rejections.
/// A broker refuses a whole record batch at once, so a rejection reported
/// by a delivery is confirmed by sending the event alone
/// ([`KafkaSink::confirm_rejections`]).
fn is_permanent(e: &rdkafka::error::KafkaError) -> bool {
    use rdkafka::types::RDKafkaErrorCode as C;
    matches!(
        e.rdkafka_error_code(),
        Some(C::MessageSizeTooLarge | C::InvalidMessageSize | C::InvalidRecord)
    )
}

impl KafkaSink {
    /// A producer for the configured brokers and pass-through properties.
    pub fn new(
        brokers: &str,
        properties: &std::collections::BTreeMap<String, skein_common::config::Secret>,
        topic_prefix: &str,
        mode: EventMode,
    ) -> Result<KafkaSink> {
        use skein_transporter::kafka::{client_config, reliable_producer_config};
        let mut config = reliable_producer_config(&client_config(brokers, properties));
        // Every delivery is settled (delivered or failed) within the flush
        // wait, so nothing of a failed send is still queued when it is retried.
        if !properties.contains_key("message.timeout.ms") {
            config.set("message.timeout.ms", FLUSH_WAIT.as_millis().to_string());
        }
        let producer = config
            .create_with_context(DeliveryLog::default())
            .map_err(|e| Error::Sink {
                message: format!("creating the kafka sink producer: {e}"),
                source: None,
            })?;
        Ok(KafkaSink {
            producer,
            topic_prefix: topic_prefix.into(),
            mode,
        })
    }

    /// The topic of an entity's events.
    pub fn topic(&self, entity: &str) -> String {
        format!("{}.{entity}", self.topic_prefix)
    }
}

/// The CloudEvents attributes that become `ce_` headers in binary mode.
const CE_ATTRIBUTES: [&str; 11] = [
    "specversion",
    "id",
    "source",
    "type",
    "subject",
    "time",
    "action",
    "etag",
    "key",
    "partitionkey",
    "correlationid",
];

/// One event as a Kafka message under the CloudEvents Kafka binding.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KafkaMessage {
    /// The message key: the event's `key` attribute.
    pub key: String,
    /// Headers, in order.
    pub headers: Vec<(String, String)>,
    /// The value.
    pub value: Vec<u8>,
}

/// Maps one structured event to its Kafka message: structured mode keeps
/// the event as the value; binary mode puts `data` in the value and every
/// other attribute in a `ce_` header.
pub fn kafka_binding(event: &str, mode: EventMode) -> Result<KafkaMessage> {
    let v: serde_json::Value = serde_json::from_str(event).map_err(|e| Error::Sink {
        message: format!("an outbox event is not JSON: {e}"),
        source: None,
    })?;
    // Every event skein writes has a string `key`; without one, every such
    // event would silently share the empty key (one partition, no order).
    let key = match v.get("key") {
        Some(serde_json::Value::String(k)) => k.clone(),
        other => {
            return Err(Error::Sink {
                message: format!(
                    "an outbox event has no string `key` attribute (found {})",
                    match other {
                        None => "none",
                        Some(serde_json::Value::Null) => "null",
                        Some(serde_json::Value::Bool(_)) => "a boolean",
                        Some(serde_json::Value::Number(_)) => "a number",
                        Some(serde_json::Value::Array(_)) => "an array",
                        Some(serde_json::Value::Object(_)) => "an object",
                        Some(serde_json::Value::String(_)) => unreachable!(),
                    }
                ),
                source: None,
            })
        }
    };
    let text = |a: &str| match &v[a] {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Null => None,
        other => Some(other.to_string()),
    };
    Ok(match mode {
        EventMode::Structured => KafkaMessage {
            key,
            headers: vec![(
                "content-type".into(),
                "application/cloudevents+json; charset=UTF-8".into(),
            )],
            value: event.as_bytes().to_vec(),
        },
        EventMode::Binary => {
            let mut headers: Vec<(String, String)> = CE_ATTRIBUTES
                .iter()
                .filter_map(|a| text(a).map(|t| (format!("ce_{a}"), t)))
                .collect();
            if let Some(ct) = text("datacontenttype") {
                headers.push(("content-type".into(), ct));
            }
            KafkaMessage {
                key,
                headers,
                value: v["data"].to_string().into_bytes(),
            }
        }
    })
}

impl KafkaSink {
    /// Enqueues one message for `outbox_id`, waiting while the queue is
    /// full; an error is returned as librdkafka gave it.
    fn enqueue(
        &self,
        topic: &str,
        key: &str,
        value: &[u8],
        headers: &[(String, String)],
        outbox_id: i64,
    ) -> std::result::Result<(), rdkafka::error::KafkaError> {
        use rdkafka::message::{Header, OwnedHeaders};
        use rdkafka::producer::BaseRecord;
        let mut h = OwnedHeaders::new_with_capacity(headers.len());
        for (k, v) in headers {
            h = h.insert(Header {
                key: k,
                value: Some(v.as_bytes()),
            });
        }
        let mut record = BaseRecord::with_opaque_to(topic, Box::new(outbox_id))
            .key(key)
            .payload(value)
            .headers(h);
        loop {
            match self.producer.send(record) {
                Ok(()) => return Ok(()),
                Err((
                    rdkafka::error::KafkaError::MessageProduction(
                        rdkafka::types::RDKafkaErrorCode::QueueFull,
                    ),
                    r,
                )) => {
                    record = r;
                    self.producer.poll(std::time::Duration::from_millis(10));
                }
                Err((err, _)) => return Err(err),
            }
        }
    }

    /// Waits until the broker acknowledged or refused everything enqueued;
    /// returns the refusals (outbox id, permanent, error). What is still
    /// queued after the wait is purged, so a retry never doubles it.
    fn settle(&self) -> Result<Vec<(i64, bool, String)>> {
        use rdkafka::producer::Producer;
        let flushed = self.flush(FLUSH_WAIT + std::time::Duration::from_secs(10));
        if let Some((code, reason)) = self.producer.client().fatal_error() {
            return Err(Error::Data(format!(
                "the Kafka sink producer failed for good ({code:?}: {reason}); restart the relay"
            )));
        }
        if let Err(e) = flushed {
            self.purge();
            return Err(Error::Sink {
                message: format!("waiting for the broker to acknowledge events: {e}"),
                source: None,
            });
        }
        Ok(self
            .producer
            .context()
            .failures
            .lock()
            .map(|mut f| std::mem::take(&mut *f))
            .unwrap_or_default())
    }
}

impl KafkaSink {
    /// Waits up to `max` until nothing enqueued is outstanding (every
    /// delivery report served), as `flush` does, but woken by the reports:
    /// the producer's polling thread serves them, and rdkafka's `flush` of a
    /// `ThreadedProducer` polls in steps of 100 ms that those reports never
    /// cut short, so each send waited about 100 ms for nothing.
    fn flush(&self, max: std::time::Duration) -> std::result::Result<(), String> {
        use rdkafka::producer::Producer;
        let deadline = std::time::Instant::now() + max;
        let ctx = self.producer.context();
        loop {
            let seen = ctx.reports();
            if self.producer.in_flight_count() == 0 {
                return Ok(());
            }
            if let Some((_, reason)) = self.producer.client().fatal_error() {
                return Err(reason);
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "{} event(s) still unacknowledged after {max:?}",
                    self.producer.in_flight_count()
                ));
            }
            // A report is counted just before its message is released, so
            // the last one may leave the count at 1 for a moment: look
            // again after a short wait even without a new report.
            ctx.wait_report(seen, left.min(std::time::Duration::from_millis(2)));
        }
    }
}

impl KafkaSink {
    /// Drops what is still queued (not in flight: the idempotent producer
    /// must see those through) and waits a moment for the purged messages'
    /// reports, so none of them is taken for a later send's.
    fn purge(&self) {
        use rdkafka::producer::{Producer, PurgeConfig};
        self.producer.purge(PurgeConfig::default().queue());
        let _ = self.flush(std::time::Duration::from_secs(5));
        if let Ok(mut f) = self.producer.context().failures.lock() {
            f.clear();
        }
    }

    /// A delivery that failed with a per-event error may have failed only
    /// because of its batch (a broker refuses whole batches): each such
    /// event is sent again alone, and is a rejection only if it fails the
    /// same way again.
    fn confirm_rejections(
        &self,
        events: &[SinkEvent],
        failures: Vec<(i64, bool, String)>,
    ) -> Result<Vec<(i64, bool, String)>> {
        if failures.len() < 2 || failures.iter().any(|(_, permanent, _)| !permanent) {
            return Ok(failures);
        }
        let mut confirmed = vec![];
        for (id, _, _) in failures {
            let Some(e) = events.iter().find(|e| e.outbox_id == id) else {
                continue;
            };
            let m = kafka_binding(&e.event, self.mode)?;
            self.enqueue(&self.topic(&e.entity), &m.key, &m.value, &m.headers, id)
                .map_err(|err| Error::Sink {
                    message: format!("sending outbox row {id} again alone: {err}"),
                    source: None,
                })?;
            confirmed.extend(self.settle()?);
        }
        Ok(confirmed)
    }
}

/// Every failure as a sink error: rejections only when all are permanent.
fn delivery_outcome(
    rejected: Vec<Rejected>,
    failures: Vec<(i64, bool, String)>,
    entity_of: impl Fn(i64) -> String,
) -> Result<()> {
    if failures.iter().any(|(_, permanent, _)| !permanent) {
        let all: Vec<String> = failures
            .iter()
            .map(|(id, _, e)| format!("outbox row {id}: {e}"))
            .collect();
        return Err(Error::Sink {
            message: format!("{} event(s) not delivered: {}", all.len(), all.join("; ")),
            source: None,
        });
    }
    let mut rejected = rejected;
    rejected.extend(failures.into_iter().map(|(id, _, reason)| Rejected {
        outbox_id: id,
        entity: entity_of(id),
        reason,
    }));
    if rejected.is_empty() {
        return Ok(());
    }
    rejected.sort_by_key(|r| r.outbox_id);
    Err(Error::SinkRejected {
        rejected,
        hint: "set `sink.on_reject: dead_letter` to record such events in the sink's dead letter and go on",
    })
}

impl Sink for KafkaSink {
    fn send(&mut self, events: &[SinkEvent]) -> Result<()> {
        use rdkafka::producer::Producer;
        if let Ok(mut f) = self.producer.context().failures.lock() {
            f.clear();
        }
        let mut rejected = vec![];
        for e in events {
            let reject = |reason: String| Rejected {
                outbox_id: e.outbox_id,
                entity: e.entity.clone(),
                reason,
            };
            let m = match kafka_binding(&e.event, self.mode) {
                Ok(m) => m,
                Err(err) => {
                    rejected.push(reject(err.to_string()));
                    continue;
                }
            };
            let topic = self.topic(&e.entity);
            match self.enqueue(&topic, &m.key, &m.value, &m.headers, e.outbox_id) {
                Ok(()) => {}
                Err(err) if is_permanent(&err) => rejected.push(reject(format!("{topic}: {err}"))),
                Err(err) => {
                    self.purge();
                    return Err(Error::Sink {
                        message: format!("enqueuing an event: {err}"),
                        source: None,
                    });
                }
            }
        }
        let failures = self.settle()?;
        let failures = self.confirm_rejections(events, failures)?;
        delivery_outcome(rejected, failures, |id| {
            events
                .iter()
                .find(|e| e.outbox_id == id)
                .map(|e| e.entity.clone())
                .unwrap_or_default()
        })
    }

    /// Topic `<topic_prefix>.dlq`: key the outbox id, value
    /// [`Rejected::record`].
    fn dead_letter(&mut self, rejected: &[Rejected]) -> Result<()> {
        let topic = format!("{}.dlq", self.topic_prefix);
        for r in rejected {
            let key = r.outbox_id.to_string();
            self.enqueue(&topic, &key, r.record().as_bytes(), &[], r.outbox_id)
                .map_err(|e| Error::Sink {
                    message: format!("sending outbox row {} to `{topic}`: {e}", r.outbox_id),
                    source: None,
                })?;
        }
        let failures = self.settle()?;
        if let Some((id, _, e)) = failures.first() {
            return Err(Error::Sink {
                message: format!("sending outbox row {id} to `{topic}`: {e}"),
                source: None,
            });
        }
        Ok(())
    }
}

fn io(what: &'static str) -> impl FnOnce(std::io::Error) -> Error {
    move |e| Error::Sink {
        message: format!("{what}: {e}"),
        source: Some(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kafka_binding_structured_and_binary() {
        let ev = r#"{"specversion":"1.0","id":"e1","source":"/s","type":"t.c.updated","subject":"c.1","time":"2024-01-01T00:00:00.000000Z","datacontenttype":"application/json","data":{"id":1},"action":"updated","etag":"ab","key":"1","partitionkey":"1","correlationid":"b1"}"#;
        let s = kafka_binding(ev, EventMode::Structured).unwrap();
        assert_eq!(s.key, "1");
        assert_eq!(s.value, ev.as_bytes());
        assert_eq!(
            s.headers[0].1,
            "application/cloudevents+json; charset=UTF-8"
        );
        let b = kafka_binding(ev, EventMode::Binary).unwrap();
        assert_eq!(b.value, br#"{"id":1}"#);
        let h: std::collections::HashMap<_, _> = b.headers.into_iter().collect();
        assert_eq!(h["ce_id"], "e1");
        assert_eq!(h["ce_type"], "t.c.updated");
        assert_eq!(h["ce_specversion"], "1.0");
        assert_eq!(h["ce_etag"], "ab");
        assert_eq!(h["content-type"], "application/json");
        assert!(!h.contains_key("ce_data"));
    }

    #[test]
    fn file_sink_appends_and_repairs_a_partial_line() {
        let p = std::env::temp_dir().join(format!("skein-sink-{}.jsonl", std::process::id()));
        std::fs::write(&p, "{\"a\":1}\n{\"b\":").unwrap();
        let mut s = FileSink::open(&p, false).unwrap();
        s.send(&[SinkEvent {
            outbox_id: 1,
            entity: "x".into(),
            event: "{\"c\":3}".into(),
        }])
        .unwrap();
        drop(s);
        assert_eq!(
            std::fs::read_to_string(&p).unwrap(),
            "{\"a\":1}\n{\"c\":3}\n"
        );
        let _ = std::fs::remove_file(&p);
    }

    /// A sink that rejects events whose text contains "big"; what it
    /// delivered and dead-lettered is shared with the test.
    #[derive(Clone, Default)]
    struct Picky(std::sync::Arc<std::sync::Mutex<(Vec<String>, Vec<String>)>>);

    impl Sink for Picky {
        fn send(&mut self, events: &[SinkEvent]) -> Result<()> {
            let mut rejected = vec![];
            for e in events {
                if e.event.contains("big") {
                    rejected.push(Rejected {
                        outbox_id: e.outbox_id,
                        entity: e.entity.clone(),
                        reason: "too large".into(),
                    });
                } else {
                    self.0.lock().unwrap().0.push(e.event.clone());
                }
            }
            if rejected.is_empty() {
                Ok(())
            } else {
                Err(Error::SinkRejected {
                    rejected,
                    hint: "h",
                })
            }
        }

        fn dead_letter(&mut self, rejected: &[Rejected]) -> Result<()> {
            self.0
                .lock()
                .unwrap()
                .1
                .extend(rejected.iter().map(Rejected::record));
            Ok(())
        }
    }

    #[test]
    fn dead_lettering_sets_rejected_events_aside_and_goes_on() {
        let ev = |id: i64, text: &str| SinkEvent {
            outbox_id: id,
            entity: "customer".into(),
            event: text.into(),
        };
        let events = [ev(7, "a"), ev(8, "big"), ev(9, "c")];
        let err = Picky::default().send(&events).unwrap_err().to_string();
        assert!(err.contains("outbox row 8 (customer): too large"), "{err}");
        let inner = Picky::default();
        DeadLettering(Box::new(inner.clone()))
            .send(&events)
            .unwrap();
        let (sent, dead) = inner.0.lock().unwrap().clone();
        assert_eq!(sent, vec!["a", "c"]);
        assert_eq!(
            dead,
            vec![r#"{"entity":"customer","error":"too large","outbox_id":8}"#]
        );
        // A sink without a dead letter refuses rather than dropping.
        let mut stdout = DeadLettering(Box::new(StdoutSink));
        assert!(stdout.0.dead_letter(&[]).is_err());
    }

    #[test]
    fn only_errors_about_one_event_are_permanent() {
        use rdkafka::error::KafkaError::MessageProduction as P;
        use rdkafka::types::RDKafkaErrorCode as C;
        assert!(is_permanent(&P(C::MessageSizeTooLarge)));
        assert!(is_permanent(&P(C::InvalidRecord)));
        for not in [
            C::TopicAuthorizationFailed,
            C::PolicyViolation,
            C::InvalidMessage,
            C::MessageTimedOut,
            C::UnknownTopicOrPartition,
        ] {
            assert!(!is_permanent(&P(not)), "{not:?}");
        }
    }

    #[test]
    fn only_permanent_delivery_failures_are_rejections() {
        let entity = |_| "customer".to_string();
        assert!(delivery_outcome(vec![], vec![], entity).is_ok());
        let transient = delivery_outcome(
            vec![],
            vec![
                (3, true, "too large".into()),
                (4, false, "timed out".into()),
            ],
            entity,
        );
        assert!(
            matches!(transient, Err(Error::Sink { .. })),
            "{transient:?}"
        );
        let permanent = delivery_outcome(vec![], vec![(3, true, "too large".into())], entity);
        let Err(Error::SinkRejected { rejected, .. }) = permanent else {
            panic!("{permanent:?}")
        };
        assert_eq!(rejected[0].outbox_id, 3);
    }

    /// Fuzz properties (see [`skein_common::fuzz`]): no stored event text
    /// makes the read-back into a Kafka message panic, hang or allocate out
    /// of proportion; an event skein built maps to the message it stands for.
    mod fuzz {
        use proptest::prelude::*;
        use serde_json::Value;
        use skein_common::fuzz::{arbitrary_bytes, check, config, mutated};
        use skein_common::RootKey;

        use super::*;
        use crate::decide::{Action, Decision};
        use crate::event::tests::customer_event;

        fn data() -> impl Strategy<Value = Value> {
            let leaf = prop_oneof![
                Just(Value::Null),
                any::<bool>().prop_map(Value::Bool),
                any::<i64>().prop_map(Value::from),
                "[ -~ü\"\\\\]{0,8}".prop_map(Value::String),
            ];
            leaf.prop_recursive(3, 16, 4, |inner| {
                prop_oneof![
                    prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                    prop::collection::btree_map("[a-z]{1,4}", inner, 0..4)
                        .prop_map(|m| Value::Object(m.into_iter().collect())),
                ]
            })
        }

        /// An event exactly as the applier builds it for the outbox.
        fn event() -> impl Strategy<Value = String> {
            (
                prop::collection::vec(prop::option::of("[ -~ü]{0,6}"), 1..3),
                data(),
                prop::option::of("[0-9a-f]{8}"),
                any::<i64>(),
            )
                .prop_map(|(key, data, etag, time)| {
                    let d = Decision {
                        action: if etag.is_some() {
                            Action::Updated
                        } else {
                            Action::Deleted
                        },
                        data,
                        etag,
                    };
                    customer_event(&RootKey(key), &d, time).to_string()
                })
        }

        const TOKENS: &[&[u8]] = &[
            b"{",
            b"}",
            b"[",
            b"]",
            b"\"",
            b",",
            b":",
            b"\\",
            b"\\u",
            b"\\ud800",
            b"null",
            b"1e999",
            b"-0",
            b"\"key\":",
            b"\"data\":",
            b"[[[[[[[[[[[[[[[[",
        ];

        fn run(text: &str) {
            check("outbox event", text.len(), || {
                for mode in [EventMode::Structured, EventMode::Binary] {
                    let _ = kafka_binding(text, mode);
                }
            });
        }

        proptest! {
            #![proptest_config(config())]

            #[test]
            fn arbitrary_text_is_a_message_or_an_error(b in arbitrary_bytes(128)) {
                run(&String::from_utf8_lossy(&b));
            }

            #[test]
            fn mutated_events_are_a_message_or_an_error(
                b in mutated(event().prop_map(String::into_bytes), TOKENS)
            ) {
                run(&String::from_utf8_lossy(&b));
            }

            #[test]
            fn built_events_map_to_their_message(ev in event()) {
                let v: Value = serde_json::from_str(&ev).unwrap();
                let s = kafka_binding(&ev, EventMode::Structured).unwrap();
                prop_assert_eq!(&s.key, v["key"].as_str().unwrap());
                prop_assert_eq!(s.value, ev.as_bytes());
                let b = kafka_binding(&ev, EventMode::Binary).unwrap();
                prop_assert_eq!(&b.key, &s.key);
                let data: Value = serde_json::from_slice(&b.value).unwrap();
                prop_assert_eq!(&data, &v["data"]);
                let h: std::collections::HashMap<_, _> = b.headers.into_iter().collect();
                prop_assert_eq!(h["ce_id"].as_str(), v["id"].as_str().unwrap());
                prop_assert_eq!(h.get("ce_etag").map(String::as_str), v["etag"].as_str());
            }
        }

        /// Regression: an event without a string `key` was sent with the
        /// empty key (all such events on one partition) instead of rejected.
        #[test]
        fn an_event_without_a_key_is_rejected() {
            for ev in [r#"{"id":"e"}"#, r#"{"key":1}"#, "[]", "1"] {
                let e = kafka_binding(ev, EventMode::Structured)
                    .unwrap_err()
                    .to_string();
                assert!(e.contains("no string `key`"), "{ev}: {e}");
            }
            let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
            assert!(kafka_binding(&deep, EventMode::Binary).is_err());
        }
    }
}
