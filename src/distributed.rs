//! The distributed deployment over Kafka: `skein extract` and `skein apply`.
//!
//! `apply` runs one consumer of group `skein-<name>` (start 1 or N). On
//! assignment it reads each partition's progress from the sidecar and
//! assigns the partition at that offset: the sidecar, not Kafka's committed
//! offset, is the truth; the Kafka offset is committed after the sidecar,
//! for lag tools only. Each poll round collects up to
//! `transport.max_batch_records` records per round for at most
//! `transport.batch_wait_ms`, then applies one batch per partition (the
//! partitions concurrently). Rebalance callbacks run inside `poll`, never
//! while a batch is being applied, so a revoked partition's batch has either
//! been committed or is dropped unapplied.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, RebalanceProtocol};
use rdkafka::message::{Header, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::types::RDKafkaRespErr;
use rdkafka::ClientContext;
use skein_applier::relay::{run_relay, RelayScope};
use skein_applier::sidecar::{AnySidecar, Progress, Rewind, Sidecar};
use skein_applier::{Applier, Error as ApplyError, Input, ProgressKind, Source};
use skein_common::config::{Config, TransportKind};
use skein_common::ChangeRecord;
use skein_extractor::{AnySource, SledMarkerStore};
use skein_transporter::kafka::{
    client_config, decode, ensure_topic, reliable_producer_config, KafkaTransport,
};
use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::{make_sink, shutdown_token};

/// The change topic and brokers of a Kafka transport config.
pub fn kafka_transport(cfg: &Config) -> anyhow::Result<(ClientConfig, String)> {
    if cfg.transport.kind != TransportKind::Kafka {
        bail!("this command needs `transport.kind: kafka`");
    }
    let brokers = cfg
        .transport
        .brokers
        .as_deref()
        .context("transport.brokers")?;
    let topic = cfg.transport.topic.clone().context("transport.topic")?;
    Ok((
        client_config(brokers, &cfg.transport.kafka_properties),
        topic,
    ))
}

/// The dead-letter topic of a change topic.
pub fn dlq_topic(topic: &str) -> String {
    format!("{topic}.dlq")
}

/// `skein extract`: the extractor producing to Kafka.
pub async fn extract(cfg: Config) -> anyhow::Result<()> {
    let cancel = shutdown_token();
    let (kc, topic) = kafka_transport(&cfg)?;
    let markers = SledMarkerStore::open(&cfg.state_dir)?;
    ensure_topic(
        &kc,
        &topic,
        cfg.transport.partitions,
        cfg.transport.replication_factor,
    )
    .await?;
    let transport = KafkaTransport::new(&kc, &topic, cfg.transport.partitions)?;
    let mut source = AnySource::connect(&cfg).await?;
    skein_extractor::run(&cfg, &mut source, &markers, &transport, cancel).await?;
    Ok(())
}

/// `skein apply`: one member of the applier consumer group.
pub async fn apply(cfg: Config, instance_id: Option<String>) -> anyhow::Result<()> {
    let cancel = shutdown_token();
    let (mut kc, topic) = kafka_transport(&cfg)?;
    if let Some(id) = &instance_id {
        kc.set("group.instance.id", id);
    }
    let mut sidecar = AnySidecar::connect(cfg.sidecar_url(), &cfg.sidecar.schema).await?;
    sidecar.migrate().await?;
    let catalog = skein_extractor::load_catalog(&cfg).await?;
    for t in [topic.clone(), dlq_topic(&topic)] {
        ensure_topic(
            &kc,
            &t,
            cfg.transport.partitions,
            cfg.transport.replication_factor,
        )
        .await?;
    }
    let owned: Arc<Mutex<Vec<i32>>> = Arc::default();
    let relay_cancel = CancellationToken::new();
    let relay = if cfg.transport.relay_in_apply {
        Some(tokio::spawn(run_relay(
            AnySidecar::connect(cfg.sidecar_url(), &cfg.sidecar.schema).await?,
            make_sink(&cfg)?,
            cfg.sink.relay_batch,
            RelayScope::Partitions(owned.clone()),
            relay_cancel.clone(),
        )))
    } else {
        None
    };
    let rt = Handle::current();
    let loop_cfg = cfg.clone();
    let consumer = std::thread::Builder::new()
        .name("applier-consumer".into())
        .spawn(move || consume(rt, loop_cfg, catalog, kc, topic, owned, cancel))?;
    let result = tokio::task::spawn_blocking(move || consumer.join())
        .await?
        .map_err(|_| anyhow::anyhow!("the consumer thread panicked"))?;
    relay_cancel.cancel();
    if let Some(r) = relay {
        r.await??;
    }
    result
}

/// How often an idle applier checks that its partitions' progress was not
/// moved by someone else.
const PROGRESS_CHECK: Duration = Duration::from_secs(2);

/// Where a partition resumes: its committed progress, or the beginning
/// when it has none (the sidecar is the truth, not Kafka's offset).
fn start_offset(progress: Option<Progress>) -> Offset {
    progress
        .map(|p| Offset::Offset(p.offset()))
        .unwrap_or(Offset::Beginning)
}

/// Moves an assigned partition's consumption to [`start_offset`].
fn seek_to(
    consumer: &BaseConsumer<ApplyContext>,
    topic: &str,
    partition: i32,
    progress: Option<Progress>,
) -> rdkafka::error::KafkaResult<()> {
    consumer.seek(
        topic,
        partition,
        start_offset(progress),
        Duration::from_secs(10),
    )
}

/// What a rebalance callback left for the loop.
enum Rebalanced {
    Assigned(Vec<i32>),
    Revoked(Vec<i32>),
}

struct ApplyContext {
    rt: Handle,
    cfg: Config,
    topic: String,
    sidecar: Mutex<Option<AnySidecar>>,
    events: Mutex<Vec<Rebalanced>>,
    failed: Mutex<Option<String>>,
}

impl ApplyContext {
    fn progress_of(&self, parts: &[i32]) -> anyhow::Result<HashMap<i32, Option<Progress>>> {
        let mut guard = self
            .sidecar
            .lock()
            .map_err(|_| anyhow::anyhow!("sidecar lock poisoned"))?;
        let rt = &self.rt;
        if guard.is_none() {
            *guard = Some(rt.block_on(AnySidecar::connect(
                self.cfg.sidecar_url(),
                &self.cfg.sidecar.schema,
            ))?);
        }
        let sc = guard.as_mut().expect("connected above");
        let mut out = HashMap::new();
        for p in parts {
            let pr = rt.block_on(sc.progress(&self.cfg.name, &self.topic, *p as u32));
            match pr {
                Ok(pr) => {
                    out.insert(*p, pr);
                }
                Err(e) => {
                    *guard = None;
                    return Err(e.into());
                }
            }
        }
        Ok(out)
    }

    fn push(&self, e: Rebalanced) {
        if let Ok(mut ev) = self.events.lock() {
            ev.push(e);
        }
    }

    fn fail(&self, message: String) {
        error!(error = %message, "rebalance failed");
        if let Ok(mut f) = self.failed.lock() {
            f.get_or_insert(message);
        }
    }
}

impl ClientContext for ApplyContext {}

impl ConsumerContext for ApplyContext {
    /// Assigns each partition at its sidecar progress (or the beginning when
    /// it has none), so consumption resumes exactly after the last committed
    /// batch whatever Kafka's committed offset says.
    fn rebalance(
        &self,
        consumer: &BaseConsumer<Self>,
        err: RDKafkaRespErr,
        tpl: &mut TopicPartitionList,
    ) {
        let cooperative = matches!(
            consumer.rebalance_protocol(),
            RebalanceProtocol::Cooperative
        );
        let parts: Vec<i32> = tpl
            .elements()
            .iter()
            .filter(|e| e.topic() == self.topic)
            .map(|e| e.partition())
            .collect();
        match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                match self.progress_of(&parts) {
                    Ok(progress) => {
                        for (p, pr) in &progress {
                            if let Err(e) =
                                tpl.set_partition_offset(&self.topic, *p, start_offset(*pr))
                            {
                                self.fail(format!("setting the start of partition {p}: {e}"));
                            }
                        }
                        info!(partitions = ?parts, progress = ?progress.iter().map(|(p, pr)| (*p, pr.map(|x| x.offset()))).collect::<BTreeMap<_, _>>(), "partitions assigned");
                    }
                    Err(e) => self.fail(format!("reading progress on assignment: {e:#}")),
                }
                let r = if cooperative {
                    consumer.incremental_assign(tpl)
                } else {
                    consumer.assign(tpl)
                };
                if let Err(e) = r {
                    self.fail(format!("assigning partitions: {e}"));
                }
                self.push(Rebalanced::Assigned(parts));
            }
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => {
                info!(partitions = ?parts, "partitions revoked");
                self.push(Rebalanced::Revoked(parts));
                let r = if cooperative {
                    consumer.incremental_unassign(tpl)
                } else {
                    consumer.unassign()
                };
                if let Err(e) = r {
                    warn!(error = %e, "unassigning partitions");
                }
            }
            other => {
                warn!(error = ?other, "rebalance error; dropping the assignment");
                self.push(Rebalanced::Revoked(parts));
                let _ = consumer.unassign();
            }
        }
    }
}

