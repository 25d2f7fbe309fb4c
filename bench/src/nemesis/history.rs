//! The operation history of a nemesis run: every read and write of every
//! worker process, one fixed-size record each, in one file per process.
//!
//! **The clock.** Invocation and completion times are `CLOCK_BOOTTIME`
//! nanoseconds. Every process on the machine reads the same clock (network
//! namespaces do not change it; only a time namespace would, and the
//! nemesis makes none), so intervals taken in different processes compare.
//! `CLOCK_REALTIME` could be stepped by NTP mid-run and turn an interval
//! inside out; `CLOCK_MONOTONIC` is as good within a run but stops during a
//! suspend, while the cluster's leases (on other machines, or on this one
//! after resume) do not. Hosts behind `vm-exec` (other kernels) do not share
//! it: the nemesis refuses them.
//!
//! The invocation time is read before the client call starts and the
//! completion time after it returns, so each recorded interval contains the
//! operation's real one: the checker can only be more lenient than the
//! truth, never report a violation that did not happen.
//!
//! **A record** (40 bytes, little-endian): page u64, generation u64,
//! invocation ns u64, completion ns u64, flags u32 (bit 0: write; bit 1:
//! ok; bit 2: the bytes did not verify), process u32.

use std::io::{BufWriter, Read, Write};
use std::path::Path;

/// One operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Op {
    pub write: bool,
    /// Ok: a read returned verified bytes, or a write was acknowledged. A
    /// failed write may or may not have taken effect (indeterminate); a
    /// failed read returned nothing and is not checked.
    pub ok: bool,
    /// A read whose bytes were not any generation of the page (torn,
    /// another page's): always a violation.
    pub corrupt: bool,
    pub page: u64,
    /// The content generation read or written (the page's bytes 8..16).
    pub generation: u64,
    pub inv_ns: u64,
    pub resp_ns: u64,
    /// The worker process that did it.
    pub process: u32,
}

pub const RECORD: usize = 40;

const WRITE: u32 = 1;
const OK: u32 = 2;
const CORRUPT: u32 = 4;

impl Op {
    pub fn encode(&self) -> [u8; RECORD] {
        let mut b = [0u8; RECORD];
        b[0..8].copy_from_slice(&self.page.to_le_bytes());
        b[8..16].copy_from_slice(&self.generation.to_le_bytes());
        b[16..24].copy_from_slice(&self.inv_ns.to_le_bytes());
        b[24..32].copy_from_slice(&self.resp_ns.to_le_bytes());
        let flags = (if self.write { WRITE } else { 0 })
            | (if self.ok { OK } else { 0 })
            | (if self.corrupt { CORRUPT } else { 0 });
        b[32..36].copy_from_slice(&flags.to_le_bytes());
        b[36..40].copy_from_slice(&self.process.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; RECORD]) -> Self {
        let u = |r: std::ops::Range<usize>| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[r]);
            u64::from_le_bytes(w)
        };
        let mut w4 = [0u8; 4];
        w4.copy_from_slice(&b[32..36]);
        let flags = u32::from_le_bytes(w4);
        w4.copy_from_slice(&b[36..40]);
        Op {
            page: u(0..8),
            generation: u(8..16),
            inv_ns: u(16..24),
            resp_ns: u(24..32),
            write: flags & WRITE != 0,
            ok: flags & OK != 0,
            corrupt: flags & CORRUPT != 0,
            process: u32::from_le_bytes(w4),
        }
    }
}

/// `CLOCK_BOOTTIME` in nanoseconds (see the module header).
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec to the valid pointer given.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    if r != 0 {
        return 0;
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Appends records to a history file (buffered; flushed on `finish` and
/// every few thousand records, so a killed worker loses little).
pub struct Log {
    out: BufWriter<std::fs::File>,
    n: u64,
}

impl Log {
    pub fn create(path: &Path) -> anyhow::Result<Self> {
        let f = std::fs::File::create(path)?;
        Ok(Self {
            out: BufWriter::with_capacity(1 << 16, f),
            n: 0,
        })
    }

    pub fn push(&mut self, op: &Op) -> anyhow::Result<()> {
        self.out.write_all(&op.encode())?;
        self.n += 1;
        if self.n.is_multiple_of(4096) {
            self.out.flush()?;
        }
        Ok(())
    }

    pub fn finish(mut self) -> anyhow::Result<u64> {
        self.out.flush()?;
        Ok(self.n)
    }
}

/// Reads every record of a history file (a torn last record is dropped).
pub fn load(path: &Path) -> anyhow::Result<Vec<Op>> {
    let mut f = std::io::BufReader::new(std::fs::File::open(path)?);
    let mut v = Vec::new();
    let mut b = [0u8; RECORD];
    loop {
        match f.read_exact(&mut b) {
            Ok(()) => v.push(Op::decode(&b)),
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip() {
        let op = Op {
            write: true,
            ok: false,
            corrupt: true,
            page: 77,
            generation: 5,
            inv_ns: 10,
            resp_ns: 20,
            process: 3,
        };
        assert_eq!(Op::decode(&op.encode()), op);
        let a = now_ns();
        let b = now_ns();
        assert!(a > 0 && b >= a);
    }
}
