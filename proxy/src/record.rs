//! Traffic recording (`lokadb proxy --record FILE`): every session's bytes after login, both
//! directions, for replay and for studying an application's statements.
//!
//! Each core appends to its own file, `FILE.<core>` (no lock, no cross-core traffic), made
//! with mode 0600. The format, after the line `LOKADB-RECORD 1\n`, is a sequence of records:
//!
//! | field | type |
//! |---|---|
//! | kind | u8: `S` session start, `F` client → cloud bytes, `B` cloud → client bytes, `E` end |
//! | session | u32, big-endian: the session's id, `core << 24 \| sequence` (unique among the sessions alive; not the backend's process id, which a pooled backend keeps across sessions) |
//! | time | u64, big-endian: microseconds since the Unix epoch |
//! | length | u32, big-endian |
//! | data | `length` bytes: for `S`, `database\0user\0`; for `F`/`B`, the bytes as read (whole protocol messages only when concatenated per session and direction); empty for `E` |
//!
//! Login (startup packet, SCRAM exchange) is never recorded; everything after it is, row data
//! and literal values included. A write error stops the recording (logged once); sessions go on.

use std::cell::{Cell, RefCell};
use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, Seek, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// The first line of every recording file.
pub const HEADER: &[u8] = b"LOKADB-RECORD 1\n";

/// What a record holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Start = b'S' as isize,
    Frontend = b'F' as isize,
    Backend = b'B' as isize,
    End = b'E' as isize,
}

/// One core's recording file.
pub struct Recorder {
    path: PathBuf,
    out: RefCell<BufWriter<File>>,
    failed: Cell<bool>,
}

/// The file of core `core` for `--record FILE`.
pub fn core_path(prefix: &Path, core: usize) -> PathBuf {
    let mut p = prefix.as_os_str().to_owned();
    p.push(format!(".{core}"));
    PathBuf::from(p)
}

impl Recorder {
    /// Opens (creates, mode 0600, or appends to) core `core`'s file.
    ///
    /// # Errors
    ///
    /// The file cannot be opened or written.
    pub fn open(prefix: &Path, core: usize) -> io::Result<Recorder> {
        let path = core_path(prefix, core);
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&path)?;
        if file.seek(io::SeekFrom::End(0))? == 0 {
            file.write_all(HEADER)?;
        }
        Ok(Recorder {
            path,
            out: RefCell::new(BufWriter::with_capacity(64 * 1024, file)),
            failed: Cell::new(false),
        })
    }

    /// Records `data` of `kind` for `session`.
    pub fn record(&self, kind: Kind, session: u32, data: &[u8]) {
        if self.failed.get() {
            return;
        }
        let micros = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        let mut head = [0u8; 17];
        head[0] = kind as u8;
        head[1..5].copy_from_slice(&session.to_be_bytes());
        head[5..13].copy_from_slice(&micros.to_be_bytes());
        head[13..17].copy_from_slice(&(data.len() as u32).to_be_bytes());
        let mut out = self.out.borrow_mut();
        let result = out.write_all(&head).and_then(|()| out.write_all(data));
        drop(out);
        if let Err(e) = result {
            self.fail(&e);
        }
    }

    /// Records a session's start: its database and role.
    pub fn start(&self, session: u32, database: &str, user: &str) {
        let mut data = Vec::with_capacity(database.len() + user.len() + 2);
        for part in [database, user] {
            data.extend_from_slice(part.as_bytes());
            data.push(0);
        }
        self.record(Kind::Start, session, &data);
    }

    /// Writes what is buffered to the file (at each session's end and every tick).
    pub fn flush(&self) {
        if self.failed.get() {
            return;
        }
        let result = self.out.borrow_mut().flush();
        if let Err(e) = result {
            self.fail(&e);
        }
    }

    fn fail(&self, e: &io::Error) {
        self.failed.set(true);
        tracing::error!(file = %self.path.display(), error = %e, "cannot write the traffic recording; recording stopped, sessions go on");
    }
}
