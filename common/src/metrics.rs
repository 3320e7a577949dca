//! The names of the metrics every stage records, in one place, with their
//! help texts and units.
//!
//! The stages record through the `metrics` facade (a no-op until a
//! recorder is installed); the binary installs a Prometheus exporter when
//! `--metrics-addr` / `metrics.addr` is set and calls [`describe`], so a
//! scrape shows `# HELP` and `# TYPE` for each.
//!
//! Names follow the Prometheus conventions (`skein_` prefix, base units in
//! the name, `_total` on counters). Where Debezium has a counterpart it is
//! named in the help text: its users look for that one first.
//!
//! Counters move only for work that is durable: an applier counts a batch
//! after its sidecar transaction committed, the extractor after the
//! transport acknowledged. A batch retried after a crash counts again in
//! the new process, never twice in one.

use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};

/// Changes read from the source's log, tracked or not (Debezium:
/// `TotalNumberOfEventsSeen`).
pub const SOURCE_CHANGES: &str = "skein_source_changes_total";
/// Committed source transactions read (Debezium:
/// `NumberOfCommittedTransactions`).
pub const SOURCE_TRANSACTIONS: &str = "skein_source_transactions_total";
/// Time from the source commit of the newest change the extractor handed
/// over to the moment the transport acknowledged it; 0 once a wait finds
/// nothing new (Debezium: `MilliSecondsBehindSource`; in seconds, the
/// Prometheus base unit).
pub const SOURCE_LAG: &str = "skein_source_lag_seconds";
/// WAL the slot still holds for skein: the server's WAL end minus the
/// slot's confirmed position (PostgreSQL).
pub const SOURCE_LAG_BYTES: &str = "skein_source_lag_bytes";
/// WAL the server retains for the slot (PostgreSQL).
pub const SOURCE_RETAINED_BYTES: &str = "skein_source_retained_bytes";
/// Age of the oldest change not yet read (SQL Server CDC).
pub const SOURCE_UNREAD_AGE: &str = "skein_source_unread_age_seconds";
/// Change records the extractor handed to the transport, acknowledged.
pub const EXTRACTOR_RECORDS: &str = "skein_extractor_records_total";
/// Batches the extractor handed to the transport, acknowledged.
pub const EXTRACTOR_BATCHES: &str = "skein_extractor_batches_total";
/// Hand-over time of a batch: transport acknowledgement plus the marker.
pub const EXTRACTOR_HANDOVER: &str = "skein_extractor_handover_duration_seconds";
/// Batches sent with a data-loss notice (changes the source no longer
/// had, skipped by `--continue-with-data-loss` or a marker reset).
pub const DATA_LOSS: &str = "skein_data_loss_events_total";
/// Records an applier consumed (label `partition`).
pub const APPLIER_RECORDS: &str = "skein_applier_records_total";
/// Re-sent records an applier dropped by position (label `partition`).
pub const APPLIER_DUPLICATES: &str = "skein_applier_duplicates_total";
/// Batch transactions an applier committed (label `partition`).
pub const APPLIER_BATCHES: &str = "skein_applier_batches_total";
/// Duration of an applier batch: hydration, versioning and the sidecar
/// commit.
pub const APPLIER_BATCH_DURATION: &str = "skein_applier_batch_duration_seconds";
/// Events written to the outbox (label `entity`).
pub const EVENTS_PUBLISHED: &str = "skein_events_published_total";
/// Changed aggregates whose state hashed to the stored version: no event
/// (label `entity`).
pub const EVENTS_UNCHANGED: &str = "skein_events_unchanged_total";
/// Aggregates of change batches not read again: the snapshot they were
/// last decided in saw all their records (label `entity`).
pub const AGGREGATES_COVERED: &str = "skein_applier_covered_total";
/// Time from an event's source commit to its outbox commit.
pub const EVENT_LATENCY: &str = "skein_event_latency_seconds";
/// Outbox rows not yet relayed (every partition).
pub const OUTBOX_PENDING: &str = "skein_outbox_pending";
/// Age of the oldest outbox row not yet relayed; 0 when none is.
pub const OUTBOX_OLDEST_PENDING: &str = "skein_outbox_oldest_pending_seconds";
/// Events the relay sent to the sink and moved its cursor past.
pub const RELAY_SENT: &str = "skein_relay_sent_total";
/// Relay attempts that failed (the rows stay pending and are retried).
pub const RELAY_FAILURES: &str = "skein_relay_failures_total";
/// Records or events set aside (label `stage`: `transport` for change
/// records no applier could decode, `sink` for events the sink rejected).
pub const DEAD_LETTERS: &str = "skein_dead_letters_total";
/// Change records sent and not yet applied, per partition (label
/// `partition`): over Kafka the log end minus the sidecar's progress, in
/// messages (a pack of records counts one), in process the records handed
/// over and not yet acknowledged.
pub const TRANSPORT_LAG: &str = "skein_transport_lag_records";
/// Room of each in-process partition channel, in batches (Debezium:
/// `QueueTotalCapacity`).
pub const TRANSPORT_QUEUE_CAPACITY: &str = "skein_transport_queue_capacity";
/// Keys explicit runs queued and not yet published.
pub const EXPLICIT_PENDING: &str = "skein_explicit_pending_keys";
/// Refreshes of the pipeline-wide gauges that failed (their values are
/// then the last ones read; see [`REFRESHED_AT`]).
pub const REFRESH_FAILURES: &str = "skein_metrics_refresh_failures_total";
/// When the pipeline-wide gauges were last read successfully (Unix time).
pub const REFRESHED_AT: &str = "skein_metrics_last_refresh_timestamp_seconds";
/// Set to 1 by a process that serves metrics (labels `command`, `version`).
pub const INFO: &str = "skein_info";

