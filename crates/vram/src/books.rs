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
    /// Recurrent state of a hybrid model's linear-attention layers: one
    /// fixed-size slot per running request, committed in chunks of slots by
    /// a state arena (sized with the KV at boot, released and regrown like
    /// it), or booked once where a backend keeps a fixed block.
    State,
    /// Committed KV pages (booked by the KV arena's commits).
    Kv,
    /// Temporary buffers of a layout change or a transfer.
    Staging,
    Other,
}

impl Purpose {
    pub const ALL: [Purpose; 7] = [
        Purpose::Weights,
        Purpose::Workspace,
        Purpose::Graphs,
        Purpose::State,
        Purpose::Kv,
        Purpose::Staging,
        Purpose::Other,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Purpose::Weights => "weights",
            Purpose::Workspace => "workspace",
            Purpose::Graphs => "graphs",
            Purpose::State => "state",
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
    /// Recurrent-state slots (a hybrid model's; zero for the others).
    #[serde(default)]
    pub state: Bytes,
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
        self.weights
            + self.workspace
            + self.graphs
            + self.state
            + self.kv_committed
            + self.staging
            + self.other
    }

    pub fn get(&self, purpose: Purpose) -> Bytes {
        match purpose {
            Purpose::Weights => self.weights,
            Purpose::Workspace => self.workspace,
            Purpose::Graphs => self.graphs,
            Purpose::State => self.state,
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
            Purpose::State => &mut self.state,
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
        *b.slot(Purpose::State) += Bytes::mib(2);
        b.kv_reserved = Bytes::gib(100);
        assert_eq!(b.total(), Bytes::mib(16));
        assert_eq!(b.get(Purpose::State), Bytes::mib(2));
        assert_eq!(b.get(Purpose::Kv), Bytes::mib(4));
        assert_eq!(Purpose::ALL.len(), 7);
    }
}
