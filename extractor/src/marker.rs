//! The extractor's marker: the source position up to which every change has
//! been handed over and acknowledged. Stored in sled under `state_dir`.

use std::fs::File;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use skein_common::position::SqlServerLsn;
use skein_common::SourcePosition;

use crate::error::{Error, Result};

/// What is stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Marker {
    /// Upper bound of the last acknowledged batch: every transaction that
    /// committed at or before it has been handed over.
    pub position: SourcePosition,
    /// Whether changes were ever skipped because the source no longer held
    /// them (`continue_with_data_loss`).
    pub has_data_loss: bool,
    /// When it was written (`seconds.micros` since the Unix epoch).
    pub updated_at: String,
    /// A loss (a `marker reset` or `continue_with_data_loss` past changes
    /// not read) that no acknowledged batch has carried to the sidecar yet:
    /// the next batch carries it, also after a crash in between. Absent in
    /// markers written before it existed.
    #[serde(default)]
    pub loss_unreported: bool,
    /// A transaction larger than one batch, after `position`, handed over
    /// in part: a restart reads it again and skips what was handed over.
    /// Absent in markers written before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_flight: Option<InFlight>,
}

/// How much of a transaction too large for one batch is handed over.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct InFlight {
    /// Where its commit record starts (PostgreSQL: the Begin message's
    /// final LSN): what tells the transaction when the stream sends it
    /// again, before its end is known. SQL Server: its commit LSN, as `end`.
    pub commit: SourcePosition,
    /// Its position: the end of its commit record.
    pub end: SourcePosition,
    /// How many of its changes, in stream order, are handed over.
    pub changes: u64,
    /// How many of those the extractor tracked (their records numbered the
    /// transaction's so far): the records after them number on from it,
    /// even when the config changed meanwhile. Absent in markers written
    /// before it existed (counted again then).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tracked: Option<u32>,
    /// SQL Server: the `__$seqval` of the last change handed over (shown
    /// as SQL Server shows it, hex). Every change of the transaction up to
    /// it is handed over and none after it: a restart reads its rows
    /// after this `__$seqval` only. `None` on PostgreSQL, which counts
    /// `changes` instead, and in markers written before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seqval: Option<SqlServerLsn>,
}

impl InFlight {
    /// How a restart goes on with it, for the extractor's start line:
    /// PostgreSQL's stream sends the transaction again from its start and
    /// the extractor skips the `changes` handed over; SQL Server's reader
    /// reads on after the stored `__$seqval`, none of it again.
    pub fn resumption(&self) -> &'static str {
        match self.seqval {
            Some(_) => {
                "the transaction in flight continues after the stored __$seqval; \
                 what was handed over of it is not read again"
            }
            None => {
                "the transaction in flight is read again from its start and what was \
                 handed over of it is skipped"
            }
        }
    }
}

impl Marker {
    /// Where the marker stands, in the order it may only move forward.
    fn progress(&self) -> (SourcePosition, Option<InFlight>) {
        (self.position, self.in_flight)
    }
}

/// Where the marker lives.
///
/// Contract: [`MarkerStore::load`] returns what the last successful
/// [`MarkerStore::store`] wrote, also after a crash (`store` returns only
/// once the value is durable). Positions only move forward through `store`;
/// moving back is [`MarkerStore::reset`], an explicit operator action.
pub trait MarkerStore {
    /// The stored marker, `None` on a fresh state directory.
    fn load(&self) -> Result<Option<Marker>>;
    /// Durably stores a marker; refuses to move backwards.
    fn store(&self, marker: &Marker) -> Result<()>;
    /// Stores any marker, backwards included (operator `marker reset`).
    fn reset(&self, marker: &Marker) -> Result<()>;
}

const MARKER_KEY: &[u8] = b"marker";

/// sled-backed marker store holding an exclusive lock on the state directory
/// for as long as it lives, so two extractors (or a `marker reset` next to a
/// running pipeline) can never write the same marker.
pub struct SledMarkerStore {
    db: sled::Db,
    _lock: File,
    dir: PathBuf,
}

