//! A large transaction's changes, kept on disk until they are handed over.
//!
//! PostgreSQL sends a transaction's changes after its commit, but names the
//! commit's end — the position of every record of it — only after the last
//! change. A transaction of more than one batch's changes is therefore
//! written here as it arrives, one JSON line per change, and read back a
//! part at a time once its end is known: memory holds one part, whatever
//! the transaction's size. The files are a cache, not state: a restart
//! reads the transaction from the source again (the marker says how much
//! of it to skip), so they are removed when dropped and at start.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::resolve::RawChange;

/// One change as spilled: the change, and the columns of its after image
/// that were sent as unchanged TOAST values (see the PostgreSQL source's
/// `Tx::unchanged`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Spilled {
    /// The change.
    pub change: RawChange,
    /// Unchanged TOAST columns the before image did not carry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unchanged: Option<Vec<String>>,
}

/// The spill directory under `state_dir`, emptied: what a previous run
/// left is of no use (the source sends those transactions again).
pub fn prepare_dir(state_dir: &Path) -> Result<PathBuf> {
    let dir = state_dir.join("spill");
    let err = |e: std::io::Error| Error::State {
        dir: dir.display().to_string(),
        message: format!("cannot prepare the spill directory: {e}"),
    };
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(err)?;
    }
    std::fs::create_dir_all(&dir).map_err(err)?;
    Ok(dir)
}

/// A transaction's changes being written.
#[derive(Debug)]
pub struct SpillWriter {
    path: PathBuf,
    out: Option<BufWriter<File>>,
    count: u64,
}

impl SpillWriter {
    /// Creates `name` in `dir`.
    pub fn create(dir: &Path, name: &str) -> Result<SpillWriter> {
        let path = dir.join(name);
        let file = OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .read(true)
            .open(&path)
            .map_err(|e| io_err(&path, "creating", e))?;
        Ok(SpillWriter {
            path,
            out: Some(BufWriter::with_capacity(1 << 20, file)),
            count: 0,
        })
    }

    /// Appends changes.
    pub fn write(&mut self, changes: impl IntoIterator<Item = Spilled>) -> Result<()> {
        let out = self.out.as_mut().expect("a writer is open until finished");
        for c in changes {
            serde_json::to_writer(&mut *out, &c).map_err(|e| {
                if e.is_io() {
                    io_err(&self.path, "writing", e.into())
                } else {
                    Error::Decode(format!("spilling a change: {e}"))
                }
            })?;
            out.write_all(b"\n")
                .map_err(|e| io_err(&self.path, "writing", e))?;
            self.count += 1;
        }
        Ok(())
    }

    /// How many changes are written.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Ends writing; the changes are read back in the order written.
    pub fn finish(mut self) -> Result<SpillReader> {
        let out = self.out.take().expect("finished once");
        let file = out
            .into_inner()
            .map_err(|e| io_err(&self.path, "writing", e.into_error()))?;
        drop(file);
        let file = File::open(&self.path).map_err(|e| io_err(&self.path, "reading", e))?;
        Ok(SpillReader {
            path: std::mem::take(&mut self.path),
            input: BufReader::with_capacity(1 << 20, file),
            remaining: self.count,
            line: String::new(),
        })
    }
}