/// One partition's records collected in a poll round.
struct PartBuf {
    first: i64,
    next: i64,
    records: Vec<ChangeRecord>,
    has_data_loss: bool,
    dead_letters: i32,
}

/// The consumer loop, on its own thread (librdkafka's callbacks block).
fn consume(
    rt: Handle,
    cfg: Config,
    catalog: skein_sql::Catalog,
    kc: ClientConfig,
    topic: String,
    owned: Arc<Mutex<Vec<i32>>>,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let group = cfg.consumer_group();
    let mut c = kc.clone();
    c.set("group.id", &group)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest");
    let ctx = ApplyContext {
        rt: rt.clone(),
        cfg: cfg.clone(),
        topic: topic.clone(),
        sidecar: Mutex::new(None),
        events: Mutex::new(vec![]),
        failed: Mutex::new(None),
    };
    let consumer: BaseConsumer<ApplyContext> = c
        .create_with_context(ctx)
        .context("creating the Kafka consumer")?;
    consumer
        .subscribe(&[&topic])
        .context("subscribing to the change topic")?;
    let dlq: FutureProducer = reliable_producer_config(&kc)
        .create()
        .context("creating the dead-letter producer")?;
    let dlq_topic = dlq_topic(&topic);
    info!(group = %group, topic = %topic, "applier started");

    let mut appliers: HashMap<i32, Applier<AnySidecar>> = HashMap::new();
    let mut bufs: BTreeMap<i32, PartBuf> = BTreeMap::new();
    let wait = Duration::from_millis(cfg.transport.batch_wait_ms);
    let max = cfg.transport.max_batch_records;
    let entities: std::collections::HashSet<String> =
        cfg.entities.iter().map(|e| e.name.clone()).collect();
    let mut last_progress_check = Instant::now();
    while !cancel.is_cancelled() {
        let deadline = Instant::now() + wait;
        let mut taken = 0usize;
        while taken < max {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let polled = consumer.poll(left);
            take_rebalances(consumer.context(), &owned, &mut bufs, &mut appliers)?;
            let m = match polled {
                None => break,
                Some(Err(e)) => {
                    warn!(error = %e, "consumer error");
                    continue;
                }
                Some(Ok(m)) => m,
            };
            let p = m.partition();
            let off = m.offset();
            if !owned.lock().map(|o| o.contains(&p)).unwrap_or(false) {
                continue;
            }
            let buf = bufs.entry(p).or_insert_with(|| PartBuf {
                first: off,
                next: off,
                records: vec![],
                has_data_loss: false,
                dead_letters: 0,
            });
            if off < buf.next {
                continue;
            }
            buf.next = off + 1;
            taken += 1;
            let problem = match m.payload().map(decode) {
                None => Some("a record without a value".to_string()),
                Some(Err(e)) => Some(e),
                Some(Ok(env)) => {
                    buf.has_data_loss |= env.has_data_loss;
                    match env.record {
                        None => None,
                        Some(r) if entities.contains(&r.entity) => {
                            buf.records.push(r);
                            None
                        }
                        Some(r) => Some(format!("unknown entity `{}`", r.entity)),
                    }
                }
            };
            if let Some(problem) = problem {
                warn!(partition = p, offset = off, error = %problem, topic = %dlq_topic, "undecodable record sent to the dead-letter topic");
                let headers = OwnedHeaders::new()
                    .insert(Header {
                        key: "skein_error",
                        value: Some(problem.as_bytes()),
                    })
                    .insert(Header {
                        key: "skein_topic",
                        value: Some(topic.as_bytes()),
                    })
                    .insert(Header {
                        key: "skein_partition",
                        value: Some(p.to_string().as_bytes()),
                    })
                    .insert(Header {
                        key: "skein_offset",
                        value: Some(off.to_string().as_bytes()),
                    });
                let mut rec = FutureRecord::to(&dlq_topic).partition(p).headers(headers);
                if let Some(k) = m.key() {
                    rec = rec.key(k);
                }
                if let Some(v) = m.payload() {
                    rec = rec.payload(v);
                }
                rt.block_on(dlq.send(rec, Duration::from_secs(30)))
                    .map_err(|(e, _)| anyhow::anyhow!("sending to the dead-letter topic: {e}"))?;
                buf.dead_letters += 1;
            }
        }
        take_rebalances(consumer.context(), &owned, &mut bufs, &mut appliers)?;
        if let Some(f) = consumer
            .context()
            .failed
            .lock()
            .ok()
            .and_then(|f| f.clone())
        {
            bail!("{f}");
        }
        if bufs.is_empty() {
            // Idle: notice a progress rewound under us (`skein replay
            // --force-while-running`) even without records to commit.
            if last_progress_check.elapsed() > PROGRESS_CHECK {
                last_progress_check = Instant::now();
                let owned_now = owned.lock().map(|o| o.clone()).unwrap_or_default();
                for p in owned_now {
                    let Some(a) = appliers.get_mut(&p) else {
                        continue;
                    };
                    let Some(believed) = a.cached_progress() else {
                        continue;
                    };
                    a.reset_progress();
                    let now = rt.block_on(a.progress())?;
                    if now != believed {
                        warn!(partition = p, believed = ?believed.map(|x| x.offset()), now = ?now.map(|x| x.offset()), "progress moved under this applier (a replay?); re-seeking");
                        if let Err(e) = seek_to(&consumer, &topic, p, now) {
                            warn!(partition = p, error = %e, "seek failed");
                        }
                    }
                }
            }
            continue;
        }
        // Apply one batch per partition, the partitions concurrently.
        let work: Vec<(i32, PartBuf)> = std::mem::take(&mut bufs).into_iter().collect();
        let mut ready = vec![];
        for (p, buf) in work {
            let a = match appliers.remove(&p) {
                Some(a) => a,
                None => rt.block_on(new_applier(&cfg, &catalog, &topic, p))?,
            };
            ready.push((p, buf, a));
        }
        let results = rt.block_on(async {
            let mut set = tokio::task::JoinSet::new();
            for (p, buf, mut a) in ready {
                set.spawn(async move {
                    let r = a
                        .apply(Input {
                            lower: i128::from(buf.first),
                            upper: i128::from(buf.next),
                            has_data_loss: buf.has_data_loss,
                            records: &buf.records,
                            dead_letters: buf.dead_letters,
                            kind: ProgressKind::Offset,
                        })
                        .await;
                    (p, buf.next, a, r)
                });
            }
            let mut out = vec![];
            while let Some(j) = set.join_next().await {
                out.push(j);
            }
            out
        });
        let mut commit = TopicPartitionList::new();
        let mut fatal = None;
        for j in results {
            let (p, next, mut a, r) = j.context("an apply task panicked")?;
            match r {
                Ok(_) => {
                    commit.add_partition_offset(&topic, p, Offset::Offset(next))?;
                }
                Err(ApplyError::Fenced {
                    expected, found, ..
                }) => {
                    warn!(partition = p, ?expected, ?found, "fenced: another applier moved this partition's progress; nothing was written, re-seeking");
                    a.reset_progress();
                    match rt.block_on(a.progress()) {
                        Ok(pr) => {
                            if let Err(e) = seek_to(&consumer, &topic, p, pr) {
                                warn!(partition = p, error = %e, "seek after a fence failed; re-sent records are dropped by position");
                            }
                        }
                        Err(e) => fatal = Some(anyhow::Error::from(e)),
                    }
                }
                Err(e) => fatal = Some(e.into()),
            }
            appliers.insert(p, a);
        }
        if commit.count() > 0 {
            if let Err(e) = consumer.commit(&commit, CommitMode::Async) {
                warn!(error = %e, "committing Kafka offsets (advisory) failed");
            }
        }
        if let Some(e) = fatal {
            return Err(e.context("applying a batch"));
        }
    }
    info!("applier stopping");
    Ok(())
}