/// Registers every metric's help text and unit with the installed recorder.
pub fn describe() {
    use Unit::*;
    let counters: &[(&str, Unit, &str)] = &[
        (SOURCE_CHANGES, Count, "Changes read from the source's log, tracked or not (Debezium: TotalNumberOfEventsSeen)."),
        (SOURCE_TRANSACTIONS, Count, "Committed source transactions read (Debezium: NumberOfCommittedTransactions)."),
        (EXTRACTOR_RECORDS, Count, "Change records the extractor handed to the transport, acknowledged."),
        (EXTRACTOR_BATCHES, Count, "Batches the extractor handed to the transport, acknowledged."),
        (DATA_LOSS, Count, "Batches sent with a data-loss notice: changes the source no longer had were skipped."),
        (APPLIER_RECORDS, Count, "Change records in the batches an applier committed, by partition."),
        (APPLIER_DUPLICATES, Count, "Re-sent change records an applier dropped by source position, by partition."),
        (APPLIER_BATCHES, Count, "Batch transactions an applier committed to the sidecar, by partition and trigger (change, truncate_recheck, explicit)."),
        (EVENTS_PUBLISHED, Count, "Events written to the outbox, by entity and trigger (change, truncate_recheck, explicit)."),
        (EVENTS_UNCHANGED, Count, "Aggregates looked at whose state equals the stored version, so no event, by entity and trigger (change, truncate_recheck, explicit)."),
        (AGGREGATES_COVERED, Count, "Aggregates of change batches an applier did not read again: the source snapshot it last decided them in already saw every change of theirs in the batch, so their published state holds them; by entity."),
        (RELAY_SENT, Count, "Events the relay sent to the sink and moved its cursor past."),
        (RELAY_FAILURES, Count, "Relay attempts that failed; the rows stay pending and are retried in order."),
        (REFRESH_FAILURES, Count, "Reads of the pipeline-wide gauges (slot, outbox, Kafka lag, explicit keys) that failed or timed out; those gauges keep their last values."),
        (DEAD_LETTERS, Count, "Records or events set aside: stage=transport for undecodable change records, stage=sink for events the sink rejected."),
    ];
    for (name, unit, help) in counters {
        describe_counter!(*name, *unit, *help);
    }
    let gauges: &[(&str, Unit, &str)] = &[
        (SOURCE_LAG, Seconds, "Source commit of the newest change handed over to its acknowledgement; 0 once nothing new arrives (Debezium: MilliSecondsBehindSource, here in seconds)."),
        (SOURCE_LAG_BYTES, Bytes, "WAL end minus the replication slot's confirmed position (PostgreSQL)."),
        (SOURCE_RETAINED_BYTES, Bytes, "WAL the server retains for the replication slot (PostgreSQL)."),
        (SOURCE_UNREAD_AGE, Seconds, "Age of the oldest CDC change not yet read (SQL Server)."),
        (OUTBOX_PENDING, Count, "Outbox rows not yet relayed."),
        (OUTBOX_OLDEST_PENDING, Seconds, "Age of the oldest outbox row not yet relayed; 0 when none is."),
        (TRANSPORT_LAG, Count, "Change records (over Kafka: messages) sent and not yet applied, by partition."),
        (TRANSPORT_QUEUE_CAPACITY, Count, "Batches each in-process partition channel holds, in batches (Debezium: QueueTotalCapacity)."),
        (EXPLICIT_PENDING, Count, "Keys explicit runs queued and not yet published."),
        (REFRESHED_AT, Seconds, "Unix time of the last successful read of the pipeline-wide gauges."),
        (INFO, Count, "1, labelled with the skein command and version serving these metrics."),
    ];
    for (name, unit, help) in gauges {
        describe_gauge!(*name, *unit, *help);
    }
    let histograms: &[(&str, &str)] = &[
        (EXTRACTOR_HANDOVER, "Hand-over time of an extractor batch: from its submission to the transport until its acknowledgement and marker write, waiting behind the batches in flight before it included."),
        (APPLIER_BATCH_DURATION, "Duration of an applier batch: hydration, versioning and the sidecar commit."),
        (EVENT_LATENCY, "Time from an event's source commit to its outbox commit (events of changes; not explicit or re-check events)."),
    ];
    for (name, help) in histograms {
        describe_histogram!(*name, Seconds, *help);
    }
}

