//! Where KV pages start, in the units a device page table holds.
//!
//! A device kernel finds a token's K (or V) row at `base + unit(page) * 256
//! + slot * row_bytes`, where `unit` is a u32 entry of the step's page table.
//! The host translates page ids to units once per step, so one kernel serves
//! a store of its own (pages back to back) and a page of the card's KV arena,
//! whose chunks may end in a gap (a chunk is whole granules of the card, its
//! pages need not fill it).

use corridor_units::PageId;
use corridor_vram::ChunkGeometry;

/// Bytes of one KV unit (kernels/common.cu `KV_UNIT_SHIFT`).
pub const KV_UNIT_BYTES: u64 = 256;

/// Where the pages of a KV store start, in KV units from its base: pages are
/// packed `chunk_pages` to a chunk, chunks `chunk_units` apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvAddressing {
    chunk_pages: usize,
    chunk_units: u64,
    page_units: u64,
}

impl KvAddressing {
    /// Page ids as they are (before any store is known).
    pub const IDENTITY: KvAddressing =
        KvAddressing { chunk_pages: usize::MAX, chunk_units: 0, page_units: 1 };

    /// Pages of `page_bytes` back to back, each starting on a whole unit.
    pub fn contiguous(page_bytes: u64, num_pages: usize) -> KvAddressing {
        KvAddressing {
            chunk_pages: num_pages.max(1),
            chunk_units: 0,
            page_units: page_bytes.div_ceil(KV_UNIT_BYTES),
        }
    }

    /// The pages of a KV arena of this geometry; pages and chunks must start
    /// on whole units.
    pub fn of_arena(geo: &ChunkGeometry) -> Result<KvAddressing, String> {
        if !geo.page_bytes.get().is_multiple_of(KV_UNIT_BYTES)
            || !geo.chunk_bytes.get().is_multiple_of(KV_UNIT_BYTES)
        {
            return Err(format!(
                "KV arena pages of {} (chunks of {}) do not start on {KV_UNIT_BYTES}-byte units",
                geo.page_bytes, geo.chunk_bytes
            ));
        }
        Ok(KvAddressing {
            chunk_pages: geo.chunk_pages,
            chunk_units: geo.chunk_bytes.get() / KV_UNIT_BYTES,
            page_units: geo.page_bytes.get() / KV_UNIT_BYTES,
        })
    }

    /// The page table entry of `page`.
    pub fn unit(&self, page: PageId) -> u64 {
        let p = page.index();
        (p / self.chunk_pages) as u64 * self.chunk_units + (p % self.chunk_pages) as u64 * self.page_units
    }

    /// Bytes from the store's base to the start of `page`.
    pub fn offset(&self, page: PageId) -> u64 {
        self.unit(page) * KV_UNIT_BYTES
    }

    /// Bytes a store of `num_pages` pages spans: to the end of its last page.
    pub fn span(&self, num_pages: usize) -> u64 {
        match num_pages {
            0 => 0,
            n => (self.unit(PageId(n as u32 - 1)) + self.page_units) * KV_UNIT_BYTES,
        }
    }

    /// Refuse a store whose last page a u32 entry cannot address.
    pub fn check(&self, num_pages: usize) -> Result<(), String> {
        let last = self.unit(PageId(num_pages.saturating_sub(1) as u32));
        if last > u32::MAX as u64 {
            return Err(format!(
                "a KV store of {num_pages} pages spans more than {} GiB",
                (u32::MAX as u64 * KV_UNIT_BYTES) >> 30
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use corridor_units::{Bytes, Pages};

    /// The unit of every page is where the arena itself puts the page,
    /// chunks with a gap at their end included.
    #[test]
    fn arena_units_match_the_arena_offsets() {
        let gran = Bytes::mib(2);
        for page_bytes in [
            Bytes::mib(2),        // Llama-3-8B: one page a chunk
            Bytes(368_640),       // SmolLM2-135M: 5 pages a 2 MiB chunk, 253,952 bytes of gap
            Bytes(4096),          // tiny checkpoints: exact chunks of many pages
            Bytes(3 * 256 * 129), // pages that never fill a granule exactly
        ] {
            for target in [gran, Bytes::mib(8)] {
                let geo = ChunkGeometry::new(page_bytes, gran, target).unwrap();
                let addr = KvAddressing::of_arena(&geo).unwrap();
                for p in 0..(4 * geo.chunk_pages + 3) as u32 {
                    let id = PageId(p);
                    assert_eq!(addr.offset(id), geo.page_offset(id).get(), "{page_bytes} page {p}");
                }
                assert!(geo.chunks_in(Pages(geo.chunk_pages)) == 1);
            }
        }
    }

    #[test]
    fn contiguous_pages_start_on_whole_units() {
        let addr = KvAddressing::contiguous(16 * 16 * 2, 10); // 512 bytes: two units a page
        assert_eq!(addr.unit(PageId(3)), 6);
        let padded = KvAddressing::contiguous(300, 10); // rounds up to two units
        assert_eq!(padded.offset(PageId(4)), 4 * 512);
        assert_eq!(KvAddressing::IDENTITY.unit(PageId(77)), 77);
        // A buffer of `span` bytes holds every page, and no more.
        assert_eq!(addr.span(10), 10 * 512);
        assert_eq!(KvAddressing::contiguous(300, 1).span(1), 512);
        assert_eq!(addr.span(0), 0);
    }

    #[test]
    fn unaddressable_or_misaligned_stores_are_refused() {
        let huge = KvAddressing::contiguous(Bytes::mib(2).get(), 1 << 22); // 8 TiB of pages
        assert!(huge.check(1 << 22).is_err());
        assert!(huge.check(1 << 10).is_ok());
        let geo = ChunkGeometry::new(Bytes(1000), Bytes::mib(2), Bytes::mib(2)).unwrap();
        assert!(KvAddressing::of_arena(&geo).is_err());
    }
}