async fn new_applier(
    cfg: &Config,
    catalog: &skein_sql::Catalog,
    topic: &str,
    partition: i32,
) -> anyhow::Result<Applier<AnySidecar>> {
    let source = Source::connect(cfg).await?;
    let sidecar = AnySidecar::connect(cfg.sidecar_url(), &cfg.sidecar.schema).await?;
    Ok(Applier::new(
        cfg,
        catalog,
        source,
        sidecar,
        topic,
        partition as u32,
    ))
}

/// Applies what the rebalance callbacks recorded: ownership for the relay,
/// buffered records of revoked partitions dropped, progress re-read.
fn take_rebalances(
    ctx: &ApplyContext,
    owned: &Arc<Mutex<Vec<i32>>>,
    bufs: &mut BTreeMap<i32, PartBuf>,
    appliers: &mut HashMap<i32, Applier<AnySidecar>>,
) -> anyhow::Result<()> {
    let events: Vec<Rebalanced> = match ctx.events.lock() {
        Ok(mut e) => std::mem::take(&mut *e),
        Err(_) => bail!("rebalance events lock poisoned"),
    };
    for e in events {
        let mut o = owned
            .lock()
            .map_err(|_| anyhow::anyhow!("ownership lock poisoned"))?;
        match e {
            Rebalanced::Assigned(ps) => {
                for p in ps {
                    if !o.contains(&p) {
                        o.push(p);
                    }
                    bufs.remove(&p);
                    if let Some(a) = appliers.get_mut(&p) {
                        a.reset_progress();
                    }
                }
            }
            Rebalanced::Revoked(ps) => {
                o.retain(|p| !ps.contains(p));
                for p in ps {
                    bufs.remove(&p);
                    if let Some(a) = appliers.get_mut(&p) {
                        a.reset_progress();
                    }
                }
            }
        }
    }
    Ok(())
}

