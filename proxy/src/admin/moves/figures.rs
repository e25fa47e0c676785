//! The figures a move in progress publishes in its journal row (`lokadb.moves.figures`), about
//! once a second, and how `lokadb status` shows them: the phase, rows and bytes, the rate,
//! the lag and an ETA. Written and read here only, so the two always agree.

use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

/// How often a move publishes its figures: about once a second, the first at once.
#[derive(Default)]
pub struct Pace {
    last: Option<Instant>,
}

impl Pace {
    const EVERY: Duration = Duration::from_secs(1);

    /// Whether it is time to publish again; if so, the clock starts over.
    pub fn due(&mut self) -> bool {
        let due = self.last.is_none_or(|t| t.elapsed() >= Self::EVERY);
        if due {
            self.last = Some(Instant::now());
        }
        due
    }
}

/// One moment of a move. Absent fields do not apply to the phase.
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
pub struct Figures {
    /// `copy`, `catch-up`, `copy (subscription)`, `catch-up (subscription)`.
    pub phase: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rows: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    /// What the copy expects in all (the tables' sizes in the source, an estimate).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub estimate: Option<u64>,
    /// Bytes copied per second since the phase began.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_per_s: Option<f64>,
    /// Catch-up: change records applied so far, and per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub applied: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub records_per_s: Option<f64>,
    /// Changes written and not yet applied (trigger mode), or WAL not yet confirmed (logical).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lag_records: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lag_bytes: Option<u64>,
    /// Seconds left at the current rate, when it can be told.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eta_s: Option<f64>,
    /// Seconds since the phase began.
    pub seconds: f64,
}

impl Figures {
    /// A copy's figures, its ETA from its rate since it began.
    pub fn copy(phase: &str, rows: u64, bytes: u64, estimate: u64, seconds: f64) -> Figures {
        let rate = bytes as f64 / seconds.max(0.001);
        let eta_s = (rate > 0.0 && estimate > bytes).then(|| (estimate - bytes) as f64 / rate);
        Figures {
            phase: phase.to_owned(),
            rows: Some(rows),
            bytes: Some(bytes),
            estimate: Some(estimate.max(bytes)),
            bytes_per_s: Some(rate),
            eta_s,
            seconds,
            ..Figures::default()
        }
    }

    /// A trigger-mode catch-up's figures: records applied since it began and those waiting.
    pub fn catch_up(phase: &str, applied: u64, waiting: u64, seconds: f64) -> Figures {
        let rate = applied as f64 / seconds.max(0.001);
        Figures {
            phase: phase.to_owned(),
            applied: Some(applied),
            records_per_s: Some(rate),
            lag_records: Some(waiting),
            eta_s: (rate > 0.0).then(|| waiting as f64 / rate),
            seconds,
            ..Figures::default()
        }
    }

    /// The journal's JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// One line for `lokadb status`; `None` for JSON this version cannot read.
    pub fn shown(json: &str) -> Option<String> {
        let f: Figures = serde_json::from_str(json).ok()?;
        Some(f.line())
    }

    /// `copy: 1,234 rows, 5.0 of ~12.0 MB, 2.1 MB/s, eta 3 s`.
    pub fn line(&self) -> String {
        let mut parts = Vec::new();
        if let Some(r) = self.rows {
            parts.push(format!("{} rows", thousands(r)));
        }
        match (self.bytes, self.estimate) {
            (Some(b), Some(e)) => parts.push(format!("{} of ~{} MB", mb(b), mb(e))),
            (Some(b), None) => parts.push(format!("{} MB", mb(b))),
            _ => {}
        }
        if let Some(r) = self.bytes_per_s {
            parts.push(format!("{} MB/s", mb(r as u64)));
        }
        if let Some(n) = self.lag_records {
            parts.push(format!("lag {} records", thousands(n)));
        }
        if let Some(n) = self.lag_bytes {
            parts.push(format!("lag {} MB", mb(n)));
        }
        if let Some(n) = self.applied {
            parts.push(format!("{} applied", thousands(n)));
        }
        if let Some(r) = self.records_per_s {
            parts.push(format!("{} records/s", thousands(r as u64)));
        }
        if let Some(e) = self.eta_s {
            parts.push(format!("eta {}", duration(e)));
        }
        parts.push(format!("for {}", duration(self.seconds)));
        format!("{}: {}", self.phase, parts.join(", "))
    }
}

fn mb(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / 1e6)
}

fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `42 s`, `3 min 5 s`, `2 h 1 min`.
fn duration(seconds: f64) -> String {
    let s = seconds.max(0.0).round() as u64;
    match s {
        0..=59 => format!("{s} s"),
        60..=3599 => format!("{} min {} s", s / 60, s % 60),
        _ => format!("{} h {} min", s / 3600, s % 3600 / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_reads_back_and_tells_its_eta() {
        let f = Figures::copy("copy", 1_234_567, 50_000_000, 150_000_000, 10.0);
        assert_eq!(f.eta_s, Some(20.0));
        let line = Figures::shown(&f.to_json()).unwrap();
        assert_eq!(
            line,
            "copy: 1,234,567 rows, 50.0 of ~150.0 MB, 5.0 MB/s, eta 20 s, for 10 s"
        );
    }

    #[test]
    fn a_copy_past_its_estimate_has_no_eta() {
        let f = Figures::copy("copy", 10, 2_000_000, 1_000_000, 1.0);
        assert_eq!(f.eta_s, None);
        assert_eq!(f.estimate, Some(2_000_000));
    }

    #[test]
    fn a_catch_up_shows_its_lag() {
        let f = Figures::catch_up("catch-up", 5_000, 1_200, 2.0);
        assert_eq!(
            f.line(),
            "catch-up: lag 1,200 records, 5,000 applied, 2,500 records/s, eta 0 s, for 2 s"
        );
        assert_eq!(duration(3725.0), "1 h 2 min");
        assert_eq!(duration(65.0), "1 min 5 s");
    }

    #[test]
    fn the_pace_lets_the_first_through_then_one_a_second() {
        let mut pace = Pace::default();
        assert!(pace.due());
        assert!(!pace.due());
        pace.last = Some(Instant::now() - Duration::from_secs(2));
        assert!(pace.due());
        assert!(!pace.due());
    }

    #[test]
    fn unreadable_json_is_not_shown() {
        assert_eq!(Figures::shown("{\"phase\": 3}"), None);
        assert_eq!(Figures::shown("not json"), None);
    }
}
