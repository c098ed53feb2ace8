//! Our books: every byte corridor holds on a card, by purpose.

use corridor_units::Bytes;
use serde::{Deserialize, Serialize};
use std::fmt;

/// What a device allocation is for. Every allocation names one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Purpose {
    Weights,
    /// Activation workspace, sized once for the largest step.
    Workspace,
    /// Captured graph pools.
    Graphs,
    /// Committed KV pages (booked by the KV arena's commits).
    Kv,
    /// Temporary buffers of a layout change or a transfer.
    Staging,
    Other,
}

impl Purpose {
    pub const ALL: [Purpose; 6] = [
        Purpose::Weights,
        Purpose::Workspace,
        Purpose::Graphs,
        Purpose::Kv,
        Purpose::Staging,
        Purpose::Other,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Purpose::Weights => "weights",
            Purpose::Workspace => "workspace",
            Purpose::Graphs => "graphs",
            Purpose::Kv => "kv",
            Purpose::Staging => "staging",
            Purpose::Other => "other",
        }
    }
}

impl fmt::Display for Purpose {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A snapshot of one card's books.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Books {
    pub weights: Bytes,
    pub workspace: Bytes,
    pub graphs: Bytes,
    /// Physical memory committed under the KV reservation.
    pub kv_committed: Bytes,
    pub staging: Bytes,
    pub other: Bytes,
    /// Address space reserved for KV. Addresses only: not part of [`Books::total`].
    pub kv_reserved: Bytes,
}

impl Books {
    /// Physical bytes we hold (address reservations excluded).
    pub fn total(&self) -> Bytes {
        self.weights + self.workspace + self.graphs + self.kv_committed + self.staging + self.other
    }

    pub fn get(&self, purpose: Purpose) -> Bytes {
        match purpose {
            Purpose::Weights => self.weights,
            Purpose::Workspace => self.workspace,
            Purpose::Graphs => self.graphs,
            Purpose::Kv => self.kv_committed,
            Purpose::Staging => self.staging,
            Purpose::Other => self.other,
        }
    }

    pub(crate) fn slot(&mut self, purpose: Purpose) -> &mut Bytes {
        match purpose {
            Purpose::Weights => &mut self.weights,
            Purpose::Workspace => &mut self.workspace,
            Purpose::Graphs => &mut self.graphs,
            Purpose::Kv => &mut self.kv_committed,
            Purpose::Staging => &mut self.staging,
            Purpose::Other => &mut self.other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn total_excludes_reservations() {
        let mut b = Books::default();
        *b.slot(Purpose::Weights) += Bytes::mib(10);
        *b.slot(Purpose::Kv) += Bytes::mib(4);
        b.kv_reserved = Bytes::gib(100);
        assert_eq!(b.total(), Bytes::mib(14));
        assert_eq!(b.get(Purpose::Kv), Bytes::mib(4));
        assert_eq!(Purpose::ALL.len(), 6);
    }
}
