//! The PostgreSQL scenario list against a real SQL Server.
//!
//! Needs `SKEIN_TEST_MSSQL_URL` (an ADO.NET connection string without a
//! database, for a login that may create databases and enable CDC, on a
//! server whose SQL Server Agent runs) and `SKEIN_TEST_PG_URL` (the
//! sidecar). No SQL Server can run on the machines this project is built
//! on, so every test here is `#[ignore]`d: `cargo test` reports them as
//! ignored, never as passed. Run them with
//!
//! ```text
//! SKEIN_TEST_MSSQL_URL="server=tcp:localhost,1433;user=sa;password=…;TrustServerCertificate=true" \
//!   scripts/test-mssql
//! ```
//!
//! (the README shows how to start SQL Server with docker compose). With
//! `--ignored` and no URL, each test fails.
//!
//! The quickstart aggregate is created with `examples/quickstart/schema.sqlserver.sql`,
//! whose types give the same event JSON as PostgreSQL's, so the scenarios
//! compare against the PostgreSQL golden files (with `/dbo/` for
//! `/public/` in `source`): equal data and equal etags across dialects.
//!
//! Settling: CDC's capture job reads the log a few seconds after a commit,
//! so the harness does not poll positions. It bumps a sentinel customer
//! (id 999) and waits until that event is in the outbox and nothing is
//! pending: in-process, a batch is sent only after every earlier batch was
//! committed by every partition, so everything before the sentinel is
//! through. Sentinel events are left out of every assertion.

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{
    acked_parts, admin_url, assert_exactly_once_in, assert_golden, connect, only_event, received,
    recreate_db, root, BIN,
};
use serde_json::Value;
use skein_common::sqlvalue::SqlValue;
use skein_sql::sqlserver::MssqlClient;

const SENTINEL: &str = "customer.999";

fn mssql_url() -> String {
    std::env::var("SKEIN_TEST_MSSQL_URL").expect(
        "SKEIN_TEST_MSSQL_URL is not set: these tests need a SQL Server with its Agent running \
         (README: \"SQL Server\")",
    )
}

async fn ms(url: &str) -> MssqlClient {
    MssqlClient::connect(url)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to SQL Server: {e}"))
}

