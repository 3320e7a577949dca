//! `skein explicit`: publish aggregates on demand (nTangle's explicit
//! execution), and the initial load of `extractor.initial_load`.
//!
//! The command selects keys and queues them in the sidecar (see
//! `skein_applier::explicit`); the running pipeline's appliers publish
//! them. It then waits until they are published, with a progress bar on a
//! terminal and a log line every few seconds otherwise.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use skein_applier::explicit::{parse_key, Run, Selection};
use skein_applier::sidecar::{AnySidecar, ExplicitRunStatus, Sidecar};
use skein_applier::Source;
use skein_common::config::{Config, Transport};
use skein_sql::Catalog;
use skein_transporter::IN_PROCESS_TOPIC;
use tracing::{info, warn};

use super::sidecar;

/// What `skein explicit` was asked for.
#[derive(clap::Args)]
pub struct Args {
    /// The entity.
    #[arg(long)]
    pub entity: String,
    /// Keys of a one-column root key, comma-separated (`--keys 1,2,3`).
    #[arg(long, conflicts_with_all = ["keys_from", "filter"])]
    pub keys: Option<String>,
    /// A file with one key a line: a value, or a JSON array for a
    /// composite key (`[1, "EU"]`).
    #[arg(long, conflicts_with = "filter")]
    pub keys_from: Option<PathBuf>,
    /// An SQL condition on the root table's columns (`--where "region = 'EU'"`),
    /// read in a read-only transaction.
    #[arg(long = "where", id = "filter")]
    pub filter: Option<String>,
    /// Publish even aggregates whose etag is unchanged.
    #[arg(long)]
    pub republish: bool,
    /// Keys queued per sidecar transaction.
    #[arg(long, default_value_t = 1000)]
    pub chunk: usize,
    /// Return once every key is queued, without waiting for the appliers.
    #[arg(long)]
    pub no_wait: bool,
}

/// The topic the sidecar keys this pipeline's progress (and so its
/// explicit queue) by.
pub fn progress_topic(cfg: &Config) -> String {
    match &cfg.transport {
        Transport::InProcess(_) => IN_PROCESS_TOPIC.to_string(),
        Transport::Kafka(k) => k.topic.clone(),
    }
}

/// The source catalog of the config's tables.
async fn catalog(cfg: &Config, source: &mut Source) -> anyhow::Result<Catalog> {
    source
        .catalog(&cfg.tables())
        .await?
        .context("reading the source catalog")
}

