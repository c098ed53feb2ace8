//! The flight recorder (DESIGN.md §3.5): append-only JSONL marks per process.
//!
//! Boot marks are written at named phases, serving marks at a pace (every
//! 30 s by default) into a separate file. Each mark is one line per card:
//! the boot id shared by every process of one launch, pid, rank, card UUID,
//! wall and monotonic time, the driver's free and total, this pid's bytes,
//! the per-process list (so a foreign process is named by pid) and our books
//! by purpose. Readers group by boot id and pid, never difference two boots,
//! and tolerate a torn last line (a process killed mid-write).

use crate::books::Books;
use crate::card::ProcessBytes;
use crate::clock::Clock;
use crate::device::{lock, Device};
use corridor_units::{Bytes, CardId, Rank};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The boot phases, in the order a boot passes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BootPhase {
    ProcessStart,
    ContextReady,
    WeightsLoaded,
    WorkspaceReady,
    GraphsCaptured,
    KvSized,
    BootComplete,
    FirstForward,
}

impl BootPhase {
    pub const ALL: [BootPhase; 8] = [
        BootPhase::ProcessStart,
        BootPhase::ContextReady,
        BootPhase::WeightsLoaded,
        BootPhase::WorkspaceReady,
        BootPhase::GraphsCaptured,
        BootPhase::KvSized,
        BootPhase::BootComplete,
        BootPhase::FirstForward,
    ];
}

/// Whether a mark was taken at a boot phase or while serving.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "phase", rename_all = "snake_case")]
pub enum MarkKind {
    Boot(BootPhase),
    Serving,
    /// Taken when a group flipped between its layouts, or tried to: the
    /// mark's `flip` says how it went.
    Flip,
}

/// A phase flip as the recorder keeps it: which way, what it carried, how
/// long it took, or why it was abandoned.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlipEvent {
    pub from: String,
    pub to: String,
    pub committed: bool,
    /// Why it was abandoned (`None` when it committed).
    pub reason: Option<String>,
    /// KV bytes that crossed between ranks, and those copied within a rank.
    pub bytes_moved: Bytes,
    pub bytes_local: Bytes,
    pub pages: u64,
    /// Requests running when it happened (carried into the new layout).
    pub requests: u64,
    pub duration_us: u64,
    /// The most staging one rank reserved.
    pub staging: Bytes,
    pub epoch: u64,
}

/// The id every process of one launch shares: `{launcher pid}-{wall ms}`.
/// The launcher makes it once and hands it to its children as a flag.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct BootId(pub String);

impl BootId {
    pub fn new(launcher_pid: u32, wall_unix_ms: u64) -> BootId {
        BootId(format!("{launcher_pid}-{wall_unix_ms}"))
    }
}

impl std::fmt::Display for BootId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// One card's state at one instant.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mark {
    #[serde(flatten)]
    pub kind: MarkKind,
    pub boot_id: BootId,
    pub pid: u32,
    pub rank: Option<Rank>,
    pub card: CardId,
    pub card_uuid: String,
    pub wall_ms: u64,
    pub mono_ms: u64,
    pub total_bytes: Bytes,
    pub carve_out_bytes: Bytes,
    pub free_bytes: Bytes,
    /// Bytes the driver charges this pid.
    pub self_bytes: Bytes,
    /// Every process on the card, this one included.
    pub processes: Vec<ProcessBytes>,
    pub books: Books,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flip: Option<FlipEvent>,
}

impl Mark {
    /// Read `device` now.
    pub fn capture(kind: MarkKind, device: &Device, ident: &MarkIdentity, clock: &dyn Clock) -> Mark {
        let card = device.card();
        Mark {
            kind,
            boot_id: ident.boot_id.clone(),
            pid: card.self_pid(),
            rank: ident.rank,
            card: card.id(),
            card_uuid: card.uuid(),
            wall_ms: clock.wall_unix_ms(),
            mono_ms: clock.now().as_millis() as u64,
            total_bytes: card.total(),
            carve_out_bytes: card.carve_out(),
            free_bytes: card.driver_free(),
            self_bytes: card.process_bytes(),
            processes: card.processes(),
            books: device.books(),
            flip: None,
        }
    }

