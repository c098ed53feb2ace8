//! The host as a card, for the plain CPU path.
//!
//! Compute buffers on the CPU path are host `Vec`s owned by the backend; the
//! CPU card books them so the same chokepoint, books and report work on a
//! machine without a GPU. Its probes read the operating system
//! (`/proc/meminfo`, `/proc/self/status` on Linux); elsewhere, or when those
//! files cannot be read, the configured total stands in and free memory is
//! total minus what we booked.

use crate::card::{CardError, CardKind, ProcessBytes, RawBlock, RawCard, VaRange};
use crate::Card;
use corridor_units::{Bytes, CardId};
use std::sync::atomic::{AtomicU64, Ordering};

/// The commit granularity of the CPU card: one 4 KiB host page.
pub const CPU_GRANULARITY: Bytes = Bytes(4096);

/// Host memory as a card.
#[derive(Debug)]
pub struct CpuCard {
    id: CardId,
    /// The total used when the OS cannot be asked.
    fallback_total: Bytes,
    booked: AtomicU64,
    next_handle: AtomicU64,
}

impl CpuCard {
    /// The host card; `fallback_total` stands in where `/proc` is unavailable.
    pub fn new(id: CardId, fallback_total: Bytes) -> CpuCard {
        CpuCard { id, fallback_total, booked: AtomicU64::new(0), next_handle: AtomicU64::new(0) }
    }

    fn booked(&self) -> Bytes {
        Bytes(self.booked.load(Ordering::Relaxed))
    }

    fn book(&self, bytes: Bytes) -> Result<u64, CardError> {
        let free = self.driver_free();
        if bytes > free {
            return Err(CardError::OutOfMemory { card: self.id, want: bytes, free });
        }
        self.booked.fetch_add(bytes.get(), Ordering::Relaxed);
        Ok(self.next_handle.fetch_add(1, Ordering::Relaxed) + 1)
    }

    fn unbook(&self, bytes: Bytes) {
        self.booked.fetch_sub(bytes.get().min(self.booked().get()), Ordering::Relaxed);
    }
}

/// Read a `Key:   123 kB` field from a /proc file.
fn proc_kib(path: &str, key: &str) -> Option<Bytes> {
    let text = std::fs::read_to_string(path).ok()?;
    parse_kib_field(&text, key)
}

fn parse_kib_field(text: &str, key: &str) -> Option<Bytes> {
    let line = text.lines().find(|l| l.split(':').next() == Some(key))?;
    let kib: u64 = line.split(':').nth(1)?.split_whitespace().next()?.parse().ok()?;
    Some(Bytes(kib * Bytes::KIB))
}

impl Card for CpuCard {
    fn id(&self) -> CardId {
        self.id
    }
    fn uuid(&self) -> String {
        "HOST".to_string()
    }
    fn kind(&self) -> CardKind {
        CardKind::Cpu
    }
    fn total(&self) -> Bytes {
        proc_kib("/proc/meminfo", "MemTotal").unwrap_or(self.fallback_total)
    }
    fn carve_out(&self) -> Bytes {
        Bytes::ZERO
    }
    fn driver_free(&self) -> Bytes {
        proc_kib("/proc/meminfo", "MemAvailable")
            .unwrap_or_else(|| self.fallback_total.saturating_sub(self.booked()))
    }
    fn process_bytes(&self) -> Bytes {
        proc_kib("/proc/self/status", "VmRSS").unwrap_or_else(|| self.booked())
    }
    fn processes(&self) -> Vec<ProcessBytes> {
        // Other processes' host memory is not corridor's to name; the host
        // card lists only this process.
        vec![ProcessBytes { pid: self.self_pid(), bytes: self.process_bytes() }]
    }
    fn names_every_holder(&self) -> bool {
        false
    }
    fn granularity(&self) -> Bytes {
        CPU_GRANULARITY
    }
}

impl RawCard for CpuCard {
    fn raw_alloc(&self, bytes: Bytes) -> Result<RawBlock, CardError> {
        Ok(RawBlock { handle: self.book(bytes)?, bytes })
    }
    fn raw_free(&self, block: RawBlock) {
        self.unbook(block.bytes);
    }
    fn reserve_va(&self, bytes: Bytes) -> Result<VaRange, CardError> {
        Ok(VaRange { handle: self.next_handle.fetch_add(1, Ordering::Relaxed) + 1, bytes })
    }
    fn release_va(&self, _va: VaRange) {}
    fn commit(&self, va: &VaRange, offset: Bytes, bytes: Bytes) -> Result<(), CardError> {
        if offset + bytes > va.bytes {
            return Err(CardError::BadRange { card: self.id, offset, bytes, reserved: va.bytes });
        }
        self.book(bytes).map(|_| ())
    }
    fn decommit(&self, _va: &VaRange, _offset: Bytes, bytes: Bytes) -> Result<(), CardError> {
        self.unbook(bytes);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_fields() {
        let text = "MemTotal:       16318408 kB\nMemFree:  1 kB\nMemAvailable:   9000000 kB\n";
        assert_eq!(parse_kib_field(text, "MemTotal"), Some(Bytes(16318408 * 1024)));
        assert_eq!(parse_kib_field(text, "MemAvailable"), Some(Bytes(9000000 * 1024)));
        assert_eq!(parse_kib_field(text, "Nope"), None);
    }

    #[test]
    fn books_and_probes() {
        let c = CpuCard::new(CardId(0), Bytes::gib(4));
        assert!(c.total() > Bytes::ZERO);
        assert!(c.driver_free() <= c.total());
        let b = c.raw_alloc(Bytes::mib(1)).unwrap();
        assert_eq!(c.booked(), Bytes::mib(1));
        c.raw_free(b);
        assert_eq!(c.booked(), Bytes::ZERO);
        assert_eq!(c.processes().len(), 1);
    }
}
