//! Sizing (DESIGN.md §3.4): how many KV pages each card commits.
//!
//! Solved per card, once weights, workspace and graphs are resident, from
//! the measured free column:
//! `pages = whole chunks of (free - floor - margin - reserve)`, also bounded
//! by what the card budget still allows and by the arena's address space.
//! A big card is never held to a small card's capacity. One log line per
//! card names the inputs and which one bound the answer.

use crate::arena::ChunkGeometry;
use crate::device::Device;
use corridor_units::{Bytes, CardId, Pages};
use serde::Serialize;

/// The default error bar kept above the floor after sizing.
pub const DEFAULT_MARGIN: Bytes = Bytes::mib(64);

/// The inputs of one card's solve.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct SizingInput {
    pub card: CardId,
    /// Driver free memory, measured with everything else resident.
    pub free: Bytes,
    /// The floor the guard arms at (the law floor plus any arming margin).
    pub floor: Bytes,
    /// A small measured error bar.
    pub margin: Bytes,
    /// What is known to come later (a draft model, a layout change's staging).
    pub reserve: Bytes,
    /// What the card budget still allows us to take (`None`: no budget).
    pub budget_room: Option<Bytes>,
    pub geometry: ChunkGeometry,
    /// The arena's id space.
    pub max_pages: Pages,
}

impl SizingInput {
    /// Measure `device` now.
    pub fn measure(
        device: &Device,
        margin: Bytes,
        reserve: Bytes,
        geometry: ChunkGeometry,
        max_pages: Pages,
    ) -> SizingInput {
        let s = device.settings();
        let books = device.books().total();
        SizingInput {
            card: device.id(),
            free: device.card().driver_free(),
            floor: s.arming_floor(),
            margin,
            reserve,
            budget_room: s.budget.map(|b| b.saturating_sub(books)),
            geometry,
            max_pages,
        }
    }
}

/// Which input bound the answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SizingBound {
    /// Free memory above floor + margin + reserve.
    FreeMemory,
    /// The card budget.
    Budget,
    /// The arena's address reservation.
    AddressSpace,
}

/// One card's answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Sizing {
    pub pages: Pages,
    pub chunks: usize,
    /// Physical bytes the pages take (whole chunks).
    pub bytes: Bytes,
    pub bound: SizingBound,
    pub input: SizingInput,
}

/// Solve one card.
pub fn solve(input: SizingInput) -> Sizing {
    let g = input.geometry;
    let by_free = input.free.saturating_sub(input.floor + input.margin + input.reserve);
    let (mut room, mut bound) = (by_free, SizingBound::FreeMemory);
    if let Some(budget_room) = input.budget_room {
        if budget_room < room {
            (room, bound) = (budget_room, SizingBound::Budget);
        }
    }
    let mut chunks = (room.get() / g.chunk_bytes.get()) as usize;
    let max_chunks = g.chunks_in(input.max_pages);
    if max_chunks < chunks {
        (chunks, bound) = (max_chunks, SizingBound::AddressSpace);
    }
    let sizing = Sizing {
        pages: Pages(chunks * g.chunk_pages),
        chunks,
        bytes: Bytes(chunks as u64 * g.chunk_bytes.get()),
        bound,
        input,
    };
    tracing::info!(
        card = %input.card,
        "KV sized: {} ({} chunks of {}) from free {} - floor {} - margin {} - reserve {}, budget room {}, address space {}; bound by {:?}",
        sizing.pages,
        chunks,
        g.chunk_bytes,
        input.free,
        input.floor,
        input.margin,
        input.reserve,
        input.budget_room.map_or("none".to_string(), |b| b.to_string()),
        input.max_pages,
        bound
    );
    sizing
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(free: Bytes) -> SizingInput {
        SizingInput {
            card: CardId(0),
            free,
            floor: Bytes::mib(1024),
            margin: Bytes::mib(64),
            reserve: Bytes::mib(100),
            budget_room: None,
            geometry: ChunkGeometry::new(Bytes(256 * Bytes::KIB), Bytes::mib(2), Bytes::mib(2)).unwrap(),
            max_pages: Pages(1 << 20),
        }
    }

    #[test]
    fn free_memory_bounds_and_rests_within_a_chunk() {
        let s = solve(input(Bytes::mib(5000) + Bytes(12345)));
        assert_eq!(s.bound, SizingBound::FreeMemory);
        // 5000 - 1024 - 64 - 100 = 3812 MiB -> 1906 chunks of 2 MiB, 8 pages each.
        assert_eq!(s.chunks, 1906);
        assert_eq!(s.pages, Pages(1906 * 8));
        let rest = Bytes::mib(5000) + Bytes(12345) - s.bytes;
        assert!(rest >= Bytes::mib(1024 + 64 + 100) && rest < Bytes::mib(1024 + 64 + 100 + 2));
    }

    #[test]
    fn budget_and_address_space_bind_when_smaller() {
        let s = solve(SizingInput { budget_room: Some(Bytes::mib(10)), ..input(Bytes::gib(10)) });
        assert_eq!((s.bound, s.chunks), (SizingBound::Budget, 5));
        let s = solve(SizingInput { max_pages: Pages(20), ..input(Bytes::gib(10)) });
        assert_eq!((s.bound, s.pages), (SizingBound::AddressSpace, Pages(16)));
        let s = solve(input(Bytes::mib(500)));
        assert_eq!(
            (s.bound, s.pages),
            (SizingBound::FreeMemory, Pages(0)),
            "no room is zero pages, not an underflow"
        );
    }
}
