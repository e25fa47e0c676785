//! Reconnect delays: exponential from 100 ms, doubling, capped at 800 ms, each one
//! jittered to 50–100 % of its nominal value so that agents cut off by one relay
//! restart do not all dial back in the same millisecond. The cap keeps an agent back
//! within about a second of a relay restart. Reset after a successful handshake.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// First delay after a failure.
pub const FIRST_DELAY: Duration = Duration::from_millis(100);
/// Largest delay between two attempts.
pub const MAX_DELAY: Duration = Duration::from_millis(800);

/// The delays between reconnect attempts.
#[derive(Debug)]
pub struct Backoff {
    first: Duration,
    cap: Duration,
    nominal: Duration,
    rng: XorShift,
}

impl Backoff {
    /// Delays from `first` doubling up to `cap`, jittered from `seed`.
    pub fn new(first: Duration, cap: Duration, seed: u64) -> Backoff {
        Backoff {
            first,
            cap,
            nominal: first,
            rng: XorShift::new(seed),
        }
    }

    /// The delay before the next attempt: 50–100 % of the nominal delay, which then
    /// doubles (up to the cap).
    pub fn next_delay(&mut self) -> Duration {
        let nominal = self.nominal;
        self.nominal = (nominal * 2).min(self.cap);
        let half = (nominal.as_nanos() / 2) as u64;
        Duration::from_nanos(half + self.rng.next() % (half + 1))
    }

    /// Back to the first delay, after a successful handshake.
    pub fn reset(&mut self) {
        self.nominal = self.first;
    }
}

/// A seed that differs between processes and between calls: clock and pid.
pub fn seed(salt: u64) -> u64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    nanos ^ (u64::from(std::process::id()) << 32) ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// xorshift64*: enough randomness for jitter, no crate needed.
#[derive(Debug)]
struct XorShift(u64);

impl XorShift {
    fn new(seed: u64) -> XorShift {
        XorShift(seed | 1) // never zero, the one state xorshift cannot leave
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_to_the_cap_within_jitter_bounds() {
        let mut b = Backoff::new(FIRST_DELAY, MAX_DELAY, seed(1));
        for nominal_ms in [100u64, 200, 400, 800, 800, 800] {
            let d = b.next_delay();
            let nominal = Duration::from_millis(nominal_ms);
            assert!(
                d >= nominal / 2 && d <= nominal,
                "{d:?} outside 50-100% of {nominal:?}"
            );
        }
        b.reset();
        assert!(b.next_delay() <= FIRST_DELAY);
    }

    #[test]
    fn jitter_spreads_delays() {
        let mut b = Backoff::new(MAX_DELAY, MAX_DELAY, seed(2));
        let delays: Vec<Duration> = (0..200).map(|_| b.next_delay()).collect();
        let min = *delays.iter().min().unwrap();
        let max = *delays.iter().max().unwrap();
        assert!(min >= MAX_DELAY / 2 && max <= MAX_DELAY);
        // Spread over most of the 400 ms range, not stuck at one value.
        assert!(max - min > Duration::from_millis(300), "{min:?}..{max:?}");
    }

    #[test]
    fn seeds_differ_per_salt() {
        let mut a = Backoff::new(MAX_DELAY, MAX_DELAY, 1);
        let mut b = Backoff::new(MAX_DELAY, MAX_DELAY, 2);
        let a: Vec<_> = (0..8).map(|_| a.next_delay()).collect();
        let b: Vec<_> = (0..8).map(|_| b.next_delay()).collect();
        assert_ne!(a, b);
    }
}