    /// The processes on the card other than the one that wrote the mark.
    pub fn foreign(&self) -> Vec<ProcessBytes> {
        self.processes.iter().copied().filter(|p| p.pid != self.pid).collect()
    }

    pub fn foreign_bytes(&self) -> Bytes {
        self.foreign().iter().map(|p| p.bytes).sum()
    }
}

/// Who writes the marks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MarkIdentity {
    pub boot_id: BootId,
    pub rank: Option<Rank>,
}

/// Errors of writing or reading marks.
#[derive(Debug, thiserror::Error)]
pub enum RecorderError {
    #[error("flight recorder: {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("flight recorder: {path} line {line}: {reason}")]
    BadLine { path: PathBuf, line: usize, reason: String },
}

/// The writer of one process's marks.
pub struct FlightRecorder {
    ident: MarkIdentity,
    clock: Arc<dyn Clock>,
    boot: Mutex<(PathBuf, File)>,
    serving: Mutex<(PathBuf, File)>,
    serving_interval: Duration,
    last_serving: Mutex<Option<Duration>>,
}

fn open_append(path: PathBuf) -> Result<(PathBuf, File), RecorderError> {
    match OpenOptions::new().create(true).append(true).open(&path) {
        Ok(f) => Ok((path, f)),
        Err(source) => Err(RecorderError::Io { path, source }),
    }
}

impl FlightRecorder {
    /// Open (or create) this process's files in `dir`:
    /// `flight_boot_pid{pid}.jsonl` and `flight_serving_pid{pid}.jsonl`.
    pub fn open(
        dir: &Path,
        ident: MarkIdentity,
        serving_interval: Duration,
        clock: Arc<dyn Clock>,
    ) -> Result<FlightRecorder, RecorderError> {
        std::fs::create_dir_all(dir)
            .map_err(|source| RecorderError::Io { path: dir.to_path_buf(), source })?;
        let pid = std::process::id();
        Ok(FlightRecorder {
            ident,
            clock,
            boot: Mutex::new(open_append(dir.join(format!("flight_boot_pid{pid}.jsonl")))?),
            serving: Mutex::new(open_append(dir.join(format!("flight_serving_pid{pid}.jsonl")))?),
            serving_interval,
            last_serving: Mutex::new(None),
        })
    }

    /// Write a boot mark for every device.
    pub fn boot_mark(&self, phase: BootPhase, devices: &[Device]) -> Result<Vec<Mark>, RecorderError> {
        self.write(&self.boot, MarkKind::Boot(phase), devices)
    }

    /// Write a serving mark for every device now.
    pub fn serving_mark(&self, devices: &[Device]) -> Result<Vec<Mark>, RecorderError> {
        *lock(&self.last_serving) = Some(self.clock.now());
        self.write(&self.serving, MarkKind::Serving, devices)
    }

    /// Write a flip mark for every device (into the serving file).
    pub fn flip_mark(&self, event: &FlipEvent, devices: &[Device]) -> Result<Vec<Mark>, RecorderError> {
        self.write_with(&self.serving, MarkKind::Flip, devices, Some(event))
    }

    /// Write a serving mark if the pace says one is due.
    pub fn serving_mark_if_due(&self, devices: &[Device]) -> Result<Option<Vec<Mark>>, RecorderError> {
        let due = lock(&self.last_serving)
            .is_none_or(|t| self.clock.now().saturating_sub(t) >= self.serving_interval);
        if due {
            return self.serving_mark(devices).map(Some);
        }
        Ok(None)
    }

    fn write(
        &self,
        file: &Mutex<(PathBuf, File)>,
        kind: MarkKind,
        devices: &[Device],
    ) -> Result<Vec<Mark>, RecorderError> {
        self.write_with(file, kind, devices, None)
    }

