//! Receive memory: what each stream charges to the per-tunnel cap and the shared
//! budget, shedding the slowest reader when a cap is reached, and window
//! auto-tuning. The accounting is described in `memory.rs`; none of it is on the
//! wire, so the peer sees only ordinary WINDOW_UPDATEs and RESETs.

use std::time::Duration;

use super::super::code::ErrorCode;
use super::super::error::TunnelError;
use super::super::frame::StreamId;
use super::super::memory::growth_limit;
use super::Tunnel;

/// A grown window goes back to the base window once its stream has not been read
/// for this long (checked by [`Tunnel::handle_timeout`], so at the keepalive's
/// pace), and the reservation follows as the peer uses up the credit it holds.
pub(crate) const SHRINK_AFTER_IDLE: Duration = Duration::from_secs(1);

/// Which cap refused a charge.
#[derive(Debug, Clone, Copy)]
enum Cap {
    Tunnel(u64),
    Shared(u64),
}

impl Tunnel {
    /// Charges `len` bytes arriving on `stream`, shedding the stream with the most
    /// unread bytes (possibly this one) while a cap does not allow them. Returns
    /// whether `stream` may take the bytes (it was not shed).
    pub(super) fn charge_arrival(
        &mut self,
        stream: StreamId,
        len: usize,
    ) -> Result<bool, TunnelError> {
        loop {
            let Some(s) = self.streams.get(&stream) else {
                return Ok(false);
            };
            let after = (s.recv.buf.len() as u64 + len as u64).min(u64::from(s.recv.base));
            let delta = after.saturating_sub(s.recv.charged);
            if delta == 0 {
                return Ok(true);
            }
            let cap = match self.try_charge(delta) {
                Ok(()) => {
                    if let Some(s) = self.streams.get_mut(&stream) {
                        s.recv.charged = after;
                    }
                    return Ok(true);
                }
                Err(cap) => cap,
            };
            // The incoming bytes count for their stream: if it would hold the most,
            // it is the one shed. A victim holds unread bytes, so shedding frees
            // at least one charged byte and the loop ends.
            let victim = self
                .streams
                .iter()
                .map(|(&id, s)| {
                    let extra = if id == stream { len as u64 } else { 0 };
                    (s.recv.buf.len() as u64 + extra, id.0)
                })
                .max()
                .map_or(stream, |(_, id)| StreamId(id));
            self.shed(victim, cap)?;
            if victim == stream {
                return Ok(false);
            }
        }
    }

    /// Resets `stream` to free its receive memory.
    fn shed(&mut self, stream: StreamId, cap: Cap) -> Result<(), TunnelError> {
        self.stats.streams_shed += 1;
        let which = match cap {
            Cap::Tunnel(n) => format!("the tunnel's memory cap ({})", size(n)),
            Cap::Shared(n) => format!("the memory cap shared by all tunnels ({})", size(n)),
        };
        let reason = format!("the reader of this stream is too slow: {which} was reached");
        self.stream_fault(stream, ErrorCode::FLOW_CONTROL, reason)
    }

    fn try_charge(&mut self, n: u64) -> Result<(), Cap> {
        if let Some(cap) = self.config.memory_cap {
            if self.memory + n > cap {
                return Err(Cap::Tunnel(cap));
            }
        }
        if let Some(budget) = &self.config.memory_budget {
            if !budget.try_reserve(n) {
                return Err(Cap::Shared(budget.capacity()));
            }
        }
        self.memory += n;
        Ok(())
    }

    /// Reserves `n` bytes for window growth, which may fill only half of each cap.
    fn try_grow(&mut self, n: u64) -> bool {
        if let Some(cap) = self.config.memory_cap {
            if self.memory + n > growth_limit(cap) {
                return false;
            }
        }
        if let Some(budget) = &self.config.memory_budget {
            if !budget.try_reserve_below(n, growth_limit(budget.capacity())) {
                return false;
            }
        }
        self.memory += n;
        true
    }

    pub(super) fn uncharge(&mut self, n: u64) {
        self.memory -= n;
        if let Some(budget) = &self.config.memory_budget {
            budget.release(n);
        }
    }