/// How long a busy sled lock is waited for. Our own `LOCK` file is held
/// by then, so a busy sled lock can only be an earlier store of this
/// process winding down: sled 0.34 drops its file lock only when its last
/// background thread lets go of the page cache, shortly after `Db` is
/// dropped (spacejam/sled#1234, #1289).
const SLED_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Opens the sled tree, waiting out a lock that an earlier store of this
/// process has not let go of yet.
fn open_sled(path: &Path) -> sled::Result<sled::Db> {
    let started = std::time::Instant::now();
    loop {
        match sled::Config::new().path(path).open() {
            // sled reports its busy lock as `Other` with this text.
            Err(sled::Error::Io(e))
                if e.to_string().starts_with("could not acquire lock")
                    && started.elapsed() < SLED_LOCK_WAIT =>
            {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            other => return other,
        }
    }
}

impl SledMarkerStore {
    /// Opens (creating) the store in `state_dir`, taking its lock.
    pub fn open(state_dir: &Path) -> Result<SledMarkerStore> {
        std::fs::create_dir_all(state_dir).map_err(|e| Error::State {
            dir: state_dir.display().to_string(),
            message: format!("cannot create it: {e}"),
        })?;
        let lock_path = state_dir.join("LOCK");
        let lock = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| Error::State {
                dir: state_dir.display().to_string(),
                message: format!("cannot open {}: {e}", lock_path.display()),
            })?;
        lock.try_lock().map_err(|_| Error::StateLocked {
            dir: state_dir.display().to_string(),
        })?;
        let db = open_sled(&state_dir.join("marker")).map_err(|e| Error::State {
            dir: state_dir.display().to_string(),
            message: format!("cannot open the sled store: {e}"),
        })?;
        Ok(SledMarkerStore {
            db,
            _lock: lock,
            dir: state_dir.to_path_buf(),
        })
    }

    fn write(&self, marker: &Marker) -> Result<()> {
        let bytes = serde_json::to_vec(marker).map_err(|e| self.err(e.to_string()))?;
        self.db
            .insert(MARKER_KEY, bytes)
            .map_err(|e| self.err(e.to_string()))?;
        self.db.flush().map_err(|e| self.err(e.to_string()))?;
        Ok(())
    }

    fn err(&self, message: String) -> Error {
        Error::State {
            dir: self.dir.display().to_string(),
            message,
        }
    }
}

impl MarkerStore for SledMarkerStore {
    fn load(&self) -> Result<Option<Marker>> {
        let Some(v) = self
            .db
            .get(MARKER_KEY)
            .map_err(|e| self.err(e.to_string()))?
        else {
            return Ok(None);
        };
        serde_json::from_slice(&v)
            .map(Some)
            .map_err(|e| self.err(format!("the stored marker is unreadable: {e}")))
    }

    fn store(&self, marker: &Marker) -> Result<()> {
        if let Some(cur) = self.load()? {
            if marker.position.dialect() != cur.position.dialect() {
                return Err(self.err(format!(
                    "the stored marker {} belongs to another kind of source than {}; \
                     give this source its own state_dir",
                    cur.position, marker.position
                )));
            }
            if marker.progress() < cur.progress() {
                return Err(self.err(format!(
                    "refusing to move the marker back from {} to {} (use `skein marker reset`)",
                    describe(&cur),
                    describe(marker)
                )));
            }
        }
        self.write(marker)
    }

    fn reset(&self, marker: &Marker) -> Result<()> {
        self.write(marker)
    }
}

/// The marker's position, with what is handed over of a transaction in
/// flight.
pub fn describe(m: &Marker) -> String {
    match &m.in_flight {
        None => m.position.to_string(),
        Some(f) => format!(
            "{} (and {} changes of the transaction ending at {}{})",
            m.position,
            f.changes,
            f.end,
            f.seqval
                .map(|s| format!(", up to __$seqval {s}"))
                .unwrap_or_default()
        ),
    }
}

/// Now as `seconds.micros` since the Unix epoch, for `updated_at`.
pub fn now_stamp() -> String {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    format!("{}.{:06}", d.as_secs(), d.subsec_micros())
}

#[cfg(test)]
mod tests {
    use super::*;

    use skein_common::PgLsn;

    fn m(p: u64) -> Marker {
        Marker {
            loss_unreported: false,
            position: PgLsn(p).into(),
            has_data_loss: false,
            updated_at: now_stamp(),
            in_flight: None,
        }
    }