/// Registers every metric at 0 (each entity's and partition's too, with
/// `trigger="change"`), so the first scrape shows them all: an alert on a
/// counter that never moved (no data loss yet) needs the series to exist.
/// `pipeline_gauges`: this process also serves the pipeline-wide gauges
/// (outbox, explicit keys; see [`PIPELINE_GAUGES`]).
pub fn register(entities: &[&str], partitions: u32, pipeline_gauges: bool) {
    for name in [
        SOURCE_CHANGES,
        SOURCE_TRANSACTIONS,
        EXTRACTOR_RECORDS,
        EXTRACTOR_BATCHES,
        DATA_LOSS,
        RELAY_SENT,
        RELAY_FAILURES,
        REFRESH_FAILURES,
    ] {
        metrics::counter!(name).increment(0);
    }
    for stage in ["transport", "sink"] {
        metrics::counter!(DEAD_LETTERS, "stage" => stage).increment(0);
    }
    for e in entities {
        let e = e.to_string();
        metrics::counter!(EVENTS_PUBLISHED, "entity" => e.clone(), "trigger" => "change")
            .increment(0);
        metrics::counter!(EVENTS_UNCHANGED, "entity" => e.clone(), "trigger" => "change")
            .increment(0);
        metrics::counter!(AGGREGATES_COVERED, "entity" => e).increment(0);
    }
    for p in 0..partitions {
        let p = p.to_string();
        metrics::counter!(APPLIER_RECORDS, "partition" => p.clone()).increment(0);
        metrics::counter!(APPLIER_DUPLICATES, "partition" => p.clone()).increment(0);
        metrics::counter!(APPLIER_BATCHES, "partition" => p, "trigger" => "change").increment(0);
    }
    if pipeline_gauges {
        for g in [OUTBOX_PENDING, OUTBOX_OLDEST_PENDING, EXPLICIT_PENDING] {
            metrics::gauge!(g).set(0.0);
        }
    }
}

/// The gauges read by a query of the whole pipeline's state (the slot,
/// the outbox, the Kafka partitions, the explicit queue). Only the
/// extractor's process (`skein run` or `skein extract`, one per pipeline)
/// serves them, so a sum over every process of a pipeline is the value.
pub const PIPELINE_GAUGES: &[&str] = &[
    SOURCE_LAG_BYTES,
    SOURCE_RETAINED_BYTES,
    SOURCE_UNREAD_AGE,
    OUTBOX_PENDING,
    OUTBOX_OLDEST_PENDING,
    EXPLICIT_PENDING,
    TRANSPORT_LAG,
];

/// Seconds from `micros` (since the Unix epoch) to now; 0 when the clock
/// says it is in the future (clocks of two machines).
pub fn seconds_since(micros: i64) -> f64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64);
    (now.saturating_sub(micros)).max(0) as f64 / 1e6
}
