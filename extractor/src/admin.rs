//! What `skein validate`, `skein status`, `skein sql source` and
//! `skein marker reset --latest` ask of the source, whichever the dialect:
//! the binary calls these and never branches on `source.kind`.

use skein_common::config::{Config, PostgresSource, Source};
use skein_common::{PgLsn, SourcePosition};
use skein_sql::Catalog;

use crate::error::{src, Error, Result};
use crate::{postgres, sqlserver, MssqlSource};

/// What `skein validate` found.
#[derive(Debug, Default)]
pub struct Validation {
    /// Things to fix, each with the statement that fixes it.
    pub problems: Vec<String>,
    /// Facts worth knowing that need no fix.
    pub notes: Vec<String>,
    /// What was checked, when nothing is wrong.
    pub ok: String,
}

/// Checks the config against the source: tables, columns and types, and
/// the CDC set-up (PostgreSQL: `wal_level`, publication with its column
/// lists, replica identities, the slot; SQL Server: CDC on the database,
/// capture instances with key and join columns, the capture job).
pub async fn validate(cfg: &Config) -> Result<Validation> {
    match &cfg.source {
        Source::Postgres(pg) => validate_postgres(cfg, pg).await,
        Source::SqlServer(ms) => {
            // Connecting checks tables, columns and types; `check` the CDC set-up.
            let mut source = MssqlSource::connect(cfg, ms).await?;
            let notes = source.check().await?;
            Ok(Validation {
                notes,
                ok: format!(
                    "CDC is enabled, every tracked table has a readable capture instance with \
                     its key and join columns{}",
                    source
                        .instances()
                        .iter()
                        .map(|i| format!("\n  {}.{} <- {}", i.schema, i.table, i.name))
                        .collect::<String>()
                ),
                ..Validation::default()
            })
        }
    }
}

async fn validate_postgres(cfg: &Config, pg: &PostgresSource) -> Result<Validation> {
    use skein_sql::postgres::admin as q;
    let client = postgres::connect(&pg.url, "source").await?;
    let mut v = Validation {
        ok: "config and source are ready".into(),
        ..Validation::default()
    };
    let wal: String = client
        .query_one(q::WAL_LEVEL, &[])
        .await
        .map_err(src("reading wal_level"))?
        .get(0);
    if wal != "logical" {
        v.problems.push(format!(
            "wal_level is `{wal}`, logical decoding needs `logical`.\nFix: ALTER SYSTEM SET wal_level = logical; -- then restart PostgreSQL"
        ));
    }
    let catalog = postgres::load_catalog(&client, cfg).await?;
    let catalog_problems = skein_sql::postgres::check_catalog(cfg, &catalog);
    v.problems
        .extend(catalog_problems.iter().map(ToString::to_string));
    // The publication's fix is generated from the catalog: with tables or
    // columns missing it would be wrong, so those come first.
    if !catalog_problems.is_empty() {
        v.notes.push(
            "the publication and replica identities are checked once the tables and columns above are fixed"
                .into(),
        );
    } else {
        let ddl = skein_sql::postgres::source_ddl(cfg, pg, &catalog);
        let publication = &pg.publication;
        let exists = client
            .query_opt(q::PUBLICATION_EXISTS, &[publication])
            .await
            .map_err(src("reading the publication"))?
            .is_some();
        if !exists {
            v.problems.push(format!(
                "publication `{publication}` does not exist.\nFix (from `skein sql source`):\n{ddl}"
            ));
        } else {
            // Every tracked table must be published with the columns skein needs.
            for t in skein_sql::postgres::tracked_tables(cfg, &catalog) {
                let row = client
                    .query_opt(q::PUBLISHED_COLUMNS, &[publication, &t.schema, &t.table])
                    .await
                    .map_err(src("reading the published columns"))?;
                match row {
                    None => v.problems.push(format!(
                        "{}.{} is not in publication `{publication}`.\nFix (from `skein sql source`):\n{ddl}",
                        t.schema, t.table
                    )),
                    Some(r) => {
                        let cols: Vec<String> = r.get(0);
                        let missing: Vec<&String> =
                            t.columns.iter().filter(|c| !cols.contains(c)).collect();
                        if !missing.is_empty() {
                            v.problems.push(format!(
                                "publication `{publication}` does not carry {missing:?} of {}.{}.\nFix (from `skein sql source`):\n{ddl}",
                                t.schema, t.table
                            ));
                        }
                    }
                }
                if t.needs_full_identity {
                    if let Some(info) = catalog.table(&t.schema, &t.table) {
                        if info.replica_identity != 'f' {
                            v.problems.push(format!(
                                "{}.{}: deletes would not carry the join columns {:?} (replica identity is not FULL).\nFix: ALTER TABLE \"{}\".\"{}\" REPLICA IDENTITY FULL;",
                                t.schema, t.table, t.columns, t.schema, t.table
                            ));
                        }
                    }
                }
            }
        }
    }
    if catalog_problems.is_empty() {
        v.notes.extend(unindexed_joins(cfg, &client).await?);
    }
    let slot = &pg.slot;
    let status = client
        .query_opt(q::SLOT_WAL_STATUS, &[slot])
        .await
        .map_err(src("reading the replication slot"))?;
    match status {
        None => v.notes.push(format!(
            "replication slot `{slot}` does not exist yet; `skein run` creates it on first start"
        )),
        Some(r) if r.get::<_, String>(0) == "lost" => v.problems.push(format!(
            "replication slot `{slot}` was invalidated: changes were lost.\nFix: SELECT pg_drop_replication_slot('{slot}'); then `skein marker reset --latest --continue-with-data-loss`"
        )),
        Some(_) => {}
    }
    Ok(v)
}

