//! Timestamp root keys (issue 11), against a real PostgreSQL and the real
//! `skein` binary: a key is text on its way through the pipeline, so every
//! session that renders one must render it the same way, whatever
//! `DateStyle` and `TimeZone` the database or role sets.

mod common;

use common::*;

const FILES: Files = Files {
    schema: "tests/fixtures/timestamp_keys_schema.sql",
    yaml: "tests/fixtures/timestamp_keys.yaml",
};

/// The database renders timestamps as `02/01/2024 05:00:00.5 EST`
/// (`SQL, DMY` in New York). The walsender (pgoutput sends values as text
/// in its session's formats), the extractor's lookups of a grandchild's
/// root and the applier's hydration must agree on every key: a root
/// change, a direct child (its key from its own image) and a grandchild
/// (its key looked up in the source) of one aggregate are one subject,
/// in ISO and UTC, each change published once.
#[tokio::test(flavor = "multi_thread")]
async fn timestamp_keys_are_the_same_text_on_every_connection() {
    let env = Env::with_files("timestamp_keys", &FILES, TransportChoice::FromEnv, |y| y).await;
    // Settings of the database and of the role: sessions opened from now
    // on (all of skein's) start with them.
    let db = format!("skein_t_{}", env.name);
    env.exec(&format!(
        "ALTER DATABASE {db} SET DateStyle = 'SQL, DMY';
         ALTER DATABASE {db} SET TimeZone = 'America/New_York'"
    ))
    .await;
    let mut run = env.start().await;
    env.step(
        &mut run,
        "INSERT INTO appointment VALUES ('2024-01-02 10:00:00.5+00', 'kick-off');
         INSERT INTO shift VALUES ('2024-07-13 06:30:00', 'A');",
    )
    .await;
    env.step(
        &mut run,
        "INSERT INTO attendee VALUES (1, '2024-01-02 10:00:00.5+00', 'Ada')",
    )
    .await;
    env.step(&mut run, "INSERT INTO remark VALUES (1, 1, 'bring slides')")
        .await;
    env.step(
        &mut run,
        "UPDATE appointment SET title = 'kick-off 2';
         UPDATE shift SET crew = 'B';",
    )
    .await;
    run.stop(&env);
    let mut got = env.subject_actions();
    got.sort();
    assert_eq!(
        got,
        [
            "appointment.2024-01-02 10:00:00.5+00 created",
            "appointment.2024-01-02 10:00:00.5+00 updated",
            "appointment.2024-01-02 10:00:00.5+00 updated",
            "appointment.2024-01-02 10:00:00.5+00 updated",
            "shift.2024-07-13 06:30:00 created",
            "shift.2024-07-13 06:30:00 updated",
        ],
        "{}",
        env.log()
    );
    let last = env
        .events()
        .into_iter()
        .rfind(|e| e["subject"].as_str().unwrap().starts_with("appointment."))
        .unwrap();
    assert_eq!(last["data"]["at"], "2024-01-02T10:00:00.500000Z");
    assert_eq!(last["data"]["title"], "kick-off 2");
    assert_eq!(
        last["data"]["attendees"][0]["remarks"][0]["body"],
        "bring slides"
    );
    assert_exactly_once(&env).await;
}