impl Drop for SpillWriter {
    fn drop(&mut self) {
        if !self.path.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// A spilled transaction's changes being read back.
#[derive(Debug)]
pub struct SpillReader {
    path: PathBuf,
    input: BufReader<File>,
    remaining: u64,
    line: String,
}

impl SpillReader {
    /// The next `n` changes at most (none when all are read).
    pub fn read(&mut self, n: usize) -> Result<Vec<Spilled>> {
        let mut out = Vec::with_capacity(n.min(self.remaining as usize));
        while out.len() < n && self.remaining > 0 {
            self.line.clear();
            let read = self
                .input
                .read_line(&mut self.line)
                .map_err(|e| io_err(&self.path, "reading", e))?;
            if read == 0 {
                return Err(Error::State {
                    dir: self.path.display().to_string(),
                    message: format!("the spill file ended {} changes early", self.remaining),
                });
            }
            let c: Spilled = serde_json::from_str(&self.line).map_err(|e| Error::State {
                dir: self.path.display().to_string(),
                message: format!("an unreadable spilled change: {e}"),
            })?;
            out.push(c);
            self.remaining -= 1;
        }
        Ok(out)
    }

    /// How many changes are left to read.
    pub fn remaining(&self) -> u64 {
        self.remaining
    }
}

impl Drop for SpillReader {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn io_err(path: &Path, doing: &str, e: std::io::Error) -> Error {
    let hint = if e.kind() == std::io::ErrorKind::StorageFull {
        " (a large transaction needs disk under state_dir/spill in proportion to its \
         changes: free some, or move state_dir, then start again)"
    } else {
        ""
    };
    Error::State {
        dir: path.display().to_string(),
        message: format!("{doing} the spill file of a large transaction: {e}{hint}"),
    }
}

#[cfg(test)]
mod tests {
    use skein_common::Op;

    use super::*;

    fn change(i: usize) -> Spilled {
        Spilled {
            change: RawChange {
                table: ("public".into(), "customer".into()),
                op: Op::Update,
                old: None,
                new: Some(
                    [("id".to_string(), Some(i.to_string()))]
                        .into_iter()
                        .collect(),
                ),
            },
            unchanged: i.is_multiple_of(3).then(|| vec!["notes".to_string()]),
        }
    }

    #[test]
    fn changes_come_back_in_order_in_parts_and_the_file_goes_away() {
        let state = std::env::temp_dir().join(format!("skein-spill-{}", std::process::id()));
        let dir = prepare_dir(&state).unwrap();
        let mut w = SpillWriter::create(&dir, "tx-1").unwrap();
        w.write((0..10).map(change)).unwrap();
        w.write((10..25).map(change)).unwrap();
        assert_eq!(w.count(), 25);
        let mut r = w.finish().unwrap();
        let mut got = vec![];
        loop {
            let part = r.read(7).unwrap();
            if part.is_empty() {
                break;
            }
            assert!(part.len() <= 7);
            got.extend(part);
        }
        assert_eq!(r.remaining(), 0);
        let ids: Vec<String> = got
            .iter()
            .map(|c| c.change.new.as_ref().unwrap()["id"].clone().unwrap())
            .collect();
        assert_eq!(ids, (0..25).map(|i| i.to_string()).collect::<Vec<_>>());
        assert_eq!(
            got[3].unchanged.as_deref(),
            Some(&["notes".to_string()][..])
        );
        assert_eq!(got[4].unchanged, None);
        assert!(dir.join("tx-1").exists());
        drop(r);
        assert!(!dir.join("tx-1").exists());
        // An unfinished writer removes its file too; a new start empties
        // the directory.
        let w = SpillWriter::create(&dir, "tx-2").unwrap();
        drop(w);
        assert!(!dir.join("tx-2").exists());
        std::fs::write(dir.join("stale"), "x").unwrap();
        prepare_dir(&state).unwrap();
        assert!(!dir.join("stale").exists());
        let _ = std::fs::remove_dir_all(&state);
    }

    /// Fuzz property (see [`skein_common::fuzz`]): a spill file damaged on
    /// disk (cut short, bits flipped, lines spliced) reads back as changes
    /// or an error naming the file, never a panic, a hang or an allocation
    /// out of proportion.
    mod fuzz {
        use proptest::prelude::*;
        use skein_common::fuzz::{check, config, mutated};

        use super::*;

        const TOKENS: &[&[u8]] = &[b"\n", b"{", b"}", b"\"change\"", b"null", b"\"op\""];

        fn valid() -> impl Strategy<Value = Vec<u8>> {
            (1usize..6).prop_map(|n| {
                let mut out = vec![];
                for i in 0..n {
                    serde_json::to_writer(&mut out, &change(i)).unwrap();
                    out.push(b'\n');
                }
                out
            })
        }

        proptest! {
            #![proptest_config(config())]

            #[test]
            fn damaged_spill_files_read_as_changes_or_an_error(b in mutated(valid(), TOKENS)) {
                let dir = std::env::temp_dir().join(format!("skein-spill-fuzz-{}", std::process::id()));
                std::fs::create_dir_all(&dir).unwrap();
                let mut w = SpillWriter::create(&dir, "tx").unwrap();
                w.count = 6;
                let mut r = w.finish().unwrap();
                std::fs::write(dir.join("tx"), &b).unwrap();
                r.input = BufReader::new(File::open(dir.join("tx")).unwrap());
                check("spill file", b.len(), || {
                    while let Ok(part) = r.read(4) {
                        if part.is_empty() {
                            break;
                        }
                    }
                });
            }
        }
    }
}