/// `skein status`: lag per stage, as JSON (stable keys, for scripts and tests).
///
/// * `source`: PostgreSQL, the slot's confirmed position against the
///   server's WAL end; SQL Server, CDC's max LSN and each capture
///   instance's min LSN (the validity interval);
/// * `partitions`: per partition the sidecar progress and, for Kafka, the
///   log end and the lag between them;
/// * `outbox`: rows not yet relayed and the age of the oldest.
pub async fn status(cfg: Config) -> anyhow::Result<()> {
    let mut out = serde_json::Map::new();
    if cfg.source.kind == skein_common::config::SourceKind::Postgres {
        let client = skein_extractor::postgres::connect(&cfg.source.url, "source").await?;
        let row = client
            .query_opt(
                "SELECT confirmed_flush_lsn::text, pg_current_wal_lsn()::text, \
                        (pg_current_wal_lsn() - confirmed_flush_lsn)::int8, active, coalesce(wal_status, '') \
                 FROM pg_catalog.pg_replication_slots WHERE slot_name = $1",
                &[&cfg.source.slot],
            )
            .await?;
        out.insert(
            "source".into(),
            match row {
                None => serde_json::json!({ "slot": cfg.source.slot, "exists": false }),
                Some(r) => serde_json::json!({
                    "slot": cfg.source.slot,
                    "exists": true,
                    "confirmed": r.get::<_, Option<String>>(0),
                    "wal_end": r.get::<_, String>(1),
                    "lag_bytes": r.get::<_, Option<i64>>(2),
                    "active": r.get::<_, bool>(3),
                    "wal_status": r.get::<_, String>(4),
                }),
            },
        );
    }
    if cfg.source.kind == skein_common::config::SourceKind::Sqlserver {
        let mut source = skein_extractor::MssqlSource::connect(&cfg).await?;
        let (max, mins) = source.validity_interval().await?;
        out.insert(
            "source".into(),
            serde_json::json!({
                "max_lsn": max.to_string(),
                "capture_instances": mins
                    .iter()
                    .map(|(ci, min)| serde_json::json!({ "name": ci, "min_lsn": min.to_string() }))
                    .collect::<Vec<_>>(),
            }),
        );
    }
    let mut sidecar = AnySidecar::connect(cfg.sidecar_url(), &cfg.sidecar.schema).await?;
    let (topic, ends) = match cfg.transport.kind {
        TransportKind::InProcess => (skein_applier::IN_PROCESS_TOPIC.to_string(), None),
        TransportKind::Kafka => {
            let (kc, topic) = kafka_transport(&cfg)?;
            let t = topic.clone();
            let n = cfg.transport.partitions;
            let ends = tokio::task::spawn_blocking(move || -> anyhow::Result<Vec<(i64, i64)>> {
                let c: BaseConsumer = kc.create()?;
                (0..n as i32)
                    .map(|p| {
                        c.fetch_watermarks(&t, p, Duration::from_secs(10))
                            .with_context(|| format!("reading the watermarks of partition {p}"))
                    })
                    .collect()
            })
            .await??;
            (topic, Some(ends))
        }
    };
    let mut parts = vec![];
    let mut total_lag = 0i64;
    for p in 0..cfg.transport.partitions {
        let pr = sidecar.progress(&cfg.name, &topic, p).await?;
        let progress: serde_json::Value = match (pr, cfg.transport.kind) {
            (None, _) => serde_json::Value::Null,
            (Some(x), TransportKind::Kafka) => x.offset().into(),
            (Some(x), TransportKind::InProcess) => skein_common::SourcePosition::describe_numeric(
                cfg.source.kind.dialect(),
                x.position,
            )
            .into(),
        };
        let mut v = serde_json::json!({ "partition": p, "progress": progress });
        if let Some(ends) = &ends {
            let (low, high) = ends[p as usize];
            // No progress yet: everything from the log start is pending.
            let lag = high - pr.map(|x| x.offset()).unwrap_or(low);
            total_lag += lag.max(0);
            v["log_start"] = low.into();
            v["log_end"] = high.into();
            v["lag"] = lag.into();
        }
        parts.push(v);
    }
    out.insert("topic".into(), topic.into());
    out.insert("partitions".into(), parts.into());
    if ends.is_some() {
        out.insert("transport_lag".into(), total_lag.into());
    }
    let (pending, oldest_ms) = sidecar.pending().await?;
    out.insert(
        "outbox".into(),
        serde_json::json!({ "pending": pending, "oldest_pending_ms": oldest_ms }),
    );
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

/// What `skein replay` rewinds to.
pub enum ReplayFrom {
    /// This offset.
    Offset(i64),
    /// The first offset at or after this time (Kafka offsets-for-times).
    Time(i64),
}

/// For each partition, the first offset in `[from, end)` whose record's
/// timestamp is at or after `ms`; partitions with none are left out.
fn first_at_or_after(
    consumer: &BaseConsumer,
    topic: &str,
    from: &HashMap<i32, i64>,
    end: &HashMap<i32, i64>,
    ms: i64,
) -> anyhow::Result<HashMap<i32, i64>> {
    let mut pending: HashMap<i32, (i64, i64)> = HashMap::new();
    let mut tpl = TopicPartitionList::new();
    for (p, o) in from {
        if let Some(&e) = end.get(p) {
            if *o < e {
                pending.insert(*p, (*o, e));
                tpl.add_partition_offset(topic, *p, Offset::Offset(*o))?;
            }
        }
    }
    let mut out = HashMap::new();
    if pending.is_empty() {
        return Ok(out);
    }
    consumer.assign(&tpl)?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !pending.is_empty() {
        if Instant::now() > deadline {
            bail!(
                "reading timestamps timed out (partitions {:?})",
                pending.keys()
            );
        }
        let Some(m) = consumer.poll(Duration::from_millis(500)) else {
            continue;
        };
        let m = m.context("reading record timestamps")?;
        let p = m.partition();
        let Some(&(_, e)) = pending.get(&p) else {
            continue;
        };
        if m.timestamp().to_millis().is_some_and(|t| t >= ms) {
            out.insert(p, m.offset());
            pending.remove(&p);
        } else if m.offset() + 1 >= e {
            pending.remove(&p);
        }
    }
    consumer.unassign()?;
    Ok(out)
}

/// Parses `--from-time`: RFC 3339, or milliseconds since the Unix epoch.
pub fn parse_time_ms(s: &str) -> anyhow::Result<i64> {
    if let Ok(ms) = s.parse::<i64>() {
        return Ok(ms);
    }
    let t = chrono::DateTime::parse_from_rfc3339(s).with_context(|| {
        format!("--from-time `{s}`: use RFC 3339 (2024-05-01T12:00:00Z) or epoch milliseconds")
    })?;
    Ok(t.timestamp_millis())
}

/// `skein replay`: rewinds the sidecar progress of the appliers' group so
/// the records from the given offset (or time) are consumed again.
///
/// Without `republish` the version table still holds each aggregate's last
/// etag, so an unchanged aggregate publishes nothing again; with it the
/// stored versions of the aggregates in the replayed range are cleared and
/// each publishes once more. The stored source position is cleared too, so
/// the replayed records are not dropped as re-sends.
pub async fn replay(
    cfg: Config,
    partition: Option<u32>,
    from: ReplayFrom,
    republish: bool,
    force_while_running: bool,
) -> anyhow::Result<()> {
    let (kc, topic) = kafka_transport(&cfg)?;
    let group = cfg.consumer_group();
    let parts: Vec<i32> = match partition {
        Some(p) if p >= cfg.transport.partitions => {
            bail!(
                "partition {p} does not exist (transport.partitions is {})",
                cfg.transport.partitions
            )
        }
        Some(p) => vec![p as i32],
        None => (0..cfg.transport.partitions as i32).collect(),
    };
    // Read the group and the offsets on a blocking thread (librdkafka calls block).
    let (members, targets, affected) = {
        let (kc, topic, group, parts) = (kc.clone(), topic.clone(), group.clone(), parts.clone());
        let mut sidecar = AnySidecar::connect(cfg.sidecar_url(), &cfg.sidecar.schema).await?;
        let mut current = HashMap::new();
        for p in &parts {
            current.insert(*p, sidecar.progress(&cfg.name, &topic, *p as u32).await?);
        }
        tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
            let mut c = kc.clone();
            c.set("group.id", format!("{group}-replay-{}", std::process::id()))
                .set("enable.auto.commit", "false");
            let consumer: BaseConsumer = c.create().context("creating a Kafka client")?;
            let groups = consumer
                .fetch_group_list(Some(&group), Duration::from_secs(10))
                .context("describing the consumer group")?;
            let members: Vec<String> = groups
                .groups()
                .iter()
                .flat_map(|g| g.members().iter().map(|m| format!("{} ({})", m.id(), m.client_host())))
                .collect();
            let mut targets: BTreeMap<i32, (i64, i64)> = BTreeMap::new();
            let from_offsets: HashMap<i32, i64> = match from {
                ReplayFrom::Offset(o) => parts.iter().map(|p| (*p, o)).collect(),
                ReplayFrom::Time(ms) => {
                    let mut tpl = TopicPartitionList::new();
                    for p in &parts {
                        tpl.add_partition_offset(&topic, *p, Offset::Offset(ms))?;
                    }
                    let found = consumer
                        .offsets_for_times(tpl, Duration::from_secs(10))
                        .context("looking up offsets for the time")?;
                    let mut m = HashMap::new();
                    for e in found.elements() {
                        // No record at or after the time (End): nothing to
                        // replay there, so that partition is left out.
                        if let Offset::Offset(o) = e.offset() {
                            m.insert(e.partition(), o);
                        }
                    }
                    // Trust but verify: step over records before the time
                    // (a broker answered with an earlier offset, seen with
                    // tansu when no record is after the time).
                    let ends: HashMap<i32, i64> = parts
                        .iter()
                        .filter_map(|p| current.get(p).copied().flatten().map(|pr| (*p, pr.offset())))
                        .collect();
                    first_at_or_after(&consumer, &topic, &m, &ends, ms)?
                }
            };
            for p in &parts {
                let Some(Some(pr)) = current.get(p) else {
                    continue; // never consumed: nothing to rewind
                };
                let Some(&to) = from_offsets.get(p) else {
                    continue;
                };
                if to > pr.offset() {
                    bail!("partition {p}: offset {to} is after the progress {}; replay only rewinds (moving forward would skip records)", pr.offset());
                }
                if to < pr.offset() {
                    targets.insert(*p, (pr.offset(), to));
                }
            }
            // The aggregates in the replayed ranges, for --republish.
            let mut affected: std::collections::BTreeSet<(String, String)> = Default::default();
            if republish && !targets.is_empty() {
                let mut tpl = TopicPartitionList::new();
                for (p, (_, to)) in &targets {
                    tpl.add_partition_offset(&topic, *p, Offset::Offset(*to))?;
                }
                consumer.assign(&tpl)?;
                let mut pending: HashMap<i32, i64> = targets.iter().map(|(p, (cur, _))| (*p, *cur)).collect();
                let deadline = Instant::now() + Duration::from_secs(60);
                while !pending.is_empty() {
                    if Instant::now() > deadline {
                        bail!("reading the replayed range timed out (partitions {:?} unfinished)", pending.keys());
                    }
                    let Some(m) = consumer.poll(Duration::from_millis(500)) else { continue };
                    let m = m.context("reading the replayed range")?;
                    let (p, off) = (m.partition(), m.offset());
                    let Some(end) = pending.get(&p).copied() else { continue };
                    if off < end {
                        if let Some(Ok(env)) = m.payload().map(decode) {
                            if let Some(r) = env.record {
                                affected.insert((r.entity.clone(), r.root_key.canonical()));
                            }
                        }
                    }
                    if off + 1 >= end {
                        pending.remove(&p);
                    }
                }
            }
            Ok((members, targets, affected))
        })
        .await??
    };
    if !members.is_empty() && !force_while_running {
        bail!(
            "appliers of group `{group}` are active: {}. Stop them first, or add --force-while-running \
             (they are fenced at their next commit and re-seek to the rewound progress)",
            members.join(", ")
        );
    }
    if targets.is_empty() {
        println!("nothing to rewind: every selected partition is already at or before that point");
        return Ok(());
    }
    let mut sidecar = AnySidecar::connect(cfg.sidecar_url(), &cfg.sidecar.schema).await?;
    sidecar
        .rewind(&Rewind {
            group: cfg.name.clone(),
            topic: topic.clone(),
            partitions: targets
                .iter()
                .map(|(p, (cur, to))| (*p, *cur, *to))
                .collect(),
            forget: if republish {
                affected.iter().cloned().collect()
            } else {
                vec![]
            },
        })
        .await?;
    for (p, (cur, to)) in &targets {
        println!("partition {p}: progress {cur} -> {to}");
    }
    if republish {
        println!(
            "cleared the stored versions of {} aggregate(s): they publish again",
            affected.len()
        );
    } else {
        println!(
            "stored versions kept: aggregates whose state did not change publish nothing again"
        );
    }
    warn!(group = %group, topic = %topic, republish, partitions = ?targets.keys().collect::<Vec<_>>(), "progress rewound");
    Ok(())
}
