//! Generated SQL is frozen: golden files under `tests/golden/sql/`
//! (`UPDATE_GOLDEN=1` rewrites them; review the diff).

use std::path::PathBuf;

use skein_common::config::expand_env;
use skein_common::Config;
use skein_sql::postgres::{hydrate_sql, resolve_sql, sidecar_ddl, source_ddl};
use skein_sql::{Catalog, ColumnInfo, TableInfo};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn quickstart() -> (Config, Catalog) {
    let text = std::fs::read_to_string(root().join("examples/quickstart/skein.yaml")).unwrap();
    let text = expand_env(&text, "skein.yaml", |_| Some("postgres://u@h/db".into())).unwrap();
    let cfg = Config::from_yaml(&text, "skein.yaml").unwrap();
    let col = |name: &str, data_type: &str, type_name: &str| ColumnInfo {
        name: name.into(),
        data_type: data_type.into(),
        type_name: type_name.into(),
        nullable: true,
    };
    let int = |n: &str| col(n, "integer", "int4");
    let text_col = |n: &str| col(n, "text", "text");
    let mut cat = Catalog::default();
    let mut add = |table: &str, pk: &[&str], columns: Vec<ColumnInfo>| {
        cat.insert(TableInfo {
            schema: "public".into(),
            table: table.into(),
            columns,
            primary_key: pk.iter().map(|s| s.to_string()).collect(),
            replica_identity: 'd',
        })
    };
    add(
        "customer",
        &["id"],
        vec![
            int("id"),
            text_col("name"),
            text_col("email"),
            col("credit_limit", "numeric", "numeric"),
            col("is_deleted", "boolean", "bool"),
            int("row_version"),
            col("created_at", "timestamp with time zone", "timestamptz"),
        ],
    );
    add(
        "address",
        &["id"],
        vec![
            int("id"),
            int("customer_id"),
            text_col("kind"),
            text_col("city"),
        ],
    );
    add(
        "address_line",
        &["address_id", "line_no"],
        vec![int("address_id"), int("line_no"), text_col("text")],
    );
    add(
        "contact",
        &["customer_id", "kind"],
        vec![int("customer_id"), text_col("kind"), text_col("value")],
    );
    (cfg, cat)
}

fn check(name: &str, text: &str) {
    let path = root().join("tests/golden/sql").join(name);
    if std::env::var("UPDATE_GOLDEN").is_ok() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, text).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|_| {
        panic!(
            "missing {}; run with UPDATE_GOLDEN=1 and review",
            path.display()
        )
    });
    assert_eq!(
        text,
        want,
        "{} changed: generated SQL is frozen",
        path.display()
    );
}

#[test]
fn postgres_source_ddl_is_frozen() {
    let (cfg, cat) = quickstart();
    check("postgres_source_quickstart.sql", &source_ddl(&cfg, &cat));
}

#[test]
fn postgres_sidecar_ddl_is_frozen() {
    check("postgres_sidecar.sql", &sidecar_ddl("skein"));
}

#[test]
fn postgres_hydration_and_lookup_queries_are_frozen() {
    let (cfg, cat) = quickstart();
    let e = &cfg.entities[0];
    let nodes = e.nodes();
    let mut out = String::new();
    for (i, n) in nodes.iter().enumerate() {
        out.push_str(&format!(
            "-- hydrate {} ({})\n{};\n\n",
            n.name,
            n.qualified(),
            hydrate_sql(e, &nodes, i, &cat)
        ));
    }
    out.push_str(&format!(
        "-- resolve roots of lines (grandchild)\n{};\n",
        resolve_sql(&nodes, 2, &cat)
    ));
    check("postgres_queries_quickstart.sql", &out);
}