/// A note per join whose rows hydration reads by columns no index of the
/// table begins with: every batch reading that join scans the whole table.
async fn unindexed_joins(cfg: &Config, client: &tokio_postgres::Client) -> Result<Vec<String>> {
    let mut notes = vec![];
    for e in &cfg.entities {
        for j in &e.joins {
            let schema = j.schema.as_deref().unwrap_or(&e.schema);
            let cols: Vec<String> = j.on.iter().map(|o| o.name.clone()).collect();
            let indexed: bool = client
                .query_one(
                    skein_sql::postgres::admin::INDEXED_BY,
                    &[&schema, &j.table, &cols],
                )
                .await
                .map_err(src("reading the indexes of a joined table"))?
                .get(0);
            if !indexed {
                let quoted: Vec<String> = cols.iter().map(|c| format!("\"{c}\"")).collect();
                notes.push(format!(
                    "`{}.{}` reads {schema}.{} by ({}), and no index of the table begins with \
                     those columns: each batch that reads the join scans the whole table.\n\
                     Fix: CREATE INDEX ON \"{schema}\".\"{}\" ({});",
                    e.name,
                    j.name,
                    j.table,
                    cols.join(", "),
                    j.table,
                    quoted.join(", ")
                ));
            }
        }
    }
    Ok(notes)
}

/// How far the sidecar says the pipeline has applied, for [`status`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    /// Up to this source position, the lowest of the partitions' (`None`:
    /// nothing applied yet). In-process, every partition gets every batch,
    /// so this is where the last batch with records ended.
    Source(Option<SourcePosition>),
    /// Offsets of a change topic (Kafka): only the extractor knows its
    /// source position.
    Offsets,
}

/// The source's part of `skein status`, as JSON: PostgreSQL, the slot's
/// confirmed position against the server's WAL end and how much of the
/// slot's retention its lag uses; SQL Server, CDC's max LSN, each capture
/// instance's min LSN (the validity interval), and how much of the CDC
/// cleanup job's retention the oldest change after `applied` uses (the
/// PostgreSQL field names where they mean the same).
pub async fn status(cfg: &Config, applied: Applied) -> Result<serde_json::Value> {
    match &cfg.source {
        Source::Postgres(pg) => {
            let client = postgres::connect(&pg.url, "source").await?;
            let row = client
                .query_opt(skein_sql::postgres::admin::SLOT_STATUS, &[&pg.slot])
                .await
                .map_err(src("reading the replication slot"))?;
            Ok(match row {
                None => serde_json::json!({ "slot": pg.slot, "exists": false }),
                Some(r) => {
                    let retention = postgres::Retention {
                        retained_bytes: r.get::<_, Option<i64>>(5).unwrap_or(0),
                        safe_wal_size: r.get(6),
                    };
                    let used = retention.used();
                    serde_json::json!({
                        "slot": pg.slot,
                        "exists": true,
                        "confirmed": r.get::<_, Option<String>>(0),
                        "wal_end": r.get::<_, String>(1),
                        "lag_bytes": r.get::<_, Option<i64>>(2),
                        "active": r.get::<_, bool>(3),
                        "wal_status": r.get::<_, String>(4),
                        "retained_bytes": retention.retained_bytes,
                        "safe_wal_size": retention.safe_wal_size,
                        "retention_used": used,
                        "retention_warning":
                            used.is_some_and(|u| u >= cfg.extractor.retention_warn_fraction),
                    })
                }
            })
        }
        Source::SqlServer(ms) => {
            let mut source = MssqlSource::connect(cfg, ms).await?;
            let (max, mins) = source.validity_interval().await?;
            let mut out = serde_json::json!({
                "max_lsn": max.to_string(),
                "capture_instances": mins
                    .iter()
                    .map(|(ci, min)| serde_json::json!({ "name": ci, "min_lsn": min.to_string() }))
                    .collect::<Vec<_>>(),
            });
            let fields = match applied {
                Applied::Source(at) => {
                    let at = at
                        .map(SourcePosition::sqlserver)
                        .transpose()
                        .map_err(|e| Error::Decode(format!("the sidecar's progress: {e}")))?;
                    let first = source.first_unread(at).await?;
                    match source.cleanup_retention(first).await? {
                        Ok(r) => {
                            let used = r.used();
                            serde_json::json!({
                                "oldest_unread_lsn": first.map(|l| l.to_string()),
                                "unread_age_seconds": r.unread_age_seconds,
                                "cleanup_retention_minutes": r.retention_minutes,
                                "retention_used": used,
                                "retention_warning": r.warns(cfg.extractor.retention_warn_fraction),
                            })
                        }
                        Err(reason) => retention_unknown(format!(
                            "cannot read msdb.dbo.cdc_jobs (the login needs read access to \
                             msdb): {reason}"
                        )),
                    }
                }
                Applied::Offsets => retention_unknown(
                    "over Kafka only the extractor knows how far it has read; its log warns \
                     when the cleanup retention nears"
                        .into(),
                ),
            };
            if let (Some(o), serde_json::Value::Object(f)) = (out.as_object_mut(), fields) {
                o.extend(f);
            }
            Ok(out)
        }
    }
}