    fn write_with(
        &self,
        file: &Mutex<(PathBuf, File)>,
        kind: MarkKind,
        devices: &[Device],
        flip: Option<&FlipEvent>,
    ) -> Result<Vec<Mark>, RecorderError> {
        let marks: Vec<Mark> = devices
            .iter()
            .map(|d| Mark { flip: flip.cloned(), ..Mark::capture(kind, d, &self.ident, self.clock.as_ref()) })
            .collect();
        let mut text = String::new();
        for m in &marks {
            // Serializing a plain struct of numbers and strings cannot fail.
            text.push_str(&serde_json::to_string(m).unwrap_or_default());
            text.push('\n');
        }
        let mut guard = lock(file);
        let (path, f) = &mut *guard;
        // One write per mark set keeps a crash from interleaving half lines.
        f.write_all(text.as_bytes())
            .and_then(|_| f.flush())
            .map_err(|source| RecorderError::Io { path: path.clone(), source })?;
        Ok(marks)
    }
}

/// The marks of one file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MarkFile {
    pub marks: Vec<Mark>,
    /// The last line was cut short (the writer died mid-line) and was skipped.
    pub torn_tail: bool,
}

/// Parse marks; an unparsable last line without a newline is a torn tail
/// and is skipped, any other bad line is an error.
pub fn parse_marks(path: &Path, text: &str) -> Result<MarkFile, RecorderError> {
    let mut out = MarkFile::default();
    let ends_clean = text.ends_with('\n');
    let lines: Vec<&str> = text.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<Mark>(line) {
            Ok(m) => out.marks.push(m),
            Err(_) if i + 1 == lines.len() && !ends_clean => out.torn_tail = true,
            Err(e) => {
                return Err(RecorderError::BadLine {
                    path: path.to_path_buf(),
                    line: i + 1,
                    reason: e.to_string(),
                });
            }
        }
    }
    Ok(out)
}

/// Read one marks file.
pub fn read_marks(path: &Path) -> Result<MarkFile, RecorderError> {
    let text = std::fs::read_to_string(path)
        .map_err(|source| RecorderError::Io { path: path.to_path_buf(), source })?;
    parse_marks(path, &text)
}

/// Read every `flight_*.jsonl` file in `dir`.
pub fn read_dir(dir: &Path) -> Result<Vec<Mark>, RecorderError> {
    let entries =
        std::fs::read_dir(dir).map_err(|source| RecorderError::Io { path: dir.to_path_buf(), source })?;
    let mut paths: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("flight_") && n.ends_with(".jsonl"))
        })
        .collect();
    paths.sort();
    let mut marks = Vec::new();
    for p in paths {
        marks.extend(read_marks(&p)?.marks);
    }
    Ok(marks)
}

/// Marks grouped by (boot id, pid), each group in time order.
pub fn group_by_boot_and_pid(marks: &[Mark]) -> BTreeMap<(BootId, u32), Vec<Mark>> {
    let mut groups: BTreeMap<(BootId, u32), Vec<Mark>> = BTreeMap::new();
    for m in marks {
        groups.entry((m.boot_id.clone(), m.pid)).or_default().push(m.clone());
    }
    for g in groups.values_mut() {
        g.sort_by_key(|m| (m.mono_ms, m.card));
    }
    groups
}

/// The boot whose newest mark is the newest of all.
pub fn latest_boot(marks: &[Mark]) -> Option<BootId> {
    marks.iter().max_by_key(|m| m.wall_ms).map(|m| m.boot_id.clone())
}

/// The last boot mark of `phase` for `card` in one boot.
pub fn boot_mark_of(marks: &[Mark], boot: &BootId, card: CardId, phase: BootPhase) -> Option<Mark> {
    marks.iter().rfind(|m| &m.boot_id == boot && m.card == card && m.kind == MarkKind::Boot(phase)).cloned()
}
