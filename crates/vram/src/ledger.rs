//! The ledger (DESIGN.md §3.5): the plan for every card, with provenance,
//! and its reconciliation against what the flight recorder measured.
//!
//! Before allocating, the boot writes per-card posts (weights, workspace,
//! graphs, residue, KV, floor), each saying where its number comes from:
//! `Modeled` (a formula of config inputs, which it lists), `Measured` (read
//! at a mark of this boot) or `Declared` (a budget someone set). A card
//! fits when its resident posts plus the floor fit in what the driver
//! offers; an unbounded transient is reported beside the verdict, never
//! folded into it. Reconciliation prints each post's error and whatever no
//! post claims as its own residuum row, plus the drift of the identity
//! `total = carve_out + foreign + residue + books + free`.

use crate::recorder::Mark;
use corridor_units::{Bytes, CardId};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Where a post's number comes from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "provenance", rename_all = "snake_case")]
pub enum Provenance {
    /// A formula of config inputs: `(name, value)` for each input.
    Modeled { inputs: Vec<(String, String)> },
    /// Read at a mark of this boot.
    Measured { mark: String },
    /// A number someone set (a budget, a co-tenant's share).
    Declared { by: String },
}

/// What a post stands for. Each kind is measured from its own column of a
/// mark, so a number is never credited to a neighbour.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PostKind {
    Weights,
    Workspace,
    Graphs,
    /// Recurrent-state slots of a hybrid model.
    State,
    /// What the driver charges us beyond our books (context, library workspaces).
    Residue,
    Kv,
    /// Staging and other booked bytes.
    Other,
    /// The corridor floor: planned free memory, judged against measured free.
    Floor,
}

impl PostKind {
    pub fn name(self) -> &'static str {
        match self {
            PostKind::Weights => "weights",
            PostKind::Workspace => "workspace",
            PostKind::Graphs => "graphs",
            PostKind::State => "state",
            PostKind::Residue => "residue",
            PostKind::Kv => "kv",
            PostKind::Other => "other",
            PostKind::Floor => "floor",
        }
    }

    /// The measured value of this post at `mark` (free memory for the floor).
    fn measured(self, mark: &Mark) -> i64 {
        let b = &mark.books;
        match self {
            PostKind::Weights => signed(b.weights),
            PostKind::Workspace => signed(b.workspace),
            PostKind::Graphs => signed(b.graphs),
            PostKind::State => signed(b.state),
            PostKind::Kv => signed(b.kv_committed),
            PostKind::Other => signed(b.staging + b.other),
            PostKind::Residue => signed(mark.self_bytes) - signed(b.total()),
            PostKind::Floor => signed(mark.free_bytes),
        }
    }
}

fn signed(b: Bytes) -> i64 {
    i64::try_from(b.get()).unwrap_or(i64::MAX)
}

/// One planned number.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Post {
    pub kind: PostKind,
    pub bytes: Bytes,
    #[serde(flatten)]
    pub provenance: Provenance,
}

/// Something that comes and goes; `None` bytes means unbounded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Transient {
    pub name: String,
    pub bytes: Option<Bytes>,
}

/// One card's plan.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CardLedger {
    pub card: CardId,
    pub total: Bytes,
    pub carve_out: Bytes,
    /// Foreign bytes seen when the plan was made.
    pub foreign: Bytes,
    pub posts: Vec<Post>,
    pub transients: Vec<Transient>,
}

/// Whether a card's plan fits.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verdict {
    pub card: CardId,
    pub fits: bool,
    /// Resident posts (everything but the floor).
    pub resident: Bytes,
    pub floor: Bytes,
    /// What the card offers: total minus carve-out minus foreign.
    pub available: Bytes,
    /// Bounded transients, added to the check.
    pub transient: Bytes,
    /// Transients without a bound, reported beside the verdict.
    pub unbounded: Vec<String>,
}

impl CardLedger {
    pub fn new(card: CardId, total: Bytes, carve_out: Bytes, foreign: Bytes) -> CardLedger {
        CardLedger { card, total, carve_out, foreign, posts: Vec::new(), transients: Vec::new() }
    }

    pub fn post(&mut self, kind: PostKind, bytes: Bytes, provenance: Provenance) -> &mut Self {
        self.posts.push(Post { kind, bytes, provenance });
        self
    }

