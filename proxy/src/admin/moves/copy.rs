//! The initial copy: each table's rows of the organization streamed with COPY from the
//! source to the destination (through the relay and the tunnel when one side is the
//! organization's database), tables in parallel, with progress.

use super::layout::MoveTable;
use crate::admin::db::{connect, AdminError};
use std::io::{BufRead, IsTerminal, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// One table to copy.
pub struct Job {
    pub table: MoveTable,
    /// `COPY (…) TO STDOUT` on the source.
    pub out_sql: String,
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
}

/// Copies `jobs`, `parallel` at a time, calling `done` (on this thread) as each ends.
///
/// # Errors
///
/// The first failure (the other copies finish or fail first; a rerun copies every
/// table not reported done).
pub fn run(
    source_dsn: &str,
    dest_dsn: &str,
    jobs: Vec<Job>,
    parallel: usize,
    mut done: impl FnMut(&Done, &str) -> Result<(), AdminError>,
) -> Result<(), AdminError> {
    if jobs.is_empty() {
        return Ok(());
    }
    let total_estimate: u64 = jobs.iter().map(|j| j.estimate).sum();
    let counters: Vec<Arc<Counter>> = jobs.iter().map(|_| Arc::default()).collect();
    let names: Vec<String> = jobs.iter().map(|j| j.table.display()).collect();
    let display = Display::new(&names, &jobs, total_estimate);
    let (tx, rx) = mpsc::channel::<(usize, Result<Done, AdminError>)>();
    let queue = Arc::new(std::sync::Mutex::new(
        jobs.into_iter().enumerate().collect::<Vec<_>>(),
    ));
    let workers = parallel.max(1).min(names.len());
    let mut handles = Vec::new();
    for _ in 0..workers {
        let (queue, tx, counters) = (queue.clone(), tx.clone(), counters.clone());
        let (src, dst) = (source_dsn.to_owned(), dest_dsn.to_owned());
        handles.push(std::thread::spawn(move || loop {
            let next = queue.lock().ok().and_then(|mut q| q.pop());
            let Some((i, job)) = next else { return };
            let r = copy_one(&src, &dst, &job, &counters[i]);
            if tx.send((i, r)).is_err() {
                return;
            }
        }));
    }
    drop(tx);
    let started = Instant::now();
    let mut first_error = None;
    let mut left = names.len();
    while left > 0 {
        match rx.recv_timeout(Duration::from_millis(250)) {
            Ok((i, Ok(d))) => {
                left -= 1;
                display.finish(i, &d);
                let line = display.line(&counters, started);
                if let Err(e) = done(&d, &line) {
                    first_error.get_or_insert(e);
                }
            }
            Ok((i, Err(e))) => {
                left -= 1;
                display.fail(i);
                first_error.get_or_insert(AdminError::failed(format!(
                    "copying {}: {}",
                    names[i], e.message
                )));
            }
            Err(mpsc::RecvTimeoutError::Timeout) => display.tick(&counters, started),
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    for h in handles {
        let _ = h.join();
    }
    display.clear();
    first_error.map_or(Ok(()), Err)
}

fn copy_one(src: &str, dst: &str, job: &Job, counter: &Counter) -> Result<Done, AdminError> {
    let started = Instant::now();
    let mut source = connect(src)?;
    let mut dest = connect(dst)?;
    super::session_settings(&mut source)?;
    super::session_settings(&mut dest)?;
    dest.batch_execute(&format!("TRUNCATE {}", job.dest))?;
    let mut reader = source.copy_out(&job.out_sql)?;
    let mut writer = dest.copy_in(&format!(
        "COPY {} ({}) FROM STDIN",
        job.dest,
        job.table.cols()
    ))?;
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
        writer
            .write_all(buf)
            .map_err(|e| AdminError::failed(format!("writing the destination: {e}")))?;
        let n = buf.len();
        reader.consume(n);
        super::failpoint("copy");
    }
    drop(reader);
    let rows = writer.finish()?;
    Ok(Done {
        table: job.table.display(),
        rows,
        bytes: counter.bytes.load(Ordering::Relaxed),
        seconds: started.elapsed().as_secs_f64(),
    })
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

    fn line(&self, counters: &[Arc<Counter>], started: Instant) -> String {
        let rows: u64 = counters
            .iter()
            .map(|c| c.rows.load(Ordering::Relaxed))
            .sum();
        let bytes: u64 = counters
            .iter()
            .map(|c| c.bytes.load(Ordering::Relaxed))
            .sum();
        let secs = started.elapsed().as_secs_f64().max(0.001);
        let rate = bytes as f64 / secs;
        let eta = if rate > 0.0 && self.estimate > bytes {
            format!(", eta {:.0} s", (self.estimate - bytes) as f64 / rate)
        } else {
            String::new()
        };
        format!(
            "copy: {rows} rows, {:.1} of ~{:.1} MB, {:.1} MB/s{eta}",
            bytes as f64 / 1e6,
            self.estimate.max(bytes) as f64 / 1e6,
            rate / 1e6
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
                    eprintln!("lokadb: {}", self.line(counters, started));
                }
            }
        }
    }

    fn finish(&self, i: usize, d: &Done) {
        let msg = format!(
            "copied {}: {} rows, {:.1} MB in {:.1} s ({:.1} MB/s)",
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
