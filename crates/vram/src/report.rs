//! The `GET /v1/memory` body and its table for people.
//!
//! One [`CardReport`] per card: the driver's numbers, the floor and how it
//! held (minimum free, breaches, intrusions, the slowest restore), who else
//! is on the card, what our process holds beyond our books (residue), our
//! books by purpose, and the drift of the identity
//! `total = carve_out + foreign + residue + books + free`. The server
//! serializes it; Prometheus gauges are exported from the same struct.

use crate::books::Books;
use crate::card::{CardKind, ProcessBytes};
use crate::governor::Governor;
use corridor_units::{Bytes, CardId};
use serde::{Deserialize, Serialize};
use std::fmt::Write;

/// One card in the memory report. Byte fields are plain integers of bytes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CardReport {
    pub card: CardId,
    pub uuid: String,
    pub kind: CardKind,
    pub total_bytes: Bytes,
    pub carve_out_bytes: Bytes,
    pub free_bytes: Bytes,
    pub floor_bytes: Bytes,
    pub budget_bytes: Option<Bytes>,
    /// The lowest free memory any sample saw (the current reading before the
    /// first sample).
    pub min_free_bytes: Bytes,
    pub breaches: u64,
    pub intrusions: u64,
    pub restore_ms_max: Option<u64>,
    pub foreign_bytes: Bytes,
    /// Foreign processes by pid.
    pub foreign: Vec<ProcessBytes>,
    /// What the driver charges this process beyond our books (negative if
    /// the books claim more than the driver shows).
    pub residue_bytes: i64,
    /// `total - (carve_out + foreign + residue + books + free)`.
    pub drift_bytes: i64,
    pub books: Books,
}

/// The whole `GET /v1/memory` body.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryReport {
    pub cards: Vec<CardReport>,
    /// Max minus min free memory across cards.
    pub spread_bytes: Bytes,
}

fn signed(b: Bytes) -> i64 {
    i64::try_from(b.get()).unwrap_or(i64::MAX)
}

/// Build the report from the governor's devices and sampler.
pub fn build_report(gov: &Governor) -> MemoryReport {
    let mut cards = Vec::new();
    for dev in gov.devices() {
        let card = dev.card();
        // Read the driver in one go so the identity is judged on one instant.
        let (total, carve, free, me, processes) =
            (card.total(), card.carve_out(), card.driver_free(), card.process_bytes(), card.processes());
        let books = dev.books();
        let pid = card.self_pid();
        let foreign: Vec<ProcessBytes> = processes.into_iter().filter(|p| p.pid != pid).collect();
        let foreign_bytes: Bytes = if card.names_every_holder() {
            foreign.iter().map(|p| p.bytes).sum()
        } else {
            // The host: whatever is used and not by this process (other
            // processes, the kernel, caches it will not give back).
            total.saturating_sub(carve).saturating_sub(free).saturating_sub(me)
        };
        let residue = signed(me) - signed(books.total());
        let drift = signed(total)
            - (signed(carve) + signed(foreign_bytes) + residue + signed(books.total()) + signed(free));
        let stats = gov.sampler().stats(dev.id()).unwrap_or_default();
        let s = dev.settings();
        cards.push(CardReport {
            card: dev.id(),
            uuid: card.uuid(),
            kind: card.kind(),
            total_bytes: total,
            carve_out_bytes: carve,
            free_bytes: free,
            floor_bytes: s.floor,
            budget_bytes: s.budget,
            min_free_bytes: stats.min_free.map_or(free, |m| m.min(free)),
            breaches: stats.breaches,
            intrusions: stats.intrusions,
            restore_ms_max: stats.restore_ms_max,
            foreign_bytes,
            foreign,
            residue_bytes: residue,
            drift_bytes: drift,
            books,
        });
    }
    let spread_bytes =
        match (cards.iter().map(|c| c.free_bytes).min(), cards.iter().map(|c| c.free_bytes).max()) {
            (Some(lo), Some(hi)) => hi - lo,
            _ => Bytes::ZERO,
        };
    MemoryReport { cards, spread_bytes }
}

/// What each column of [`render_table`] means; `corridor memory --help`
/// shows it too.
pub const LEGEND: &str = "\
Columns (sizes in MiB; per card, read at one instant):
  total      all memory on the card (the host: MemTotal)
  free       what the driver says is free now (the host: MemAvailable)
  floor      free memory corridor keeps at every instant (--floor-mib)
  min free   the lowest free memory any 100 ms sample saw
  breach     samples that saw free below the floor
  intru      times another process grew into the floor
  restore    the slowest return above the floor after an intrusion
  foreign    memory other processes hold (the host: everything used but not by corridor)
  residue    what corridor's process holds beyond its books: runtime, code, libraries
             (negative means the books claim memory the process does not hold)
  weights, workspace, graphs, state, kv, other
             corridor's books by purpose: model weights, the activation workspace, captured
             CUDA graphs, a hybrid model's recurrent-state slots, KV pages committed, staging
             and other buffers
  kv resv    KV address space reserved (addresses only: not memory, not in the books)
  drift      total - (carve-out + foreign + residue + books + free), the carve-out being
             what the driver keeps for itself: memory nobody accounts for; near 0 when the
             table adds up (on the host foreign is measured as the rest, so drift is only
             what changed between the readings, and residue is the check that matters)
";

fn mib(b: Bytes) -> String {
    format!("{:.0}", b.as_mib_f64())
}

fn mib_signed(v: i64) -> String {
    format!("{:.0}", v as f64 / Bytes::MIB as f64)
}

/// A table a person reads at a glance (all sizes in MiB).
pub fn render_table(report: &MemoryReport) -> String {
    let mut out = String::new();
    let header = [
        "card",
        "total",
        "free",
        "floor",
        "min free",
        "breach",
        "intru",
        "restore",
        "foreign",
        "residue",
        "weights",
        "workspace",
        "graphs",
        "state",
        "kv",
        "kv resv",
        "other",
        "drift",
    ];
    let mut rows: Vec<Vec<String>> = vec![header.iter().map(|h| h.to_string()).collect()];
    for c in &report.cards {
        let b = &c.books;
        rows.push(vec![
            c.card.to_string(),
            mib(c.total_bytes),
            mib(c.free_bytes),
            mib(c.floor_bytes),
            mib(c.min_free_bytes),
            c.breaches.to_string(),
            c.intrusions.to_string(),
            c.restore_ms_max.map_or("-".to_string(), |ms| format!("{ms}ms")),
            mib(c.foreign_bytes),
            mib_signed(c.residue_bytes),
            mib(b.weights),
            mib(b.workspace),
            mib(b.graphs),
            mib(b.state),
            mib(b.kv_committed),
            mib(b.kv_reserved),
            mib(b.staging + b.other),
            mib_signed(c.drift_bytes),
        ]);
    }
    let widths: Vec<usize> =
        (0..header.len()).map(|i| rows.iter().map(|r| r[i].len()).max().unwrap_or(0)).collect();
    for row in &rows {
        let cells: Vec<String> = row.iter().zip(&widths).map(|(cell, w)| format!("{cell:>w$}")).collect();
        let _ = writeln!(out, "{}", cells.join("  ").trim_end());
    }
    let _ = writeln!(out, "sizes in MiB; spread {} MiB", mib(report.spread_bytes));
    for c in &report.cards {
        for p in &c.foreign {
            let _ = writeln!(out, "{}: foreign pid {} holds {} MiB", c.card, p.pid, mib(p.bytes));
        }
    }
    out.push('\n');
    out.push_str(LEGEND);
    out
}