async fn ms_exec(c: &mut MssqlClient, sql: &str) {
    c.batch("test statement", sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

struct MsEnv {
    dir: PathBuf,
    config: PathBuf,
    url: String,
    db: MssqlClient,
    sidecar: tokio_postgres::Client,
    sync: u32,
}

impl MsEnv {
    /// A fresh SQL Server database `skein_t_<name>` with the quickstart
    /// tables and CDC enabled by `skein sql source`, a fresh sidecar
    /// database on PostgreSQL, and a config with `edit` applied.
    async fn new(name: &str, edit: impl Fn(String) -> String) -> MsEnv {
        MsEnv::with_tables(name, "", edit).await
    }

    /// [`MsEnv::new`] with batches of at most `max` changes.
    async fn small_batches(name: &str, max: usize) -> MsEnv {
        MsEnv::new(name, move |y| {
            y.replace(
                "extractor: { max_batch_wait_ms: 200 }",
                &format!("extractor: {{ max_batch_wait_ms: 200, max_batch_changes: {max} }}"),
            )
        })
        .await
    }

    /// [`MsEnv::new`], running `tables` (T-SQL) before `sql source`.
    async fn with_tables(name: &str, tables: &str, edit: impl Fn(String) -> String) -> MsEnv {
        let base = mssql_url();
        let db_name = format!("skein_t_{name}");
        let mut master = ms(&base).await;
        ms_exec(
            &mut master,
            &format!(
                "IF DB_ID(N'{db_name}') IS NOT NULL BEGIN \
                   EXEC(N'USE [{db_name}]; IF EXISTS (SELECT 1 FROM sys.databases WHERE name = DB_NAME() AND is_cdc_enabled = 1) EXEC sys.sp_cdc_disable_db'); \
                   ALTER DATABASE [{db_name}] SET SINGLE_USER WITH ROLLBACK IMMEDIATE; \
                   DROP DATABASE [{db_name}]; \
                 END; \
                 CREATE DATABASE [{db_name}];"
            ),
        )
        .await;
        let url = format!("{};database={db_name}", base.trim_end_matches(';'));
        let mut db = ms(&url).await;
        ms_exec(
            &mut db,
            &std::fs::read_to_string(root().join("examples/quickstart/schema.sqlserver.sql"))
                .unwrap(),
        )
        .await;
        if !tables.is_empty() {
            ms_exec(&mut db, tables).await;
        }

        let admin = connect(&admin_url()).await;
        let sidecar_db = format!("skein_tms_{name}");
        recreate_db(&admin, &sidecar_db).await;
        let sidecar_url = format!("{}/{sidecar_db}", admin_url().rsplit_once('/').unwrap().0);
        let sidecar = connect(&sidecar_url).await;

        let dir = root()
            .join("target/test-runs")
            .join(format!("mssql_{name}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let yaml = std::fs::read_to_string(root().join("examples/quickstart/skein.yaml"))
            .unwrap()
            .replace("  kind: postgres\n", "  kind: sqlserver\n")
            .replace(
                "  slot: skein_quickstart\n  publication: skein_quickstart\n",
                "",
            )
            .replace(
                "sidecar:\n",
                &format!("sidecar:\n  url: \"{sidecar_url}\"\n"),
            )
            .replace("    schema: public\n", "    schema: dbo\n")
            .replace("also_stdout: true", "also_stdout: false")
            .replace(
                "state_dir:",
                "extractor: { max_batch_wait_ms: 200 }\nstate_dir:",
            );
        let config = dir.join("skein.yaml");
        std::fs::write(&config, edit(yaml)).unwrap();
        let mut env = MsEnv {
            dir,
            config,
            url,
            db,
            sidecar,
            sync: 0,
        };
        let ddl = env.skein_ok(&["sql", "source"]);
        ms_exec(&mut env.db, &ddl).await;
        // Running `sql source` twice changes nothing (idempotent).
        let again = env.skein_ok(&["sql", "source"]);
        ms_exec(&mut env.db, &again).await;
        env
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(BIN);
        c.args(args)
            .arg("--config")
            .arg(&self.config)
            .env("SKEIN_SOURCE_URL", &self.url)
            .env("SKEIN_OUT_DIR", &self.dir)
            .env_remove("SKEIN_FAILPOINT");
        c
    }

    fn skein_ok(&self, args: &[&str]) -> String {
        let out = self.command(args).output().unwrap();
        assert!(
            out.status.success(),
            "skein {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("skein.log")).unwrap_or_default()
    }

    fn start(&self) -> Child {
        self.start_with(None)
    }

    /// `skein run`, its log appended to `skein.log`, with `failpoint`
    /// (`SKEIN_FAILPOINT`) set when given.
    fn start_with(&self, failpoint: Option<&str>) -> Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("skein.log"))
            .unwrap();
        let mut c = self.command(&["run"]);
        if let Some(f) = failpoint {
            c.env("SKEIN_FAILPOINT", f);
        }
        c.stdout(Stdio::null()).stderr(log).spawn().unwrap()
    }

    fn stop(&self, mut child: Child) {
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        self.wait_exit(&mut child, Duration::from_secs(30), "skein did not stop");
    }

    async fn exec(&mut self, sql: &str) {
        ms_exec(&mut self.db, sql).await;
    }

    /// Runs `sql`, then waits until the pipeline has published its effect.
    async fn step(&mut self, run: &mut Child, sql: &str) {
        self.exec(sql).await;
        self.settle(run).await;
    }

    /// Writes a new name to the sentinel customer (creating it the first
    /// time) and returns the name.
    async fn bump_sentinel(&mut self) -> String {
        self.sync += 1;
        let mark = format!("sync-{}", self.sync);
        self.exec(&format!(
            "IF EXISTS (SELECT 1 FROM dbo.customer WHERE id = 999) \
               UPDATE dbo.customer SET name = N'{mark}' WHERE id = 999; \
             ELSE INSERT INTO dbo.customer (id, name) VALUES (999, N'{mark}');"
        ))
        .await;
        mark
    }

    /// Bumps the sentinel and waits for its event with nothing pending.
    async fn settle(&mut self, run: &mut Child) {
        let mark = self.bump_sentinel().await;
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            if let Some(status) = run.try_wait().unwrap() {
                panic!("skein exited ({status}): {}", self.log());
            }
            let row = self
                .sidecar
                .query_one(
                    "SELECT EXISTS (SELECT 1 FROM skein.outbox WHERE key = '[\"999\"]' AND event::jsonb #>> '{data,name}' = $1) \
                       AND NOT EXISTS (SELECT 1 FROM skein.outbox WHERE dequeued_at IS NULL)",
                    &[&mark],
                )
                .await;
            if matches!(row.map(|r| r.get::<_, bool>(0)), Ok(true)) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "pipeline did not settle: {}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Waits until a run started with a failpoint has died at it.
    fn died_at_failpoint(&self, run: &mut Child) {
        self.wait_exit(run, Duration::from_secs(90), "the failpoint did not fire");
    }

    /// Waits until `child` has exited; fails with `what` and the log when
    /// it has not `within`.
    fn wait_exit(&self, child: &mut Child, within: Duration, what: &str) {
        let deadline = Instant::now() + within;
        while child.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "{what}: {}", self.log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Starts `skein run`, waits until everything committed so far is
    /// published, and stops it.
    async fn run_until_settled(&mut self) {
        let mut run = self.start();
        self.settle(&mut run).await;
        self.stop(run);
    }

    /// File-sink events, sentinel left out, `source` as on PostgreSQL.
    fn events(&self) -> Vec<Value> {
        let sent = std::fs::read_to_string(self.dir.join("events.jsonl"))
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .collect();
        received(sent)
            .into_iter()
            .filter(|e| e["subject"] != SENTINEL)
            .map(|mut e| {
                if let Some(s) = e["source"].as_str() {
                    e["source"] = s.replace("/dbo/", "/public/").into();
                }
                e
            })
            .collect()
    }

    async fn outbox(&self) -> Vec<Value> {
        self.sidecar
            .query("SELECT event FROM skein.outbox ORDER BY id", &[])
            .await
            .unwrap()
            .iter()
            .map(|r| serde_json::from_str::<Value>(r.get::<_, &str>(0)).unwrap())
            .filter(|e| e["subject"] != SENTINEL)
            .collect()
    }

    /// Unique ids, file ⊆ outbox, no aggregate twice in a row with one etag.
    async fn assert_exactly_once(&self) {
        assert_exactly_once_in(&self.outbox().await, &self.events());
    }

    /// The highest LSN CDC has written (to force cleanup in data-loss tests).
    async fn max_lsn(&mut self) -> Vec<u8> {
        let rows = self
            .db
            .query("max lsn", "SELECT sys.fn_cdc_get_max_lsn()", &[])
            .await
            .unwrap();
        match rows.first().and_then(|r| r.first()) {
            Some(SqlValue::Binary(b)) => b.clone(),
            // Nothing captured yet: below every LSN.
            Some(SqlValue::Null) | None => vec![],
            other => panic!("max lsn: {other:?}"),
        }
    }

    /// Waits until the capture job has read everything committed so far
    /// (a sentinel change committed last has a captured LSN).
    async fn wait_captured(&mut self) {
        let before = self.max_lsn().await;
        self.bump_sentinel().await;
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.max_lsn().await <= before {
            assert!(
                Instant::now() < deadline,
                "the CDC capture job does not run (is SQL Server Agent on?)"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

fn same(y: String) -> String {
    y
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs SQL Server: set SKEIN_TEST_MSSQL_URL, run scripts/test-mssql"]
async fn mssql_no_changes_publishes_nothing() {
    let mut env = MsEnv::new("no_changes", same).await;
    let mut run = env.start();
    env.settle(&mut run).await;
    env.step(
        &mut run,
        "CREATE TABLE dbo.unrelated (id int); INSERT INTO dbo.unrelated VALUES (1);",
    )
    .await;
    env.stop(run);
    assert!(env.events().is_empty(), "{:?}", env.events());
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs SQL Server: set SKEIN_TEST_MSSQL_URL, run scripts/test-mssql"]
async fn mssql_multiple_changes_in_one_transaction_publish_one_create() {
    let mut env = MsEnv::new("multiple_changes", same).await;
    let mut run = env.start();
    env.step(
        &mut run,
        "BEGIN TRAN;
         INSERT INTO dbo.customer (id, name, email) VALUES (1, N'Ada', N'a@x');
         UPDATE dbo.customer SET name = N'Ada L.' WHERE id = 1;
         INSERT INTO dbo.address (id, customer_id, kind, city) VALUES (10, 1, N'home', N'London');
         INSERT INTO dbo.contact VALUES (1, N'phone', N'1'), (1, N'mail', N'a@x');
         COMMIT;",
    )
    .await;
    env.stop(run);
    assert_golden("multiple_changes", &env.events());
    env.assert_exactly_once().await;
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs SQL Server: set SKEIN_TEST_MSSQL_URL, run scripts/test-mssql"]
async fn mssql_update_then_delete_and_create_update_then_delete() {
    let mut env = MsEnv::new("update_then_delete", same).await;
    let mut run = env.start();
    env.step(
        &mut run,
        "INSERT INTO dbo.customer (id, name) VALUES (1, N'Ada');",
    )
    .await;
    env.exec("BEGIN TRAN; UPDATE dbo.customer SET name = N'x' WHERE id = 1; DELETE FROM dbo.customer WHERE id = 1; COMMIT;")
        .await;
    env.step(
        &mut run,
        "BEGIN TRAN; INSERT INTO dbo.customer (id, name) VALUES (2, N'Bob'); \
         UPDATE dbo.customer SET name = N'B' WHERE id = 2; DELETE FROM dbo.customer WHERE id = 2; COMMIT;",
    )
    .await;
    env.stop(run);
    assert_golden("update_then_delete", &env.events());
    env.assert_exactly_once().await;
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs SQL Server: set SKEIN_TEST_MSSQL_URL, run scripts/test-mssql"]
async fn mssql_create_update_with_upcoming_delete_publishes_only_the_delete() {
    let mut env = MsEnv::small_batches("upcoming_delete", 2).await;
    env.exec("BEGIN TRAN; INSERT INTO dbo.customer (id, name) VALUES (1, N'Ada'); UPDATE dbo.customer SET name = N'A' WHERE id = 1; COMMIT;")
        .await;
    env.exec("DELETE FROM dbo.customer WHERE id = 1;").await;
    env.wait_captured().await;
    env.run_until_settled().await;
    assert_golden("upcoming_delete", &env.events());
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs SQL Server: set SKEIN_TEST_MSSQL_URL, run scripts/test-mssql"]
async fn mssql_same_version_and_excluded_row_version_publish_nothing() {
    let mut env = MsEnv::new("same_version", same).await;
    let mut run = env.start();
    env.step(&mut run, "INSERT INTO dbo.customer (id, name) VALUES (1, N'Ada'); INSERT INTO dbo.address VALUES (10, 1, N'home', N'London');")
        .await;
    env.exec("UPDATE dbo.customer SET name = name WHERE id = 1;")
        .await;
    env.exec("UPDATE dbo.customer SET row_version = row_version + 1 WHERE id = 1;")
        .await;
    env.step(
        &mut run,
        "UPDATE dbo.address SET city = N'London' WHERE id = 10;",
    )
    .await;
    env.step(
        &mut run,
        "UPDATE dbo.address SET city = N'Paris' WHERE id = 10;",
    )
    .await;
    env.stop(run);
    assert_golden("same_version", &env.events());
    env.assert_exactly_once().await;
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs SQL Server: set SKEIN_TEST_MSSQL_URL, run scripts/test-mssql"]
async fn mssql_logical_delete_publishes_delete_then_create_on_undelete() {
    let mut env = MsEnv::new("logical_delete", same).await;
    let mut run = env.start();
    for s in [
        "INSERT INTO dbo.customer (id, name, email) VALUES (1, N'Ada', N'a@x');",
        "UPDATE dbo.customer SET is_deleted = 1 WHERE id = 1;",
        "UPDATE dbo.customer SET email = N'b@x' WHERE id = 1;",
        "UPDATE dbo.customer SET is_deleted = 0 WHERE id = 1;",
    ] {
        env.step(&mut run, s).await;
    }
    env.stop(run);
    assert_golden("logical_delete", &env.events());
    env.assert_exactly_once().await;
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs SQL Server: set SKEIN_TEST_MSSQL_URL, run scripts/test-mssql"]
async fn mssql_children_grandchildren_moves_and_key_updates() {
    let mut env = MsEnv::new("relations", same).await;
    let mut run = env.start();
    for s in [
        "INSERT INTO dbo.customer (id, name) VALUES (1, N'Ada'), (2, N'Grace');",
        "INSERT INTO dbo.address VALUES (10, 1, N'home', N'London');",
        "INSERT INTO dbo.address_line VALUES (10, 1, N'line one');",
        "UPDATE dbo.address_line SET text = N'line 1' WHERE address_id = 10;",
        "UPDATE dbo.address SET customer_id = 2 WHERE id = 10;",
        "UPDATE dbo.address SET customer_id = NULL WHERE id = 10;",
        "INSERT INTO dbo.address_line VALUES (10, 2, N'orphan line');",
        "UPDATE dbo.customer SET id = 3 WHERE id = 1;",
        "DELETE FROM dbo.address WHERE id = 10;",
    ] {
        env.step(&mut run, s).await;
    }
    env.stop(run);
    assert_golden("relations", &env.events());
    env.assert_exactly_once().await;
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs SQL Server: set SKEIN_TEST_MSSQL_URL, run scripts/test-mssql"]
async fn mssql_column_types_have_the_postgres_formats() {
    let mut env = MsEnv::with_tables(
        "types",
        "CREATE TABLE dbo.typed (id int NOT NULL, code nvarchar(20) NOT NULL, tiny tinyint, small smallint,
           big bigint, amount decimal(20,6), cash money, flag bit, note nvarchar(max), fixed char(3),
           at datetimeoffset(7), local datetime2(7), old datetime, day date, clock time(7),
           uid uniqueidentifier, raw varbinary(16), rv rowversion, ratio float, r real,
           PRIMARY KEY (id, code));",
        |y| {
            let start = y.find("entities:").unwrap();
            format!("{}entities:\n  - name: typed\n    schema: dbo\n    table: typed\n", &y[..start])
        },
    )
    .await;
    let run = env.start();
    env.exec(
        "INSERT INTO dbo.typed (id, code, tiny, small, big, amount, cash, flag, note, fixed, at, local,
           old, day, clock, uid, raw, ratio, r)
         VALUES (1, N'k-ü', 255, -32768, 9007199254740993, 12345.678900, 922337203685477.5807, 1,
           N'héllo \"wörld\" ✓', 'abc', '2024-02-29T23:59:59.1234567+02:00', '2024-02-29T21:59:59.1234567',
           '2024-02-29T21:59:59.997', '2024-02-29', '21:59:59.1234567',
           'A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11', 0x00FF10, 1.5, 1.1);",
    )
    .await;
    // The typed table has no sentinel: wait for its own event.
    let deadline = Instant::now() + Duration::from_secs(90);
    let ev = loop {
        if let Some(e) = env
            .outbox()
            .await
            .into_iter()
            .find(|e| e["subject"] == "typed.1,k-ü")
        {
            break e;
        }
        assert!(Instant::now() < deadline, "no event: {}", env.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    env.stop(run);
    let d = &ev["data"];
    assert_eq!(d["tiny"], 255);
    assert_eq!(d["small"], -32768);
    assert_eq!(d["big"], 9007199254740993i64);
    assert_eq!(d["amount"], "12345.678900");
    assert_eq!(d["cash"], "922337203685477.5807");
    assert_eq!(d["flag"], true);
    assert_eq!(d["note"], "héllo \"wörld\" ✓");
    assert_eq!(d["fixed"], "abc");
    assert_eq!(d["at"], "2024-02-29T21:59:59.123456Z");
    assert_eq!(d["local"], "2024-02-29T21:59:59.123456");
    assert_eq!(d["old"], "2024-02-29T21:59:59.996666");
    assert_eq!(d["day"], "2024-02-29");
    assert_eq!(d["clock"], "21:59:59.123456");
    assert_eq!(d["uid"], "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11");
    assert_eq!(d["raw"], "AP8Q");
    assert!(d["rv"].as_str().is_some_and(|s| s.len() == 12), "{d}");
    assert_eq!(d["ratio"], 1.5);
    assert_eq!(d["r"], 1.1);
    assert_eq!(ev["key"], "1,k-ü");
}

/// Runs the pipeline until customer 1 (Ada) is published, then stops it.
async fn publish_ada(env: &mut MsEnv) {
    let mut run = env.start();
    env.step(
        &mut run,
        "INSERT INTO dbo.customer (id, name) VALUES (1, N'Ada');",
    )
    .await;
    env.stop(run);
}

/// Publishes customer 1, stops, changes it, lets CDC cleanup remove the
/// change, and returns (so the next start finds the marker before `min_lsn`).
async fn publish_then_lose_a_change(env: &mut MsEnv) {
    publish_ada(env).await;
    env.exec("UPDATE dbo.customer SET name = N'lost' WHERE id = 1;")
        .await;
    env.wait_captured().await;
    let max = env.max_lsn().await;
    let hex: String = max.iter().map(|b| format!("{b:02X}")).collect();
    for ci in [
        "dbo_customer",
        "dbo_address",
        "dbo_address_line",
        "dbo_contact",
    ] {
        env.exec(&format!(
            "EXEC sys.sp_cdc_cleanup_change_table @capture_instance = N'{ci}', @low_water_mark = 0x{hex}, @threshold = 100000;"
        ))
        .await;
    }
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs SQL Server: set SKEIN_TEST_MSSQL_URL, run scripts/test-mssql"]
async fn mssql_data_loss_stops_with_a_clear_error() {
    let mut env = MsEnv::new("data_loss_stop", same).await;
    publish_then_lose_a_change(&mut env).await;
    let out = env.command(&["run"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("data loss") && err.contains("capture instance"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs SQL Server: set SKEIN_TEST_MSSQL_URL, run scripts/test-mssql"]
async fn mssql_data_loss_continue_records_it_and_goes_on() {
    let mut env = MsEnv::new("data_loss_continue", |y| {
        y.replace(
            "extractor: { max_batch_wait_ms: 200 }",
            "extractor: { max_batch_wait_ms: 200, continue_with_data_loss: true }",
        )
    })
    .await;
    publish_then_lose_a_change(&mut env).await;
    let mut run = env.start();
    env.step(
        &mut run,
        "UPDATE dbo.customer SET email = N'after@x' WHERE id = 1;",
    )
    .await;
    env.stop(run);
    let lossy: i64 = env
        .sidecar
        .query_one("SELECT count(*) FROM skein.batch WHERE has_data_loss", &[])
        .await
        .unwrap()
        .get(0);
    assert!(lossy >= 1, "the loss is recorded on a batch");
    let last = env.events().last().cloned().unwrap();
    assert_eq!(last["data"]["email"], "after@x");
    env.assert_exactly_once().await;
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs SQL Server: set SKEIN_TEST_MSSQL_URL, run scripts/test-mssql"]
async fn mssql_crash_between_outbox_and_progress_publishes_nothing_twice() {
    let mut env = MsEnv::new("retry_incomplete", same).await;
    publish_ada(&mut env).await;
    // The next batch dies after its sidecar commit, before the extractor
    // stores its marker: the restart re-reads the window, appliers drop it.
    let mut crashing = env
        .command(&["run"])
        .env("SKEIN_FAILPOINT", "extractor.after_ack_before_marker")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    env.exec("UPDATE dbo.customer SET name = N'Ada L.' WHERE id = 1;")
        .await;
    env.died_at_failpoint(&mut crashing);
    env.run_until_settled().await;
    let names: Vec<Value> = env
        .events()
        .iter()
        .map(|e| e["data"]["name"].clone())
        .collect();
    assert_eq!(names, vec![Value::from("Ada"), Value::from("Ada L.")]);
    env.assert_exactly_once().await;
}

/// One transaction of 60 change rows over two tables: 30 customers, an
/// address for every third, then 10 of the customers renamed (an update
/// is two rows: before and after).
fn large_transaction() -> String {
    let mut sql = String::from("BEGIN TRANSACTION;\n");
    for i in 1..=30 {
        sql += &format!("INSERT INTO dbo.customer (id, name) VALUES ({i}, N'c{i}');\n");
        if i % 3 == 0 {
            sql += &format!(
                "INSERT INTO dbo.address (id, customer_id, kind, city) \
                 VALUES ({i}, {i}, N'home', N'City {i}');\n"
            );
        }
    }
    sql += "UPDATE dbo.customer SET name = N'u' + CAST(id AS nvarchar(10)) WHERE id <= 10;\n";
    sql + "COMMIT;"
}

/// A transaction of 3 x max_batch_changes rows goes in parts of 20 rows;
/// a crash after the second part's marker resumes after the last
/// `__$seqval` handed over: no part is sent twice, every aggregate is
/// published once with its final state.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs SQL Server: set SKEIN_TEST_MSSQL_URL, run scripts/test-mssql"]
async fn mssql_a_large_transaction_goes_in_parts_and_resumes_after_a_crash() {
    let mut env = MsEnv::small_batches("large_tx", 20).await;
    env.run_until_settled().await;
    let mut crashing = env.start_with(Some("extractor.after_part_marker:2"));
    env.exec(&large_transaction()).await;
    env.died_at_failpoint(&mut crashing);
    let marker = env.skein_ok(&["marker", "show"]);
    // 40 inserts in two parts of 20 rows; the updates' 20 rows are the last.
    assert!(
        marker.contains("in flight: 40 changes") && marker.contains("__$seqval 0x"),
        "{marker}"
    );
    env.run_until_settled().await;
    let log = env.log();
    assert!(log.contains("handing it over in parts"), "{log}");
    assert!(
        log.contains("continues after the stored __$seqval"),
        "{log}"
    );
    assert_eq!(acked_parts(&log), [20, 40], "parts were sent again:\n{log}");
    let marker = env.skein_ok(&["marker", "show"]);
    assert!(!marker.contains("in flight"), "{marker}");
    let events = env.events();
    assert_eq!(events.len(), 30, "one event per customer: {events:?}");
    for i in 1..=30 {
        let e = only_event(&events, &format!("customer.{i}"));
        assert_eq!(e["action"], "created", "{e}");
        let name = if i <= 10 {
            format!("u{i}")
        } else {
            format!("c{i}")
        };
        assert_eq!(e["data"]["name"], name.as_str(), "{e}");
        assert_eq!(
            e["data"]["addresses"].as_array().map_or(0, Vec::len),
            usize::from(i % 3 == 0),
            "{e}"
        );
    }
    env.assert_exactly_once().await;
}

/// A join added to the config while a transaction is in flight, its
/// table's capture instance there all along with a change between the
/// marker and that transaction: reading on after the stored `__$seqval`
/// would skip it, so the restart stops, naming the instance, the LSNs and
/// the way out. Taking it (the previous config until the transaction is
/// handed over, then this one) finishes the transaction.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs SQL Server: set SKEIN_TEST_MSSQL_URL, run scripts/test-mssql"]
async fn mssql_a_table_added_while_a_transaction_is_in_flight_stops_clearly() {
    // `sql source` enabled CDC on every table of the config, contact too.
    let mut env = MsEnv::small_batches("large_tx_added", 20).await;
    let full = std::fs::read_to_string(&env.config).unwrap();
    let contacts = "      - { name: contacts, table: contact, join_to: customer,\n          \
                    on: [{ name: customer_id, to_column: id }] }\n";
    assert!(full.contains(contacts), "{full}");
    let without = full.replace(contacts, "");
    std::fs::write(&env.config, &without).unwrap();
    env.run_until_settled().await;
    // Skein stopped: a contact change, then the large transaction.
    env.exec("INSERT INTO dbo.contact VALUES (999, N'phone', N'1');")
        .await;
    env.exec(&large_transaction()).await;
    env.wait_captured().await;
    let mut crashing = env.start_with(Some("extractor.after_part_marker:1"));
    env.died_at_failpoint(&mut crashing);
    let marker = env.skein_ok(&["marker", "show"]);
    assert!(marker.contains("in flight: 20 changes"), "{marker}");
    // The contacts join back: dbo_contact's change lies before the
    // transaction in flight.
    std::fs::write(&env.config, &full).unwrap();
    let out = env.command(&["run"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("capture instance `dbo_contact` has changes at 0x")
            && err.contains("handed over in parts")
            && err.contains("skein marker reset --to 0x"),
        "{err}"
    );
    assert!(
        env.skein_ok(&["marker", "show"])
            .contains("in flight: 20 changes"),
        "the stop moved nothing"
    );
    // The way out: the previous config until the transaction is handed over.
    std::fs::write(&env.config, &without).unwrap();
    env.run_until_settled().await;
    let marker = env.skein_ok(&["marker", "show"]);
    assert!(!marker.contains("in flight"), "{marker}");
    std::fs::write(&env.config, &full).unwrap();
    env.run_until_settled().await;
    assert_eq!(env.events().len(), 30, "one event per customer");
    env.assert_exactly_once().await;
}

/// DDL committed just before a transaction handed over in parts is in the
/// window of each of its parts: it is followed (and logged) once, not once
/// per part.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs SQL Server: set SKEIN_TEST_MSSQL_URL, run scripts/test-mssql"]
async fn mssql_ddl_before_a_large_transaction_is_followed_once() {
    let mut env = MsEnv::small_batches("large_tx_ddl", 20).await;
    env.run_until_settled().await;
    env.exec("ALTER TABLE dbo.customer ADD tier nvarchar(20) NULL;")
        .await;
    env.exec(&large_transaction()).await;
    env.run_until_settled().await;
    let log = env.log();
    assert_eq!(acked_parts(&log), [20, 40], "{log}");
    let followed = log
        .lines()
        .filter(|l| {
            l.contains("DDL on a tracked table changes nothing skein reads")
                || l.contains("resolution follows it")
        })
        .count();
    assert_eq!(followed, 1, "the DDL is followed once:\n{log}");
    assert_eq!(env.events().len(), 30, "one event per customer");
    env.assert_exactly_once().await;
}

/// The sidecar in the source database, on SQL Server (no `sidecar.url`):
/// the same events, committed by the T-SQL batch transaction.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs SQL Server: set SKEIN_TEST_MSSQL_URL, run scripts/test-mssql"]
async fn mssql_sidecar_on_sql_server_commits_each_event_once() {
    let mut env = MsEnv::new("sidecar_mssql", |y| {
        let start = y.find("sidecar:\n").unwrap();
        let end = start + y[start..].find("transport:").unwrap();
        format!("{}sidecar:\n  schema: skein\n{}", &y[..start], &y[end..])
    })
    .await;
    env.skein_ok(&["sidecar", "migrate"]);
    let mut run = env.start();
    env.exec(
        "BEGIN TRAN;
         INSERT INTO dbo.customer (id, name, email) VALUES (1, N'Ada', N'a@x');
         UPDATE dbo.customer SET name = N'Ada L.' WHERE id = 1;
         INSERT INTO dbo.address (id, customer_id, kind, city) VALUES (10, 1, N'home', N'London');
         INSERT INTO dbo.contact VALUES (1, N'phone', N'1'), (1, N'mail', N'a@x');
         COMMIT;",
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(90);
    while env.events().is_empty() {
        if let Some(status) = run.try_wait().unwrap() {
            panic!("skein exited ({status}): {}", env.log());
        }
        assert!(Instant::now() < deadline, "no event: {}", env.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The same content again publishes nothing; a real change publishes once.
    env.exec("UPDATE dbo.customer SET name = name WHERE id = 1;")
        .await;
    env.exec("UPDATE dbo.customer SET email = N'b@x' WHERE id = 1;")
        .await;
    let deadline = Instant::now() + Duration::from_secs(90);
    while env.events().len() < 2 {
        assert!(Instant::now() < deadline, "no second event: {}", env.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    env.stop(run);
    let events = env.events();
    assert_golden("multiple_changes", &events[..1]);
    assert_eq!(events.len(), 2, "{events:?}");
    assert_eq!(events[1]["data"]["email"], "b@x");
    let rows = env
        .db
        .query(
            "outbox",
            "SELECT COUNT(*), COUNT(DISTINCT [event_id]) FROM [skein].[outbox] WHERE [dequeued_at] IS NOT NULL",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(rows[0][0], rows[0][1], "event ids are unique");
    assert_eq!(rows[0][0], SqlValue::Int(2));
}

/// `source.time_zone`: commit times recorded as local times on either
/// side of a DST switch each get their own day's offset. The capture job
/// records the server's clock; the test rewrites the two transactions'
/// `tran_end_time` (sysadmin may) before skein reads them, to a January
/// and a July noon in Central Europe (UTC+1, then UTC+2).
#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs SQL Server: set SKEIN_TEST_MSSQL_URL, run scripts/test-mssql"]
async fn mssql_commit_times_keep_their_own_dst_offset() {
    let mut env = MsEnv::new("dst", |y| {
        y.replace(
            "  kind: sqlserver\n",
            "  kind: sqlserver\n  time_zone: \"W. Europe Standard Time\"\n",
        )
    })
    .await;
    env.exec("INSERT INTO dbo.customer (id, name) VALUES (1, N'winter');")
        .await;
    env.exec("INSERT INTO dbo.customer (id, name) VALUES (2, N'summer');")
        .await;
    env.wait_captured().await;
    env.exec(
        "UPDATE m SET tran_end_time = CASE c.[id] WHEN 1 THEN '2024-01-15T12:00:00' ELSE '2024-07-15T12:00:00' END \
         FROM cdc.lsn_time_mapping m JOIN cdc.[dbo_customer_CT] c ON c.[__$start_lsn] = m.start_lsn \
         WHERE c.[id] IN (1, 2);",
    )
    .await;
    env.run_until_settled().await;
    let time = |subject: &str| {
        env.events()
            .iter()
            .find(|e| e["subject"] == subject)
            .map(|e| e["time"].clone())
    };
    assert_eq!(
        time("customer.1"),
        Some("2024-01-15T11:00:00.000000Z".into())
    );
    assert_eq!(
        time("customer.2"),
        Some("2024-07-15T10:00:00.000000Z".into())
    );
    assert!(
        env.log()
            .contains("commit times are read in this time zone"),
        "{}",
        env.log()
    );
}

/// A `source.time_zone` the server does not know stops `skein validate`
/// and `skein run` with the query that lists the names it knows.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs SQL Server: set SKEIN_TEST_MSSQL_URL, run scripts/test-mssql"]
async fn mssql_an_unknown_time_zone_is_refused() {
    let env = MsEnv::new("bad_time_zone", |y| {
        y.replace(
            "  kind: sqlserver\n",
            "  kind: sqlserver\n  time_zone: \"Mars Standard Time\"\n",
        )
    })
    .await;
    for args in [&["validate"][..], &["run"][..]] {
        let out = env.command(args).output().unwrap();
        assert!(!out.status.success(), "{args:?}");
        let text = String::from_utf8_lossy(&out.stderr).to_string()
            + &String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains("`Mars Standard Time` is not a time zone this server knows")
                && text.contains("sys.time_zone_info"),
            "{args:?}: {text}"
        );
    }
}

/// The cleanup retention: a change skein has not read, older than 80% of
/// the cleanup job's retention, shows in `skein status` and warns in the
/// log at start. The retention is set to 2 minutes and the unread
/// transactions' recorded commit time to 110 s ago (92% of it).
#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs SQL Server: set SKEIN_TEST_MSSQL_URL, run scripts/test-mssql"]
async fn mssql_an_old_unread_change_warns_before_cleanup_removes_it() {
    let mut env = MsEnv::new("cleanup_retention", same).await;
    env.exec("EXEC sys.sp_cdc_change_job @job_type = N'cleanup', @retention = 2;")
        .await;
    publish_ada(&mut env).await;
    let fresh: Value = serde_json::from_str(&env.skein_ok(&["status"])).unwrap();
    assert_eq!(fresh["source"]["retention_warning"], false, "{fresh}");
    assert_eq!(fresh["source"]["cleanup_retention_minutes"], 2, "{fresh}");
    env.exec("UPDATE dbo.customer SET name = N'unread' WHERE id = 1;")
        .await;
    env.wait_captured().await;
    let before = env.max_lsn().await;
    let hex: String = before.iter().map(|b| format!("{b:02X}")).collect();
    // Every transaction up to now "committed" 110 s ago; the applied ones
    // do not count, the unread update does.
    env.exec(&format!(
        "UPDATE cdc.lsn_time_mapping SET tran_end_time = DATEADD(second, -110, GETDATE()) \
         WHERE start_lsn <= 0x{hex};"
    ))
    .await;
    let status: Value = serde_json::from_str(&env.skein_ok(&["status"])).unwrap();
    let source = &status["source"];
    let used = source["retention_used"].as_f64().unwrap();
    assert!((0.8..1.0).contains(&used), "{source}");
    assert_eq!(source["retention_warning"], true, "{source}");
    assert!(source["oldest_unread_lsn"].is_string(), "{source}");
    assert!(
        source["unread_age_seconds"].as_i64().unwrap() >= 110,
        "{source}"
    );
    env.run_until_settled().await;
    assert!(
        env.log()
            .contains("of the CDC cleanup job's retention (2 minutes)"),
        "{}",
        env.log()
    );
}

/// A login that may not read msdb: `skein status` says the retention is
/// unknown and why, `skein run` says so once in its log and publishes.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs SQL Server: set SKEIN_TEST_MSSQL_URL, run scripts/test-mssql"]
async fn mssql_an_unreadable_msdb_is_said_once_and_the_pipeline_goes_on() {
    let mut env = MsEnv::new("msdb_unreadable", same).await;
    let db = env
        .url
        .rsplit("database=")
        .next()
        .unwrap()
        .trim_end_matches(';')
        .to_string();
    let mut master = ms(&mssql_url()).await;
    ms_exec(
        &mut master,
        "IF SUSER_ID(N'skein_limited') IS NULL \
           CREATE LOGIN skein_limited WITH PASSWORD = N'Skein-limited-1', CHECK_POLICY = OFF;",
    )
    .await;
    env.exec(
        "CREATE USER skein_limited FOR LOGIN skein_limited; \
         ALTER ROLE db_owner ADD MEMBER skein_limited;",
    )
    .await;
    // The same server and database, another login.
    let limited = mssql_url()
        .split(';')
        .filter(|kv| {
            let k = kv
                .split('=')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase();
            !["user", "user id", "uid", "password", "pwd", "database"].contains(&k.as_str())
        })
        .collect::<Vec<_>>()
        .join(";")
        + &format!(";user=skein_limited;password=Skein-limited-1;database={db}");
    let out = env
        .command(&["status"])
        .env("SKEIN_SOURCE_URL", &limited)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let status: Value = serde_json::from_slice(&out.stdout).unwrap();
    let source = &status["source"];
    assert!(
        source["retention_unknown"]
            .as_str()
            .is_some_and(|r| r.contains("msdb")),
        "{source}"
    );
    assert_eq!(source["retention_used"], Value::Null, "{source}");
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(env.dir.join("skein.log"))
        .unwrap();
    let mut run = env
        .command(&["run"])
        .env("SKEIN_SOURCE_URL", &limited)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    env.step(
        &mut run,
        "INSERT INTO dbo.customer (id, name) VALUES (1, N'Ada');",
    )
    .await;
    // Past the 30 s between checks: still said once.
    tokio::time::sleep(Duration::from_secs(35)).await;
    env.settle(&mut run).await;
    env.stop(run);
    assert_eq!(
        env.log()
            .matches("cannot read the CDC cleanup job's retention")
            .count(),
        1,
        "{}",
        env.log()
    );
    assert!(env.events().iter().any(|e| e["subject"] == "customer.1"));
}

/// Runs the pipeline, publishes customer 1, runs `ddl` and a change after
/// it, and returns the log once `skein run` has exited (it must fail).
async fn run_into_ddl(name: &str, ddl: &str) -> String {
    let mut env = MsEnv::new(name, same).await;
    let mut run = env.start();
    env.step(
        &mut run,
        "INSERT INTO dbo.customer (id, name) VALUES (1, N'Ada');",
    )
    .await;
    env.exec(ddl).await;
    env.bump_sentinel().await;
    let deadline = Instant::now() + Duration::from_secs(90);
    let status = loop {
        if let Some(status) = run.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "skein did not stop at `{ddl}`: {}",
            env.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(!status.success(), "{}", env.log());
    env.log()
}

/// `cdc.ddl_history`: a column the config names (`is_deleted_column`)
/// dropped while skein runs stops it before the batch holding the DDL is
/// resolved, naming the table, the column, the DDL and the fix.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs SQL Server: set SKEIN_TEST_MSSQL_URL, run scripts/test-mssql"]
async fn mssql_a_dropped_named_column_stops_at_its_ddl() {
    let log = run_into_ddl(
        "ddl_drop",
        "DECLARE @c sysname = (SELECT dc.name FROM sys.default_constraints dc \
           JOIN sys.columns c ON c.object_id = dc.parent_object_id AND c.column_id = dc.parent_column_id \
           WHERE dc.parent_object_id = OBJECT_ID(N'dbo.customer') AND c.name = N'is_deleted'); \
         EXEC(N'ALTER TABLE dbo.customer DROP CONSTRAINT ' + QUOTENAME(@c)); \
         ALTER TABLE dbo.customer DROP COLUMN is_deleted;",
    )
    .await;
    for want in [
        "the source's schema changed under the running pipeline",
        "column `is_deleted` of dbo.customer (entity `customer`, is_deleted_column) does not exist",
        "cdc.ddl_history",
        "DROP COLUMN is_deleted",
        "take `is_deleted` out of `is_deleted_column` of entity `customer`",
    ] {
        assert!(log.contains(want), "{want}: {log}");
    }
}

/// A join column retyped to another text form stops with the T-SQL that
/// gives it its type back.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs SQL Server: set SKEIN_TEST_MSSQL_URL, run scripts/test-mssql"]
async fn mssql_a_retyped_join_column_stops_at_its_ddl() {
    let log = run_into_ddl(
        "ddl_retype",
        "ALTER TABLE dbo.address ALTER COLUMN customer_id nvarchar(20) NULL;",
    )
    .await;
    for want in [
        "column `customer_id` of dbo.address",
        "changed type from int to nvarchar(20)",
        "ALTER TABLE [dbo].[address] ALTER COLUMN [customer_id] int;",
    ] {
        assert!(log.contains(want), "{want}: {log}");
    }
}

/// A new column is logged and the pipeline goes on.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs SQL Server: set SKEIN_TEST_MSSQL_URL, run scripts/test-mssql"]
async fn mssql_a_new_column_is_logged_and_followed() {
    let mut env = MsEnv::new("ddl_add", same).await;
    let mut run = env.start();
    env.step(
        &mut run,
        "INSERT INTO dbo.customer (id, name) VALUES (1, N'Ada');",
    )
    .await;
    env.exec("ALTER TABLE dbo.customer ADD tier nvarchar(20) NULL;")
        .await;
    env.step(
        &mut run,
        "UPDATE dbo.customer SET email = N'after@x' WHERE id = 1;",
    )
    .await;
    env.stop(run);
    assert!(
        env.log().contains("resolution follows it") && env.log().contains("+tier nvarchar(20)"),
        "{}",
        env.log()
    );
    let last = env.events().last().cloned().unwrap();
    assert_eq!(last["data"]["email"], "after@x");
    // The appliers read the catalog in every batch: the new column is in
    // the event without a restart (null until set).
    assert!(
        last["data"].as_object().unwrap().contains_key("tier"),
        "{last}\n{}",
        env.log()
    );
    assert!(env.log().contains("hydration follows it"), "{}", env.log());
}

/// Runs everywhere (no SQL Server needed): the TDS client fails with the
/// address in the message when nothing listens, and with an error, not a
/// hang or a panic, when something else answers (PostgreSQL here).
#[tokio::test(flavor = "multi_thread")]
async fn sqlserver_client_errors_are_clear_without_a_server() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let e = MssqlClient::connect(&format!(
        "server=tcp:127.0.0.1,{port};user=u;password=p;TrustServerCertificate=true"
    ))
    .await
    .unwrap_err();
    assert!(e.to_string().contains(&format!("127.0.0.1:{port}")), "{e}");
    assert!(e.is_retryable(), "a refused connection may come back: {e}");

    let pg = admin_url();
    let hostport = pg
        .split('@')
        .nth(1)
        .and_then(|r| r.split('/').next())
        .unwrap()
        .replace(':', ",");
    let r = tokio::time::timeout(
        Duration::from_secs(20),
        MssqlClient::connect(&format!(
            "server=tcp:{hostport};user=u;password=p;TrustServerCertificate=true"
        )),
    )
    .await
    .expect("a non-TDS peer must not hang the client");
    assert!(r.is_err(), "PostgreSQL is not a SQL Server");
}
