//! The initial copy: each table's rows of the organization streamed with COPY from the
//! source to the destination (through the relay and the tunnel when one side is the
//! organization's database), with progress.
//!
//! A large table is copied in parts, ranges of its heap's blocks (`ctid`, a TID range scan),
//! each over its own pair of connections, so one big table fills the link as several
//! tables would: one stream is bounded by the tunnel's window over the round trip. Every
//! part reads the same snapshot, exported by a transaction this command holds open for the
//! copy (`pg_export_snapshot`), so the parts together are one consistent read, as a single
//! COPY would be: no row is seen twice, whatever moves between blocks meanwhile.

use super::figures::{Figures, Pace};
use super::layout::MoveTable;
use crate::admin::db::{connect, AdminError};
use std::collections::VecDeque;
use std::io::{BufRead, IsTerminal, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// One table to copy.
pub struct Job {
    pub table: MoveTable,
    /// The source relation the table's rows are read from.
    pub source: String,
    /// The destination relation (emptied first: a copy cut short is started again).
    pub dest: String,
    /// Estimated bytes, for the ETA.
    pub estimate: u64,
}

/// Counters of one table's copy, shared with the progress display.
#[derive(Default)]
pub struct Counter {
    pub rows: AtomicU64,
    pub bytes: AtomicU64,
}

/// What a finished table copy reports.
pub struct Done {
    pub table: String,
    pub rows: u64,
    pub bytes: u64,
    pub seconds: f64,
    /// The parts it was copied in.
    pub parts: usize,
}

/// What the copy tells its caller as it goes.
pub enum Report<'a> {
    /// A table is copied whole, with the figures of the whole copy so far.
    Done(&'a Done, Figures),
    /// The figures of the whole copy, about once a second.
    Tick(Figures),
}

/// How tables are cut into parts.
#[derive(Clone, Copy, Debug)]
pub struct Split {
    /// Pairs of connections copying at once.
    pub streams: usize,
    /// About this many bytes of a table's heap per part.
    pub part_bytes: u64,
}

/// The most parts of one table: a few more than streams, so that parts of uneven density
/// still end close together.
fn most_parts(streams: usize) -> usize {
    streams * 2
}

/// The ranges of heap blocks a table of `blocks` blocks (`block_bytes` each) is copied in,
/// as `WHERE` conditions on `s.ctid`; one part (no condition) when it is small. The first
/// range is open below and the last open above, so rows anywhere are read by exactly one.
pub fn ranges(blocks: u64, block_bytes: u64, split: Split) -> Vec<Option<String>> {
    let wanted = (blocks.saturating_mul(block_bytes)).div_ceil(split.part_bytes.max(1));
    let n = wanted.clamp(1, most_parts(split.streams.max(1)) as u64);
    if n == 1 {
        return vec![None];
    }
    let bound = |k: u64| blocks * k / n;
    (0..n)
        .map(|k| {
            let lo = (k > 0).then(|| format!("s.ctid >= '({},0)'::tid", bound(k)));
            let hi = (k + 1 < n).then(|| format!("s.ctid < '({},0)'::tid", bound(k + 1)));
            Some(match (lo, hi) {
                (Some(lo), Some(hi)) => format!("{lo} AND {hi}"),
                (Some(c), None) | (None, Some(c)) => c,
                (None, None) => unreachable!("n > 1"),
            })
        })
        .collect()
}

/// One part of one table.
struct Part {
    job: usize,
    index: usize,
    sql: String,
}

/// What a part reports: (rows, bytes, started).
type PartResult = Result<(u64, u64, Instant), AdminError>;

/// Copies `jobs` in parts over `split.streams` pairs of connections, calling `done` (on
/// this thread) as each table ends.
///
/// # Errors
///
/// The first failure (the other copies finish or fail first; a rerun copies every
/// table not reported done).
pub fn run(
    source_dsn: &str,
    dest_dsn: &str,
    jobs: Vec<Job>,
    split: Split,
    mut report: impl FnMut(Report<'_>) -> Result<(), AdminError>,
) -> Result<(), AdminError> {
    if jobs.is_empty() {
        return Ok(());
    }
    // The snapshot every part reads, held until the copy ends.
    let mut holder = connect(source_dsn)?;
    super::session_settings(&mut holder)?;
    // Sizes first, outside the snapshot's transaction, which then holds no lock on the
    // tables (a migration waits for no more than a COPY of the table it changes); rows
    // that land in blocks past the size read here are read by the last part, open above.
    let settings = holder.query_one(
        "SELECT current_setting('server_version_num')::int >= 140000,
                current_setting('block_size')::bigint",
        &[],
    )?;
    let (tid_ranges, block_bytes): (bool, i64) = (settings.get(0), settings.get(1));
    let mut blocks = Vec::with_capacity(jobs.len());
    for job in &jobs {
        let n: i64 = holder
            .query_one(
                "SELECT coalesce(pg_relation_size(to_regclass($1)), 0) / current_setting('block_size')::bigint",
                &[&job.source],
            )?
            .get(0);
        blocks.push(n.unsigned_abs());
    }
    // The snapshot every part reads, held until the copy ends.
    holder.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")?;
    let snapshot: String = holder.query_one("SELECT pg_export_snapshot()", &[])?.get(0);
    let mut parts = VecDeque::new();
    // Per table: its parts, and how many have not reported yet.
    let mut of_table = Vec::with_capacity(jobs.len());
    for (i, job) in jobs.iter().enumerate() {
        // Before version 14 a range of ctid is a scan of the whole table: one part.
        let conditions = if tid_ranges {
            ranges(blocks[i], block_bytes.unsigned_abs(), split)
        } else {
            vec![None]
        };
        let of = conditions.len();
        of_table.push(of);
        for (index, c) in conditions.into_iter().enumerate() {
            let filter = c.map(|c| format!(" WHERE {c}")).unwrap_or_default();
            parts.push_back(Part {
                job: i,
                index,
                sql: format!(
                    "COPY (SELECT {} FROM {} s{filter}) TO STDOUT",
                    job.table.cols_of("s"),
                    job.source
                ),
            });
        }
    }
    // Emptied once, before any part writes.
    let mut dest = connect(dest_dsn)?;
    super::session_settings(&mut dest)?;
    for job in &jobs {
        dest.batch_execute(&format!("TRUNCATE {}", job.dest))?;
    }
    drop(dest);

    let total_estimate: u64 = jobs.iter().map(|j| j.estimate).sum();
    let counters: Vec<Arc<Counter>> = jobs.iter().map(|_| Arc::default()).collect();
    let failed: Arc<Vec<AtomicBool>> =
        Arc::new(jobs.iter().map(|_| AtomicBool::new(false)).collect());
    let names: Vec<String> = jobs.iter().map(|j| j.table.display()).collect();
    let display = Display::new(&names, &jobs, total_estimate);
    let targets: Arc<Vec<(String, String)>> = Arc::new(
        jobs.iter()
            .map(|j| (j.dest.clone(), j.table.cols()))
            .collect(),
    );
    let total_parts = parts.len();
    let mut left = of_table.clone();
    let (tx, rx) = mpsc::channel::<(usize, usize, PartResult)>();
    let queue = Arc::new(Mutex::new(parts));
    let workers = split.streams.max(1).min(total_parts);
    let mut handles = Vec::new();
    for _ in 0..workers {
        let (queue, tx, counters, failed, targets) = (
            queue.clone(),
            tx.clone(),
            counters.clone(),
            failed.clone(),
            targets.clone(),
        );
        let (src, dst, snapshot) = (source_dsn.to_owned(), dest_dsn.to_owned(), snapshot.clone());
        handles.push(std::thread::spawn(move || {
            let mut streams = None;
            loop {
                let next = queue.lock().ok().and_then(|mut q| q.pop_front());
                let Some(part) = next else { return };
                if failed[part.job].load(Ordering::Relaxed) {
                    continue;
                }
                let started = Instant::now();
                let r = match &mut streams {
                    Some(s) => Ok(s),
                    None => open(&src, &dst).map(|s| streams.insert(s)),
                }
                .and_then(|(source, dest)| {
                    let (table, cols) = &targets[part.job];
                    copy_part(
                        source,
                        dest,
                        &snapshot,
                        &part.sql,
                        table,
                        cols,
                        &counters[part.job],
                    )
                });
                if r.is_err() {
                    // A connection that failed mid-copy is not reused.
                    failed[part.job].store(true, Ordering::Relaxed);
                    streams = None;
                }
                let r = r.map(|(rows, bytes)| (rows, bytes, started));
                if tx.send((part.job, part.index, r)).is_err() {
                    return;
                }
            }
        }));
    }
    drop(tx);
    let started = Instant::now();
    let mut pace = Pace::default();
    let mut first_error = None;
    let mut sums: Vec<(u64, u64, Option<Instant>)> = vec![(0, 0, None); jobs.len()];
    let mut parts_left = total_parts;
    while parts_left > 0 {
        match rx.recv_timeout(Duration::from_millis(250)) {
            Ok((i, index, result)) => {
                parts_left -= 1;
                left[i] -= 1;
                match result {
                    Ok((rows, bytes, began)) => {
                        let s = &mut sums[i];
                        s.0 += rows;
                        s.1 += bytes;
                        s.2 = Some(s.2.map_or(began, |b| b.min(began)));
                    }
                    Err(e) => {
                        display.fail(i);
                        let part = if of_table[i] > 1 {
                            format!(" (part {} of {})", index + 1, of_table[i])
                        } else {
                            String::new()
                        };
                        first_error.get_or_insert(AdminError::failed(format!(
                            "copying {}{part}: {}",
                            names[i], e.message
                        )));
                    }
                }
                if left[i] == 0 && !failed[i].load(Ordering::Relaxed) {
                    let (rows, bytes, began) = sums[i];
                    let d = Done {
                        table: names[i].clone(),
                        rows,
                        bytes,
                        seconds: began.unwrap_or(started).elapsed().as_secs_f64(),
                        parts: of_table[i],
                    };
                    display.finish(i, &d);
                    let figures = display.figures(&counters, started);
                    if let Err(e) = report(Report::Done(&d, figures)) {
                        first_error.get_or_insert(e);
                    }
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => display.tick(&counters, started),
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
        if parts_left > 0 && pace.due() {
            // Figures for onlookers only: a failed write of them does not stop the copy.
            let _ = report(Report::Tick(display.figures(&counters, started)));
        }
    }
    for h in handles {
        let _ = h.join();
    }
    display.clear();
    let _ = holder.batch_execute("COMMIT");
    first_error.map_or(Ok(()), Err)
}
/// A worker's pair of connections, source and destination.
fn open(src: &str, dst: &str) -> Result<(postgres::Client, postgres::Client), AdminError> {
    let mut source = connect(src)?;
    let mut dest = connect(dst)?;
    super::session_settings(&mut source)?;
    super::session_settings(&mut dest)?;
    Ok((source, dest))
}

/// Streams one part: `sql` (a `COPY … TO STDOUT`) read under `snapshot`, written into
/// `table`'s `cols`. Returns (rows, bytes).
fn copy_part(
    source: &mut postgres::Client,
    dest: &mut postgres::Client,
    snapshot: &str,
    sql: &str,
    table: &str,
    cols: &str,
    counter: &Counter,
) -> Result<(u64, u64), AdminError> {
    source.batch_execute(&format!(
        "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY; SET TRANSACTION SNAPSHOT {}",
        crate::admin::db::literal(snapshot)
    ))?;
    let mut reader = source.copy_out(sql)?;
    let mut writer = dest.copy_in(&format!("COPY {table} ({cols}) FROM STDIN"))?;
    let mut bytes = 0u64;
    loop {
        let buf = reader
            .fill_buf()
            .map_err(|e| AdminError::failed(format!("reading the source: {e}")))?;
        if buf.is_empty() {
            break;
        }
        counter.rows.fetch_add(
            memchr::memchr_iter(b'\n', buf).count() as u64,
            Ordering::Relaxed,
        );
        counter.bytes.fetch_add(buf.len() as u64, Ordering::Relaxed);
        bytes += buf.len() as u64;
        writer
            .write_all(buf)
            .map_err(|e| AdminError::failed(format!("writing the destination: {e}")))?;
        let n = buf.len();
        reader.consume(n);
        super::failpoint("copy");
    }
    drop(reader);
    let rows = writer.finish()?;
    source.batch_execute("COMMIT")?;
    Ok((rows, bytes))
}

/// Bars on a terminal, else a line every 5 s.
struct Display {
    multi: Option<(indicatif::MultiProgress, Vec<indicatif::ProgressBar>)>,
    estimate: u64,
    last: std::cell::Cell<Instant>,
}

impl Display {
    fn new(names: &[String], jobs: &[Job], estimate: u64) -> Display {
        let multi = std::io::stderr().is_terminal().then(|| {
            let m = indicatif::MultiProgress::new();
            let style = indicatif::ProgressStyle::with_template(
                "{msg:24} [{bar:30}] {bytes}/~{total_bytes} {bytes_per_sec}, eta {eta}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> ");
            let bars = names
                .iter()
                .zip(jobs)
                .map(|(n, j)| {
                    let b = m.add(indicatif::ProgressBar::new(j.estimate.max(1)));
                    b.set_style(style.clone());
                    b.set_message(format!("copy {n}"));
                    b
                })
                .collect();
            (m, bars)
        });
        Display {
            multi,
            estimate,
            last: std::cell::Cell::new(Instant::now()),
        }
    }

    fn figures(&self, counters: &[Arc<Counter>], started: Instant) -> Figures {
        let rows: u64 = counters
            .iter()
            .map(|c| c.rows.load(Ordering::Relaxed))
            .sum();
        let bytes: u64 = counters
            .iter()
            .map(|c| c.bytes.load(Ordering::Relaxed))
            .sum();
        Figures::copy(
            "copy",
            rows,
            bytes,
            self.estimate,
            started.elapsed().as_secs_f64(),
        )
    }

    fn tick(&self, counters: &[Arc<Counter>], started: Instant) {
        match &self.multi {
            Some((_, bars)) => {
                for (b, c) in bars.iter().zip(counters) {
                    let n = c.bytes.load(Ordering::Relaxed);
                    if n > b.length().unwrap_or(0) {
                        b.set_length(n);
                    }
                    b.set_position(n);
                }
            }
            None => {
                if self.last.get().elapsed() >= Duration::from_secs(5) {
                    self.last.set(Instant::now());
                    eprintln!("lokadb: {}", self.figures(counters, started).line());
                }
            }
        }
    }

    fn finish(&self, i: usize, d: &Done) {
        let parts = if d.parts > 1 {
            format!(", {} parts", d.parts)
        } else {
            String::new()
        };
        let msg = format!(
            "copied {}: {} rows, {:.1} MB in {:.1} s ({:.1} MB/s{parts})",
            d.table,
            d.rows,
            d.bytes as f64 / 1e6,
            d.seconds,
            d.bytes as f64 / 1e6 / d.seconds.max(0.001)
        );
        match &self.multi {
            Some((m, bars)) => {
                bars[i].finish_and_clear();
                let _ = m.println(format!("lokadb: {msg}"));
            }
            None => eprintln!("lokadb: {msg}"),
        }
    }

    fn fail(&self, i: usize) {
        if let Some((_, bars)) = &self.multi {
            bars[i].abandon();
        }
    }

    fn clear(&self) {
        if let Some((m, _)) = &self.multi {
            let _ = m.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPLIT: Split = Split {
        streams: 4,
        part_bytes: 16 << 20,
    };

    #[test]
    fn a_small_table_is_one_part_without_condition() {
        assert_eq!(ranges(0, 8192, SPLIT), vec![None]);
        assert_eq!(ranges(2048, 8192, SPLIT), vec![None]);
    }

    #[test]
    fn parts_cover_every_block_once_open_at_both_ends() {
        // 60 MiB: four parts of 16 MiB or less.
        let r = ranges(7680, 8192, SPLIT);
        assert_eq!(
            r,
            vec![
                Some("s.ctid < '(1920,0)'::tid".to_owned()),
                Some("s.ctid >= '(1920,0)'::tid AND s.ctid < '(3840,0)'::tid".to_owned()),
                Some("s.ctid >= '(3840,0)'::tid AND s.ctid < '(5760,0)'::tid".to_owned()),
                Some("s.ctid >= '(5760,0)'::tid".to_owned()),
            ]
        );
    }

    #[test]
    fn parts_are_at_most_twice_the_streams() {
        // 600 MiB with 4 streams: 8 parts, not 38.
        assert_eq!(ranges(76_800, 8192, SPLIT).len(), 8);
        let one = Split {
            streams: 1,
            part_bytes: 1 << 20,
        };
        assert_eq!(ranges(76_800, 8192, one).len(), 2);
    }
}
