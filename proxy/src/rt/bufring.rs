//! Receive buffers the kernel picks from when data arrives (an io_uring provided-buffer
//! ring): a socket waiting for data holds no memory, and a receive needs no `recv(2)` of
//! its own — it completes in the loop's one `io_uring_enter`.

use io_uring::types::BufRingEntry;
use std::cell::Cell;
use std::io;
use std::ptr::NonNull;

/// The buffer group id of the ring (one ring per thread).
pub const GROUP: u16 = 0;
/// Buffers in the ring: receives completed in one loop turn and not yet copied out each
/// hold one. When they run out a receive fails with ENOBUFS and the socket falls back to a
/// readiness poll plus `recv(2)`.
const COUNT: u16 = 128;
/// Bytes per buffer: a Postgres round trip's messages usually fit in one.
pub const SIZE: usize = 16 * 1024;

/// One thread's ring of receive buffers.
pub struct BufRing {
    /// The entries the kernel reads (page aligned, mmap'd).
    entries: NonNull<BufRingEntry>,
    entries_bytes: usize,
    /// COUNT buffers of SIZE bytes; written by the kernel, so only ever accessed through
    /// raw pointers, one completed buffer at a time.
    data: NonNull<u8>,
    /// Our copy of the ring's tail (the kernel only reads the shared one).
    tail: Cell<u16>,
}

impl BufRing {
    /// Maps the ring and fills it with every buffer. The caller registers it.
    ///
    /// # Errors
    ///
    /// `mmap(2)` failed.
    pub fn new() -> io::Result<BufRing> {
        let entries_bytes = usize::from(COUNT) * std::mem::size_of::<BufRingEntry>();
        let data_bytes = usize::from(COUNT) * SIZE;
        let map = |len: usize| -> io::Result<*mut libc::c_void> {
            // SAFETY: an anonymous private mapping; no existing memory is touched.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                Err(io::Error::last_os_error())
            } else {
                Ok(p)
            }
        };
        let entries = map(entries_bytes)?;
        let data = match map(data_bytes) {
            Ok(d) => d,
            Err(e) => {
                // SAFETY: unmapping what was just mapped.
                unsafe { libc::munmap(entries, entries_bytes) };
                return Err(e);
            }
        };
        let ring = BufRing {
            entries: NonNull::new(entries.cast()).expect("mmap returned null"),
            entries_bytes,
            data: NonNull::new(data.cast()).expect("mmap returned null"),
            tail: Cell::new(0),
        };
        for bid in 0..COUNT {
            ring.give_back(bid);
        }
        Ok(ring)
    }

    /// The address and entry count to register with the kernel.
    pub fn registration(&self) -> (u64, u16) {
        (self.entries.as_ptr() as u64, COUNT)
    }

    /// The first `len` bytes of buffer `bid`, which a completed receive filled.
    ///
    /// # Safety
    ///
    /// `bid` came from a completion and has not been given back; the slice must not be
    /// used after [`BufRing::give_back`]`(bid)`.
    pub unsafe fn bytes(&self, bid: u16, len: usize) -> &[u8] {
        assert!(
            bid < COUNT && len <= SIZE,
            "buffer {bid} / {len} out of range"
        );
        // SAFETY: in bounds (asserted); the kernel does not write a buffer it handed us
        // until it is given back (per the contract).
        unsafe { std::slice::from_raw_parts(self.data.as_ptr().add(usize::from(bid) * SIZE), len) }
    }

    /// Returns buffer `bid` to the kernel.
    pub fn give_back(&self, bid: u16) {
        assert!(bid < COUNT, "buffer {bid} out of range");
        let tail = self.tail.get();
        let mask = COUNT - 1;
        // SAFETY: the entry at tail & mask is ours to write (the kernel consumes entries
        // before the shared tail only); the buffer address is inside `data`.
        unsafe {
            let entry = &mut *self.entries.as_ptr().add(usize::from(tail & mask));
            entry.set_addr(self.data.as_ptr().add(usize::from(bid) * SIZE) as u64);
            entry.set_len(SIZE as u32);
            entry.set_bid(bid);
        }
        let tail = tail.wrapping_add(1);
        self.tail.set(tail);
        // SAFETY: the shared tail lives in the first entry's reserved field; the kernel
        // reads it with acquire ordering, so the entry written above is visible first.
        unsafe {
            let shared =
                BufRingEntry::tail(self.entries.as_ptr()) as *const std::sync::atomic::AtomicU16;
            (*shared).store(tail, std::sync::atomic::Ordering::Release);
        }
    }

    /// Frees the mappings. Only once the ring no longer references them (unregistered, or
    /// the io_uring gone).
    ///
    /// # Safety
    ///
    /// The kernel must no longer use the ring.
    pub unsafe fn unmap(&self) {
        // SAFETY: per the contract; both were mapped with these lengths.
        unsafe {
            libc::munmap(self.entries.as_ptr().cast(), self.entries_bytes);
            libc::munmap(self.data.as_ptr().cast(), usize::from(COUNT) * SIZE);
        }
    }
}

const _: () = assert!(COUNT.is_power_of_two());