/// Runs `skein explicit`.
pub async fn explicit(cfg: Config, a: Args) -> anyhow::Result<()> {
    let mut sc = sidecar(&cfg).await?;
    sc.migrate().await?;
    let mut source = Source::connect(&cfg).await?;
    let catalog = catalog(&cfg, &mut source).await?;
    let Some(entity) = cfg.entities.iter().find(|e| e.name == a.entity) else {
        bail!(
            "no entity `{}` in the config (entities: {})",
            a.entity,
            cfg.entities
                .iter()
                .map(|e| e.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    };
    let root = entity
        .nodes()
        .into_iter()
        .next()
        .context("an entity has a root")?;
    let columns = catalog.key_columns(&root).len();
    let selection = match (&a.keys, &a.keys_from, &a.filter) {
        (Some(keys), None, None) => Selection::Keys(
            keys.split(',')
                .filter(|k| !k.trim().is_empty())
                .map(|k| parse_key(k, columns))
                .collect::<Result<_, _>>()
                .map_err(anyhow::Error::msg)?,
        ),
        (None, Some(path), None) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading keys from {}", path.display()))?;
            Selection::Keys(
                text.lines()
                    .filter(|l| !l.trim().is_empty())
                    .map(|k| parse_key(k, columns))
                    .collect::<Result<_, _>>()
                    .map_err(anyhow::Error::msg)?,
            )
        }
        (None, None, Some(f)) => Selection::Where(f.clone()),
        (None, None, None) => Selection::All,
        _ => bail!("give at most one of --keys, --keys-from and --where"),
    };
    let run = Run {
        cfg: &cfg,
        catalog: &catalog,
        topic: progress_topic(&cfg),
        entity: a.entity.clone(),
        selection,
        republish: a.republish,
        initial: false,
        chunk: a.chunk,
    };
    let started = run.start(&mut sc).await?;
    if started.resumed {
        info!(run = started.id, queued = started.queued, cursor = ?started.cursor,
            "resuming the unfinished explicit run with the same selection");
    } else {
        info!(run = started.id, entity = %a.entity, "explicit run started");
    }
    let bar = Progress::new(started.id);
    let queued = run
        .queue(&started, &mut sc, &mut source, |q| bar.queued(q))
        .await?;
    info!(
        run = started.id,
        queued, "every selected key is queued; the appliers publish them"
    );
    if a.no_wait {
        println!("explicit run {}: {queued} keys queued", started.id);
        return Ok(());
    }
    let done = wait(&mut sc, started.id, &bar).await?;
    bar.finish();
    println!(
        "explicit run {}: {} keys queued, all published",
        done.id, done.queued
    );
    Ok(())
}

/// Waits until every key of run `id` is published by the appliers.
async fn wait(sc: &mut AnySidecar, id: i64, bar: &Progress) -> anyhow::Result<ExplicitRunStatus> {
    let mut last_move = (Instant::now(), -1i64);
    let mut warned = false;
    loop {
        let Some(r) = sc.explicit_run(id).await? else {
            bail!("explicit run {id} is no longer in the sidecar");
        };
        bar.published(r.queued, r.queued - r.pending);
        if r.finished() {
            return Ok(r);
        }
        if r.pending != last_move.1 {
            last_move = (Instant::now(), r.pending);
        } else if !warned && last_move.0.elapsed() > Duration::from_secs(15) {
            warned = true;
            warn!(
                run = id,
                pending = r.pending,
                "no queued key was published for 15 s: the appliers publish them \
                 (`skein run`, or `skein apply` over Kafka); is the pipeline running?"
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Progress: a bar with rate and ETA on a terminal, a log line every five
/// seconds otherwise.
struct Progress {
    id: i64,
    bar: Option<indicatif::ProgressBar>,
    last_line: std::sync::Mutex<Instant>,
    started: Instant,
}

impl Progress {
    fn new(id: i64) -> Progress {
        let bar = std::io::stderr().is_terminal().then(|| {
            let b = indicatif::ProgressBar::new(0);
            b.set_style(
                indicatif::ProgressStyle::with_template(
                    "{msg} [{bar:30}] {pos}/{len} published, {per_sec}, ETA {eta}",
                )
                .expect("a valid template")
                .progress_chars("=> "),
            );
            b.set_message(format!("explicit run {id}"));
            b
        });
        Progress {
            id,
            bar,
            last_line: std::sync::Mutex::new(Instant::now()),
            started: Instant::now(),
        }
    }

    fn queued(&self, queued: i64) {
        match &self.bar {
            Some(b) => b.set_length(queued.max(0) as u64),
            None => self.line(queued, None),
        }
    }

    fn published(&self, queued: i64, published: i64) {
        match &self.bar {
            Some(b) => {
                b.set_length(queued.max(0) as u64);
                b.set_position(published.max(0) as u64);
            }
            None => self.line(queued, Some(published)),
        }
    }

    fn line(&self, queued: i64, published: Option<i64>) {
        let mut last = self.last_line.lock().expect("not poisoned");
        if last.elapsed() < Duration::from_secs(5) {
            return;
        }
        *last = Instant::now();
        let secs = self.started.elapsed().as_secs_f64().max(0.001);
        match published {
            None => info!(run = self.id, queued, "explicit run: queueing keys"),
            Some(p) => {
                let rate = p as f64 / secs;
                let eta_s = if rate > 0.0 {
                    ((queued - p) as f64 / rate).round() as i64
                } else {
                    -1
                };
                info!(
                    run = self.id,
                    queued,
                    published = p,
                    per_s = rate.round() as i64,
                    eta_s,
                    "explicit run: publishing"
                );
            }
        }
    }

    fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish();
        }
    }
}

/// `extractor.initial_load`, before the extractor's very first start (no
/// marker, nothing applied): records an explicit run of every aggregate of
/// each entity in the sidecar. Recorded before the slot exists, so a crash
/// in between cannot skip the load: the next start is a first start again
/// and finds the same unfinished runs.
pub async fn plan_initial_load(cfg: &Config, first_start: bool) -> anyhow::Result<()> {
    if !(cfg.extractor.initial_load && first_start) {
        return Ok(());
    }
    let mut sc = sidecar(cfg).await?;
    let catalog = Catalog::default();
    for e in &cfg.entities {
        let run = initial_run(cfg, &catalog, &e.name);
        let r = run.start(&mut sc).await?;
        info!(run = r.id, entity = %e.name, "initial load planned");
    }
    Ok(())
}

fn initial_run<'a>(cfg: &'a Config, catalog: &'a Catalog, entity: &str) -> Run<'a> {
    Run {
        cfg,
        catalog,
        topic: progress_topic(cfg),
        entity: entity.to_string(),
        selection: Selection::All,
        republish: false,
        initial: true,
        chunk: 1000,
    }
}

/// Queues the unfinished initial-load runs once the extractor has stored
/// its first marker: its slot (or CDC start point) exists then, so every
/// aggregate is either selected here or changed after that point and
/// streamed. A failure is logged and tried again every 5 s until `cancel`
/// (the run stays unfinished in `skein status` meanwhile).
pub async fn initial_load(
    cfg: Config,
    markers: std::sync::Arc<dyn skein_extractor::MarkerStore + Send + Sync>,
    cancel: tokio_util::sync::CancellationToken,
) {
    if !cfg.extractor.initial_load {
        return;
    }
    loop {
        match initial_load_once(&cfg, &*markers, &cancel).await {
            Ok(()) => return,
            Err(e) => {
                tracing::error!(error = %format!("{e:#}"), "initial load failed; trying again in 5 s");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(5)) => {}
            _ = cancel.cancelled() => return,
        }
    }
}

async fn initial_load_once(
    cfg: &Config,
    markers: &(dyn skein_extractor::MarkerStore + Send + Sync),
    cancel: &tokio_util::sync::CancellationToken,
) -> anyhow::Result<()> {
    let mut sc = sidecar(cfg).await?;
    let runs: Vec<ExplicitRunStatus> = sc
        .explicit_runs(&cfg.name, 0)
        .await?
        .into_iter()
        .filter(|r| r.initial && r.state == "selecting")
        .collect();
    if runs.is_empty() {
        return Ok(());
    }
    while markers.load()?.is_none() {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            _ = cancel.cancelled() => return Ok(()),
        }
    }
    let mut source = Source::connect(cfg).await?;
    let catalog = catalog(cfg, &mut source).await?;
    // Oldest first: one run per entity.
    for r in runs.iter().rev() {
        let run = initial_run(cfg, &catalog, &r.entity);
        let started = run.start(&mut sc).await?;
        info!(run = started.id, entity = %r.entity, resumed = started.resumed,
            queued = started.queued, "initial load: queueing every aggregate");
        let bar = Progress {
            id: started.id,
            bar: None,
            last_line: std::sync::Mutex::new(Instant::now()),
            started: Instant::now(),
        };
        let queued = run
            .queue(&started, &mut sc, &mut source, |q| bar.queued(q))
            .await?;
        info!(run = started.id, entity = %r.entity, queued,
            "initial load: every aggregate is queued; the appliers publish them");
    }
    Ok(())
}