    pub fn transient(&mut self, name: &str, bytes: Option<Bytes>) -> &mut Self {
        self.transients.push(Transient { name: name.to_string(), bytes });
        self
    }

    /// Does the plan fit the card?
    pub fn fits(&self) -> Verdict {
        let floor: Bytes = self.posts.iter().filter(|p| p.kind == PostKind::Floor).map(|p| p.bytes).sum();
        let resident: Bytes = self.posts.iter().filter(|p| p.kind != PostKind::Floor).map(|p| p.bytes).sum();
        let transient: Bytes = self.transients.iter().filter_map(|t| t.bytes).sum();
        let unbounded: Vec<String> =
            self.transients.iter().filter(|t| t.bytes.is_none()).map(|t| t.name.clone()).collect();
        let available = self.total.saturating_sub(self.carve_out + self.foreign);
        Verdict {
            card: self.card,
            fits: resident + floor + transient <= available,
            resident,
            floor,
            available,
            transient,
            unbounded,
        }
    }

    /// Compare the plan with a mark of the same card.
    pub fn reconcile(&self, mark: &Mark) -> Reconciliation {
        let mut rows = Vec::new();
        let mut claimed = 0i64;
        for p in &self.posts {
            let measured = p.kind.measured(mark);
            if p.kind != PostKind::Floor {
                claimed += measured;
            }
            rows.push(ReconRow {
                name: p.kind.name().to_string(),
                planned: signed(p.bytes),
                measured,
                error: measured - signed(p.bytes),
            });
        }
        let foreign = mark.foreign_bytes();
        // What our process holds on the card by the driver's column: the
        // part no post claims stays its own row.
        let ours = signed(mark.total_bytes)
            - signed(mark.carve_out_bytes)
            - signed(foreign)
            - signed(mark.free_bytes);
        let residuum = ours - claimed;
        let books = signed(mark.books.total());
        let residue = signed(mark.self_bytes) - books;
        let drift = signed(mark.total_bytes)
            - (signed(mark.carve_out_bytes) + signed(foreign) + residue + books + signed(mark.free_bytes));
        Reconciliation { card: self.card, rows, residuum, drift }
    }
}

/// One post against its measurement.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReconRow {
    pub name: String,
    pub planned: i64,
    pub measured: i64,
    /// `measured - planned`.
    pub error: i64,
}

/// A card's plan against a mark.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reconciliation {
    pub card: CardId,
    pub rows: Vec<ReconRow>,
    /// Bytes our process holds that no post claims.
    pub residuum: i64,
    /// `total - (carve_out + foreign + residue + books + free)`.
    pub drift: i64,
}

fn mib(v: i64) -> f64 {
    v as f64 / Bytes::MIB as f64
}

impl fmt::Display for Reconciliation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{}: {:<10} {:>12} {:>12} {:>12}",
            self.card, "post", "planned MiB", "measured MiB", "error MiB"
        )?;
        for r in &self.rows {
            writeln!(
                f,
                "{}: {:<10} {:>12.1} {:>12.1} {:>+12.1}",
                self.card,
                r.name,
                mib(r.planned),
                mib(r.measured),
                mib(r.error)
            )?;
        }
        writeln!(
            f,
            "{}: {:<10} {:>12} {:>12.1} {:>12}",
            self.card,
            "residuum",
            "-",
            mib(self.residuum),
            "-"
        )?;
        writeln!(f, "{}: {:<10} {:>12} {:>12.1} {:>12}", self.card, "drift", "-", mib(self.drift), "-")
    }
}

/// The whole plan.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ledger {
    pub cards: Vec<CardLedger>,
}

impl Ledger {
    pub fn fits(&self) -> Vec<Verdict> {
        self.cards.iter().map(|c| c.fits()).collect()
    }

    /// Reconcile each card with its mark in `marks` (same card id); cards
    /// without a mark are left out.
    pub fn reconcile(&self, marks: &[Mark]) -> Vec<Reconciliation> {
        self.cards
            .iter()
            .filter_map(|c| marks.iter().rev().find(|m| m.card == c.card).map(|m| c.reconcile(m)))
            .collect()
    }
}
