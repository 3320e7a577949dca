//! Sinks: where the relay sends events.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// A destination for CloudEvents.
///
/// Contract: `send` returns `Ok` only once every event is durably handed
/// over (flushed and synced for files). A failed or interrupted `send` may
/// have delivered some events; the relay sends them again with the same id
/// (at-least-once), so receivers dedupe by event id.
pub trait Sink: Send {
    /// Sends events, in order.
    fn send(&mut self, events: &[String]) -> Result<()>;
}

/// One JSON event per line on standard output.
pub struct StdoutSink;

impl Sink for StdoutSink {
    fn send(&mut self, events: &[String]) -> Result<()> {
        let mut out = std::io::stdout().lock();
        for e in events {
            writeln!(out, "{e}").map_err(io("writing to stdout"))?;
        }
        out.flush().map_err(io("flushing stdout"))
    }
}

/// JSON Lines file, appended to and synced on every send.
pub struct FileSink {
    file: File,
    path: PathBuf,
    echo_stdout: bool,
}

impl FileSink {
    /// Opens (creating) the file. A last line cut short by a crash is
    /// removed, so the file always holds whole events.
    pub fn open(path: &Path, echo_stdout: bool) -> Result<FileSink> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io("creating the sink directory"))?;
        }
        let mut file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(path)
            .map_err(io("opening the sink file"))?;
        let len = file.metadata().map_err(io("reading the sink file"))?.len();
        if len > 0 {
            // Find the end of the last complete line.
            let mut keep = len;
            let mut buf = [0u8; 1];
            while keep > 0 {
                file.seek(SeekFrom::Start(keep - 1))
                    .map_err(io("reading the sink file"))?;
                file.read_exact(&mut buf)
                    .map_err(io("reading the sink file"))?;
                if buf[0] == b'\n' {
                    break;
                }
                keep -= 1;
            }
            if keep != len {
                tracing::warn!(path = %path.display(), cut = len - keep, "removing a partial last line left by a crash");
                file.set_len(keep).map_err(io("truncating the sink file"))?;
            }
        }
        file.seek(SeekFrom::End(0))
            .map_err(io("seeking the sink file"))?;
        Ok(FileSink {
            file,
            path: path.to_path_buf(),
            echo_stdout,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Sink for FileSink {
    fn send(&mut self, events: &[String]) -> Result<()> {
        let mut buf = String::with_capacity(events.iter().map(|e| e.len() + 1).sum());
        for e in events {
            buf.push_str(e);
            buf.push('\n');
        }
        self.file
            .write_all(buf.as_bytes())
            .map_err(io("writing the sink file"))?;
        self.file.sync_data().map_err(io("syncing the sink file"))?;
        if self.echo_stdout {
            StdoutSink.send(events)?;
        }
        Ok(())
    }
}

fn io(what: &'static str) -> impl FnOnce(std::io::Error) -> Error {
    move |e| Error::Sink {
        message: format!("{what}: {e}"),
        source: Some(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_sink_appends_and_repairs_a_partial_line() {
        let p = std::env::temp_dir().join(format!("skein-sink-{}.jsonl", std::process::id()));
        std::fs::write(&p, "{\"a\":1}\n{\"b\":").unwrap();
        let mut s = FileSink::open(&p, false).unwrap();
        s.send(&["{\"c\":3}".to_string()]).unwrap();
        drop(s);
        assert_eq!(
            std::fs::read_to_string(&p).unwrap(),
            "{\"a\":1}\n{\"c\":3}\n"
        );
        let _ = std::fs::remove_file(&p);
    }
}