    /// Brings a stream's charge down to what it holds after a read or a shrink.
    pub(super) fn settle(&mut self, stream: StreamId) {
        let Some(s) = self.streams.get_mut(&stream) else {
            return;
        };
        let r = &mut s.recv;
        let base = u64::from(r.base);
        let charged = (r.buf.len() as u64).min(base).min(r.charged);
        let reserved = u64::from(r.window)
            .max(r.granted())
            .saturating_sub(base)
            .min(r.reserved);
        let freed = (r.charged - charged) + (r.reserved - reserved);
        r.charged = charged;
        r.reserved = reserved;
        if freed > 0 {
            self.uncharge(freed);
        }
    }

    /// Queues a WINDOW_UPDATE for the stream if enough credit is due.
    pub(super) fn queue_update(&mut self, stream: StreamId) {
        let Some(s) = self.streams.get_mut(&stream) else {
            return;
        };
        if s.state.can_receive() && s.recv.update_due() && !s.recv.update_queued {
            s.recv.update_queued = true;
            self.updates.push_back(stream);
        }
    }

    /// Auto-tuning, after a read that took `consumed` from `before`: once a whole
    /// window has been read since the measurement began, a window read in less
    /// than two round trips doubles (up to the maximum, within the caps).
    pub(super) fn measure_read(&mut self, stream: StreamId, before: u64) {
        let (Some(auto), Some(rtt)) = (self.config.auto_window, self.rtt) else {
            return;
        };
        let now = self.clock;
        let Some(s) = self.streams.get_mut(&stream) else {
            return;
        };
        if !s.state.can_receive() {
            return; // the peer sends no more: nothing to tune
        }
        let r = &mut s.recv;
        let Some((start, from)) = r.epoch else {
            r.epoch = Some((now, before));
            return;
        };
        if r.consumed - from < u64::from(r.window) {
            return;
        }
        r.epoch = Some((now, r.consumed));
        if now.saturating_duration_since(start) >= rtt * 2 || r.window >= auto.max {
            return;
        }
        let window = (u64::from(r.window) * 2).min(u64::from(auto.max));
        let need = window
            .max(r.granted())
            .saturating_sub(u64::from(r.base))
            .saturating_sub(r.reserved);
        if !self.try_grow(need) {
            self.stats.window_growths_refused += 1;
            return;
        }
        self.stats.window_growths += 1;
        if let Some(s) = self.streams.get_mut(&stream) {
            s.recv.window = window as u32;
            s.recv.reserved += need;
        }
    }

    /// Puts the windows of streams not read for [`SHRINK_AFTER_IDLE`] back to the
    /// base window, releasing their reservation as the peer's credit runs out.
    pub(super) fn shrink_idle_windows(&mut self) {
        let now = self.clock;
        let idle: Vec<StreamId> = self
            .streams
            .iter()
            .filter(|(_, s)| {
                s.recv.window > s.recv.base
                    && s.recv
                        .last_read
                        .filter(|&at| now.saturating_duration_since(at) < SHRINK_AFTER_IDLE)
                        .is_none()
            })
            .map(|(&id, _)| id)
            .collect();
        for id in idle {
            if let Some(s) = self.streams.get_mut(&id) {
                s.recv.window = s.recv.base;
                s.recv.epoch = None;
            }
            self.settle(id);
        }
    }
}

/// A byte count for a reason text: "4 MiB", "640 KiB", "1000 bytes".
fn size(n: u64) -> String {
    if n >= 1 << 20 && n & ((1 << 20) - 1) == 0 {
        format!("{} MiB", n >> 20)
    } else if n >= 1 << 10 && n & ((1 << 10) - 1) == 0 {
        format!("{} KiB", n >> 10)
    } else {
        format!("{n} bytes")
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn sizes_read_well() {
        assert_eq!(super::size(4 << 20), "4 MiB");
        assert_eq!(super::size(640 << 10), "640 KiB");
        assert_eq!(super::size(1000), "1000 bytes");
    }
}
