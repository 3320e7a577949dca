//! `skein validate` against real PostgreSQL servers: each problem it must
//! report, with the SQL that fixes it, and a clean bill once fixed.

mod common;

use common::*;

fn run_validate(env: &Env) -> (bool, String) {
    let out = env.skein(&["validate"]);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[tokio::test(flavor = "multi_thread")]
async fn validate_reports_each_problem_with_its_fix() {
    let env = Env::new("validate", |y| y).await;

    // Ready: publication and identities from `skein sql source`, no slot yet.
    let (ok, text) = run_validate(&env);
    assert!(ok, "{text}");
    assert!(text.contains("ok: config and source are ready"), "{text}");
    assert!(
        text.contains("replication slot `skein_validate` does not exist yet"),
        "{text}"
    );

    assert!(!text.contains("no index"), "{text}");

    // A join no index serves: a note with the index, not a failure.
    env.exec("DROP INDEX address_customer_id").await;
    let (ok, text) = run_validate(&env);
    assert!(ok, "{text}");
    assert!(
        text.contains("`customer.addresses` reads public.address by (customer_id), and no index")
            && text.contains(r#"CREATE INDEX ON "public"."address" ("customer_id");"#),
        "{text}"
    );
    // Nor is one whose leading column is another: lines are read by
    // address_id, which their primary key begins with.
    assert!(!text.contains("public.address_line by"), "{text}");
    // A partial index serves only some rows: still the note.
    env.exec("CREATE INDEX address_partial ON address (customer_id) WHERE kind = 'home'")
        .await;
    let (_, text) = run_validate(&env);
    assert!(text.contains("public.address by (customer_id)"), "{text}");
    env.exec("DROP INDEX address_partial").await;
    env.exec("CREATE INDEX ON address (customer_id, kind)")
        .await;
    let (_, text) = run_validate(&env);
    assert!(!text.contains("no index"), "{text}");

    // A child whose deletes would not carry its join column.
    env.exec("ALTER TABLE address REPLICA IDENTITY DEFAULT")
        .await;
    let (ok, text) = run_validate(&env);
    assert!(!ok, "{text}");
    assert!(
        text.contains("public.address: deletes would not carry the join columns")
            && text.contains(r#"ALTER TABLE "public"."address" REPLICA IDENTITY FULL;"#),
        "{text}"
    );
    env.exec("ALTER TABLE address REPLICA IDENTITY FULL").await;

    // A table published without the columns skein needs.
    env.exec("ALTER PUBLICATION skein_validate SET TABLE customer, address (id, kind), address_line, contact")
        .await;
    let (ok, text) = run_validate(&env);
    assert!(!ok, "{text}");
    assert!(
        text.contains("does not carry [\"customer_id\"] of public.address")
            && text.contains("ALTER PUBLICATION"),
        "{text}"
    );

    // A table missing from the publication.
    env.exec("ALTER PUBLICATION skein_validate SET TABLE customer, address, address_line")
        .await;
    let (ok, text) = run_validate(&env);
    assert!(!ok, "{text}");
    assert!(
        text.contains("public.contact is not in publication `skein_validate`"),
        "{text}"
    );

    // No publication at all: the fix is the whole `sql source` output.
    env.exec("DROP PUBLICATION skein_validate").await;
    let (ok, text) = run_validate(&env);
    assert!(!ok, "{text}");
    let ddl = String::from_utf8(env.skein(&["sql", "source"]).stdout).unwrap();
    assert!(
        text.contains("publication `skein_validate` does not exist") && text.contains(ddl.trim()),
        "{text}"
    );

    // A configured column the table does not have.
    env.exec(&ddl).await;
    env.exec("ALTER TABLE customer DROP COLUMN email").await;
    let yaml = std::fs::read_to_string(&env.config).unwrap().replace(
        "include_columns_on_delete: [name]",
        "include_columns_on_delete: [email]",
    );
    std::fs::write(&env.config, yaml).unwrap();
    let (ok, text) = run_validate(&env);
    assert!(!ok, "{text}");
    assert!(
        text.contains("email") && text.contains("include_columns_on_delete"),
        "{text}"
    );
    assert!(!text.contains("Fix (from `skein sql source`)"), "{text}");
    let yaml = std::fs::read_to_string(&env.config).unwrap().replace(
        "include_columns_on_delete: [email]",
        "include_columns_on_delete: [name]",
    );
    std::fs::write(&env.config, yaml).unwrap();

    // A missing table.
    env.exec("DROP TABLE contact").await;
    let (ok, text) = run_validate(&env);
    assert!(!ok, "{text}");
    assert!(
        text.contains("table public.contact (entity `customer`) does not exist in the source"),
        "{text}"
    );
    assert!(!text.contains("not in publication"), "{text}");
}

#[tokio::test(flavor = "multi_thread")]
async fn validate_reports_wal_level_not_logical() {
    let url = std::env::var("SKEIN_TEST_PG_REPLICA_URL").expect(
        "SKEIN_TEST_PG_REPLICA_URL is not set: run the tests with `scripts/test`, \
         which starts a PostgreSQL at wal_level=replica",
    );
    let env = Env::new_at(&url, "wal", |y| y).await;
    let (ok, text) = run_validate(&env);
    assert!(!ok, "{text}");
    assert!(
        text.contains("wal_level is `replica`")
            && text.contains("ALTER SYSTEM SET wal_level = logical"),
        "{text}"
    );
}

/// A partitioned joined table: indexes on each partition serve the join as
/// well as one on the parent does, so neither gets the note; a partition
/// without one does.
#[tokio::test(flavor = "multi_thread")]
async fn validate_counts_the_indexes_of_a_partitioned_table() {
    let env = Env::new("validate_partitioned", |y| y).await;
    // `contact` is read by customer_id; its primary key begins with kind.
    env.exec(
        "DROP TABLE contact; \
         CREATE TABLE contact (customer_id integer NOT NULL, kind text NOT NULL, value text NOT NULL, \
           PRIMARY KEY (kind, customer_id)) \
           PARTITION BY LIST (kind); \
         CREATE TABLE contact_email PARTITION OF contact FOR VALUES IN ('email'); \
         CREATE TABLE contact_other PARTITION OF contact DEFAULT",
    )
    .await;
    let (_, text) = run_validate(&env);
    assert!(text.contains("public.contact by (customer_id)"), "{text}");
    // One partition indexed: the other is still scanned.
    env.exec("CREATE INDEX ON contact_email (customer_id)")
        .await;
    let (_, text) = run_validate(&env);
    assert!(text.contains("public.contact by (customer_id)"), "{text}");
    // Every partition indexed, the parent not: served.
    env.exec("CREATE INDEX ON contact_other (customer_id, kind)")
        .await;
    let (_, text) = run_validate(&env);
    assert!(!text.contains("public.contact by"), "{text}");
    // An index on the parent (it creates one on each partition): served.
    env.exec(
        "DROP INDEX contact_email_customer_id_idx, contact_other_customer_id_kind_idx; \
              CREATE INDEX ON contact (customer_id)",
    )
    .await;
    let (_, text) = run_validate(&env);
    assert!(!text.contains("public.contact by"), "{text}");
}