    #[test]
    fn marker_round_trips_only_moves_forward_and_locks() {
        let dir = std::env::temp_dir().join(format!("skein-marker-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        {
            let s = SledMarkerStore::open(&dir).unwrap();
            assert_eq!(s.load().unwrap(), None);
            s.store(&m(10)).unwrap();
            assert!(s.store(&m(5)).is_err());
            assert!(matches!(
                SledMarkerStore::open(&dir),
                Err(Error::StateLocked { .. })
            ));
            // Inside a transaction in flight, forward only too.
            let part = |changes| Marker {
                in_flight: Some(InFlight {
                    commit: PgLsn(20).into(),
                    end: PgLsn(30).into(),
                    changes,
                    tracked: Some(7),
                    seqval: None,
                }),
                ..m(10)
            };
            s.store(&part(100)).unwrap();
            s.store(&part(200)).unwrap();
            assert!(s.store(&part(100)).is_err());
            assert!(s.store(&m(10)).is_err(), "forgetting the part handed over");
            assert_eq!(s.load().unwrap().unwrap().in_flight, part(200).in_flight);
            s.store(&m(30)).unwrap();
            s.reset(&m(5)).unwrap();
            assert_eq!(s.load().unwrap().unwrap().position, PgLsn(5).into());
        }
        let s = SledMarkerStore::open(&dir).unwrap();
        assert_eq!(s.load().unwrap().unwrap().position, PgLsn(5).into());
        drop(s);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Closing the store and opening it again at once (`marker reset`
    /// after a run in one process, a test's second open) must not trip
    /// over sled's own file lock while its threads wind down.
    #[test]
    fn the_store_opens_again_right_after_it_is_closed() {
        let dir = std::env::temp_dir().join(format!("skein-marker-reopen-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for p in 1..=200u64 {
            let s = SledMarkerStore::open(&dir).unwrap_or_else(|e| panic!("open {p}: {e}"));
            s.store(&m(p)).unwrap();
            drop(s);
        }
        let s = SledMarkerStore::open(&dir).unwrap();
        assert_eq!(s.load().unwrap().unwrap().position, PgLsn(200).into());
        drop(s);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Markers written before `seqval` existed read as before; a SQL
    /// Server marker keeps its cursor as SQL Server shows it.
    #[test]
    fn in_flight_cursor_is_optional_and_hex() {
        let old = r#"{"position":"0/A","has_data_loss":false,"updated_at":"1.0",
            "in_flight":{"commit":"0/14","end":"0/1E","changes":3,"tracked":2}}"#;
        let m: Marker = serde_json::from_str(old).unwrap();
        let f = m.in_flight.unwrap();
        assert_eq!((f.changes, f.tracked, f.seqval), (3, Some(2), None));
        assert!(!serde_json::to_string(&m).unwrap().contains("seqval"));
        let lsn = |n: u8| {
            let mut b = [0u8; 10];
            b[9] = n;
            SqlServerLsn(b)
        };
        let ms = Marker {
            position: lsn(1).into(),
            in_flight: Some(InFlight {
                commit: lsn(2).into(),
                end: lsn(2).into(),
                changes: 40,
                tracked: Some(40),
                seqval: Some(lsn(0xAB)),
            }),
            ..m
        };
        let json = serde_json::to_string(&ms).unwrap();
        assert!(
            json.contains(r#""seqval":"0x000000000000000000AB""#),
            "{json}"
        );
        assert_eq!(serde_json::from_str::<Marker>(&json).unwrap(), ms);
        assert!(describe(&ms).ends_with("up to __$seqval 0x000000000000000000AB)"));
    }

    /// The start line says how each source goes on with a transaction in
    /// flight (the integration suites look for these words).
    #[test]
    fn a_restart_says_how_the_transaction_in_flight_goes_on() {
        let old = r#"{"commit":"0/14","end":"0/1E","changes":3,"tracked":2}"#;
        let pg: InFlight = serde_json::from_str(old).unwrap();
        assert!(pg
            .resumption()
            .contains("read again from its start and what was handed over of it is skipped"));
        let ms = InFlight {
            seqval: Some(SqlServerLsn([0; 10])),
            ..pg
        };
        assert!(
            ms.resumption()
                .contains("continues after the stored __$seqval"),
            "{}",
            ms.resumption()
        );
        assert!(!ms.resumption().contains("read again from its start"));
    }
}