/// The retention fields of a SQL Server status when they cannot be known.
fn retention_unknown(reason: String) -> serde_json::Value {
    serde_json::json!({
        "retention_used": null,
        "retention_warning": false,
        "retention_unknown": reason,
    })
}

/// The source's current end: what `marker reset --latest` moves to.
pub async fn head(cfg: &Config) -> Result<SourcePosition> {
    match &cfg.source {
        Source::Postgres(pg) => {
            let client = postgres::connect(&pg.url, "source").await?;
            let s: String = client
                .query_one(skein_sql::postgres::admin::CURRENT_WAL_LSN, &[])
                .await
                .map_err(src("reading the WAL end"))?
                .get(0);
            Ok(s.parse::<PgLsn>()
                .map_err(|e| Error::Decode(format!("pg_current_wal_lsn: {e}")))?
                .into())
        }
        Source::SqlServer(ms) => Ok(MssqlSource::connect(cfg, ms)
            .await?
            .current_max_lsn()
            .await?
            .into()),
    }
}

/// The CDC enablement of `skein sql source`: the statements, and with
/// `apply` run against the source (what was applied is returned as a
/// message). A config naming tables or columns the source lacks is refused
/// with every problem listed.
pub async fn enable_cdc(cfg: &Config, apply: bool) -> Result<CdcSetup> {
    match &cfg.source {
        Source::Postgres(pg) => {
            let client = postgres::connect(&pg.url, "source").await?;
            let catalog = postgres::load_catalog(&client, cfg).await?;
            refuse_catalog_problems(cfg, &catalog)?;
            let ddl = skein_sql::postgres::source_ddl(cfg, pg, &catalog);
            if apply {
                client
                    .batch_execute(&ddl)
                    .await
                    .map_err(src("enabling the publication"))?;
            }
            Ok(CdcSetup {
                applied: apply.then(|| "publication and replica identities".to_string()),
                ddl,
            })
        }
        Source::SqlServer(ms) => {
            let mut client = skein_sql::sqlserver::MssqlClient::connect(ms.url.expose()).await?;
            let catalog = sqlserver::load_catalog(&mut client, cfg).await?;
            refuse_catalog_problems(cfg, &catalog)?;
            let ddl = skein_sql::sqlserver::source_ddl(cfg, &catalog);
            if apply {
                client.batch("enabling CDC", &ddl).await?;
            }
            Ok(CdcSetup {
                applied: apply.then(|| {
                    format!(
                        "CDC enablement for {} table(s)",
                        skein_sql::postgres::tracked_tables(cfg, &catalog).len()
                    )
                }),
                ddl,
            })
        }
    }
}

/// What [`enable_cdc`] produced.
#[derive(Debug)]
pub struct CdcSetup {
    /// The statements, in the source's dialect.
    pub ddl: String,
    /// What was applied, when they were run.
    pub applied: Option<String>,
}

/// Every table or column the config names that the source lacks, as one
/// error listing them all.
fn refuse_catalog_problems(cfg: &Config, catalog: &Catalog) -> Result<()> {
    let problems = skein_sql::postgres::check_catalog(cfg, catalog);
    if problems.is_empty() {
        return Ok(());
    }
    Err(Error::NotReady {
        message: format!(
            "{} problem(s) in the config against the source:\n{}",
            problems.len(),
            problems
                .iter()
                .map(|p| format!("  {p}"))
                .collect::<Vec<_>>()
                .join("\n")
        ),
        fix: "create the tables/columns or fix the config, then run `skein validate`".into(),
    })
}
