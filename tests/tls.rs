//! TLS to PostgreSQL (issue 11), against the server `scripts/test` starts
//! with `ssl=on` (`SKEIN_TEST_PG_TLS_URL`): its certificate, signed by the
//! CA in `SKEIN_TEST_PG_TLS_DIR/ca.pem`, names only `localhost`, and it
//! rejects role `skein_tls` on any TCP connection without TLS. So a
//! pipeline that runs as `skein_tls` has every connection encrypted: the
//! queries of source and sidecar, and the replication stream.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::*;

fn tls_admin_url() -> String {
    std::env::var("SKEIN_TEST_PG_TLS_URL").expect(
        "SKEIN_TEST_PG_TLS_URL is not set: run the tests with `scripts/test`, which starts a PostgreSQL with ssl=on",
    )
}

fn pem(name: &str) -> String {
    let dir = std::env::var("SKEIN_TEST_PG_TLS_DIR").expect(
        "SKEIN_TEST_PG_TLS_DIR is not set: run the tests with `scripts/test`, which generates the certificates",
    );
    let p = PathBuf::from(dir).join(name);
    assert!(p.exists(), "{} is missing", p.display());
    p.display().to_string()
}

/// A database on the TLS server that skein reaches as `skein_tls` on
/// `host` with the URL parameters `params`; the test's own connection
/// (`env.db`) stays the admin's.
async fn tls_env(name: &str, host: &str, params: &str) -> Env {
    let mut env = Env::new_at(&tls_admin_url(), name, |y| y).await;
    let (_, rest) = env.url.split_once('@').unwrap();
    let (_, port_db) = rest.split_once(':').unwrap();
    env.url = format!("postgres://skein_tls:skein_tls@{host}:{port_db}?{params}");
    env
}

/// What the server says about skein's connections: (TLS, total,
/// walsenders among them).
async fn skein_connections(env: &Env) -> (i64, i64, i64) {
    let r = env
        .db
        .query_one(
            "SELECT count(*) FILTER (WHERE s.ssl), count(*), count(*) FILTER (WHERE a.backend_type = 'walsender')
               FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
              WHERE a.usename = 'skein_tls'",
            &[],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1), r.get(2))
}

async fn publishes_over_tls(env: &Env) {
    let mut run = env.start().await;
    env.step(
        &mut run,
        "INSERT INTO customer (id, name) VALUES (1, 'Ada'); INSERT INTO address VALUES (10, 1, 'home', 'Oslo');",
    )
    .await;
    assert_eq!(env.subject_actions(), ["customer.1 created"]);
    let (tls, all, walsenders) = skein_connections(env).await;
    assert!(
        all >= 3 && walsenders >= 1 && tls == all,
        "skein's connections: {tls} of {all} over TLS, {walsenders} walsender(s)"
    );
    run.stop(env);
}

/// `verify-full` with the right CA: every connection, the replication
/// stream included, is encrypted and checked, and events flow.
#[tokio::test(flavor = "multi_thread")]
async fn verify_full_with_the_right_ca_publishes() {
    let params = format!("sslmode=verify-full&sslrootcert={}", pem("ca.pem"));
    let env = tls_env("tls_verify_full", "localhost", &params).await;
    publishes_over_tls(&env).await;
}

/// `verify-ca` checks the chain but not the name: 127.0.0.1 is not in
/// the certificate, and the pipeline still runs.
#[tokio::test(flavor = "multi_thread")]
async fn verify_ca_does_not_check_the_host_name() {
    let params = format!("sslmode=verify-ca&sslrootcert={}", pem("ca.pem"));
    let env = tls_env("tls_verify_ca", "127.0.0.1", &params).await;
    publishes_over_tls(&env).await;
}

/// `require` encrypts without checking, as libpq's does.
#[tokio::test(flavor = "multi_thread")]
async fn require_encrypts_without_a_ca() {
    let env = tls_env("tls_require", "127.0.0.1", "sslmode=require").await;
    publishes_over_tls(&env).await;
}

/// Each way of getting TLS wrong stops skein at once with the reason, not
/// a retry loop.
#[tokio::test(flavor = "multi_thread")]
async fn a_wrong_ca_a_wrong_name_or_no_tls_fails_clearly() {
    let cases = [
        (
            "tls_wrong_ca",
            "localhost",
            format!("sslmode=verify-full&sslrootcert={}", pem("wrong-ca.pem")),
            "UnknownIssuer",
        ),
        (
            "tls_wrong_name",
            "127.0.0.1",
            format!("sslmode=verify-full&sslrootcert={}", pem("ca.pem")),
            "not valid for name",
        ),
        (
            "tls_disabled",
            "127.0.0.1",
            "sslmode=disable".to_string(),
            "no encryption",
        ),
        (
            "tls_bad_root_file",
            "localhost",
            "sslmode=verify-full&sslrootcert=/nonexistent/ca.pem".to_string(),
            "sslrootcert /nonexistent/ca.pem",
        ),
    ];
    for (name, host, params, reason) in cases {
        let env = tls_env(name, host, &params).await;
        let err = env
            .refused_within("run", Duration::from_secs(30))
            .unwrap_or_else(|| panic!("{name}: skein run kept running"));
        assert!(
            err.contains(reason) && err.contains("connecting to the"),
            "{name}: the error should say `connecting to the …` and `{reason}`: {err}"
        );
    }
}

/// `require` against a server without TLS (the tests' main server) is
/// refused, never silently sent in clear text.
#[tokio::test(flavor = "multi_thread")]
async fn require_against_a_server_without_tls_is_refused() {
    let mut env = Env::new("tls_require_plain", |y| y).await;
    env.url = format!("{}?sslmode=require", env.url);
    let err = env
        .refused_within("run", Duration::from_secs(30))
        .expect("skein run kept running");
    assert!(
        err.contains("connecting to the") && err.to_lowercase().contains("tls"),
        "{err}"
    );
}

/// Over a Unix socket there is no TLS, whatever `sslmode` says (as libpq):
/// once no such URL could connect at all.
#[tokio::test(flavor = "multi_thread")]
async fn a_unix_socket_url_connects_in_any_sslmode() {
    let mut env = Env::new("tls_unix_socket", |y| y).await;
    let port = admin_url()
        .rsplit_once(':')
        .and_then(|(_, p)| p.split('/').next().map(str::to_string))
        .unwrap();
    for mode in ["disable", "prefer", "require"] {
        env.url = format!(
            "postgres://postgres@%2Ftmp%2Fskein-pg-{port}:{port}/skein_t_tls_unix_socket?sslmode={mode}"
        );
        env.skein_ok(&["sidecar", "migrate"]);
        let status = env.skein_ok(&["status"]);
        assert!(status.contains("\"slot\""), "{mode}: {status}");
    }
}
