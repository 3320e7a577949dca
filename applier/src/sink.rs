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
pub trait Sink: Send {
    /// Sends events, in order.
    fn send(&mut self, events: &[SinkEvent]) -> Result<()>;
}

/// One outbox row on its way to a sink.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SinkEvent {
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

/// Collects delivery failures of a send.
#[derive(Default)]
pub struct DeliveryLog {
    failures: std::sync::Mutex<Vec<String>>,
}

impl rdkafka::ClientContext for DeliveryLog {}

impl rdkafka::producer::ProducerContext for DeliveryLog {
    type DeliveryOpaque = ();
    fn delivery(&self, result: &rdkafka::message::DeliveryResult<'_>, _: ()) {
        if let Err((e, m)) = result {
            if let Ok(mut f) = self.failures.lock() {
                f.push(format!(
                    "{} [{}]: {e}",
                    rdkafka::Message::topic(m),
                    rdkafka::Message::partition(m)
                ));
            }
        }
    }
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
        let producer = reliable_producer_config(&client_config(brokers, properties))
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
    let key = v["key"].as_str().unwrap_or_default().to_string();
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

impl Sink for KafkaSink {
    fn send(&mut self, events: &[SinkEvent]) -> Result<()> {
        use rdkafka::message::{Header, OwnedHeaders};
        use rdkafka::producer::{BaseRecord, Producer};
        let kafka_err = |what: &str, e: rdkafka::error::KafkaError| Error::Sink {
            message: format!("{what}: {e}"),
            source: None,
        };
        if let Ok(mut f) = self.producer.context().failures.lock() {
            f.clear();
        }
        for e in events {
            let KafkaMessage {
                key,
                headers,
                value,
            } = kafka_binding(&e.event, self.mode)?;
            let mut h = OwnedHeaders::new_with_capacity(headers.len());
            for (k, v) in &headers {
                h = h.insert(Header {
                    key: k,
                    value: Some(v.as_bytes()),
                });
            }
            let topic = self.topic(&e.entity);
            let mut record = BaseRecord::to(&topic).key(&key).payload(&value).headers(h);
            loop {
                match self.producer.send(record) {
                    Ok(()) => break,
                    Err((
                        rdkafka::error::KafkaError::MessageProduction(
                            rdkafka::types::RDKafkaErrorCode::QueueFull,
                        ),
                        r,
                    )) => {
                        record = r;
                        self.producer.poll(std::time::Duration::from_millis(10));
                    }
                    Err((err, _)) => return Err(kafka_err("enqueuing an event", err)),
                }
            }
        }
        self.producer
            .flush(std::time::Duration::from_secs(60))
            .map_err(|e| kafka_err("waiting for the broker to acknowledge events", e))?;
        let failures = self
            .producer
            .context()
            .failures
            .lock()
            .map(|f| f.clone())
            .unwrap_or_default();
        if !failures.is_empty() {
            return Err(Error::Sink {
                message: format!(
                    "{} event(s) not delivered: {}",
                    failures.len(),
                    failures.join("; ")
                ),
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
}
