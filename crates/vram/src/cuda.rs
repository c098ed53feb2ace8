//! The CUDA card: one GPU's memory, measured by the driver and NVML and taken
//! only through this crate's chokepoint.
//!
//! The numbers follow the memory model (DESIGN.md §3):
//! - `total` is NVML's total, all memory on the board;
//! - `carve_out` is NVML's total minus the driver's (`cuMemGetInfo`) total,
//!   what the driver keeps for itself (615 MiB on an H200);
//! - `driver_free` is `cuMemGetInfo`'s free, read every time and never
//!   computed as total minus used;
//! - the per-process list and our own bytes come from NVML, so a foreign
//!   process is named by its pid.
//!
//! Plain allocations are `cuMemAlloc`/`cuMemFree`; the KV arena's address
//! reservation and its chunked residency use the virtual memory calls
//! (`cuMemAddressReserve`, `cuMemCreate` + `cuMemMap` + `cuMemSetAccess` per
//! commit, `cuMemUnmap` + `cuMemRelease` per decommit), so addresses never
//! move while physical memory comes and goes underneath them.
//!
//! Device selection (`cuda`, `cuda:0,1`, `cuda:GPU-<uuid>`) and the table of
//! commits under each reservation are plain code that compiles without the
//! `cuda` feature, so CPU-only CI tests them; [`CudaCard`] itself needs the
//! feature. The libraries are loaded at run time: a missing one is a
//! [`CudaError::MissingLibrary`] naming it, checked before cudarc is touched,
//! because cudarc panics on a library it cannot load.

use crate::card::ProcessBytes;
use corridor_units::Bytes;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::str::FromStr;

#[cfg(feature = "cuda")]
pub use driver::{driver_library_present, ordinal_uuid, CudaCard, PinnedHost};

/// Why a CUDA card could not be selected or opened.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    #[error("'{text}' is not a CUDA device list: {reason} (expected cuda, cuda:0,1 or cuda:GPU-<uuid>)")]
    BadSelection { text: String, reason: String },
    #[error(
        "{library} could not be loaded: {detail} (searched by its usual names on LD_LIBRARY_PATH and the loader cache)"
    )]
    MissingLibrary { library: &'static str, detail: String },
    #[error("this build has no CUDA support (build with the `cuda` feature) and cannot open {selection}")]
    NotBuilt { selection: String },
    #[error("cuda:{ordinal} does not exist: {count} CUDA devices are visible")]
    NoSuchOrdinal { ordinal: u32, count: usize },
    #[error("no visible CUDA device has a UUID starting with {uuid} (visible: {visible})")]
    UnknownUuid { uuid: String, visible: String },
    #[error("{uuid} matches more than one device: {matches}")]
    AmbiguousUuid { uuid: String, matches: String },
    #[error("{device} is selected twice (as {first} and {second})")]
    Duplicate { device: String, first: String, second: String },
    #[error("cuda:{ordinal}: {op} failed: {reason}")]
    Driver { ordinal: u32, op: &'static str, reason: String },
    #[error("{uuid}: NVML {op} failed: {reason}")]
    Nvml { uuid: String, op: &'static str, reason: String },
}

/// One device named in a selection.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum CudaDeviceRef {
    /// A CUDA ordinal, as `CUDA_VISIBLE_DEVICES` leaves them numbered.
    Ordinal(u32),
    /// A GPU UUID (`GPU-…`, lower case), or a unique prefix of one.
    Uuid(String),
}

impl fmt::Display for CudaDeviceRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CudaDeviceRef::Ordinal(o) => write!(f, "cuda:{o}"),
            CudaDeviceRef::Uuid(u) => write!(f, "cuda:{u}"),
        }
    }
}

/// Which CUDA devices to open, parsed once from the `--devices` text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CudaSelection {
    /// `cuda` or `cuda:all`: every visible device, in ordinal order.
    All,
    /// `cuda:0,1`, `cuda:GPU-…` or a mix; card ids follow this order.
    Devices(Vec<CudaDeviceRef>),
}

impl CudaSelection {
    /// Parse `cuda`, `cuda:all`, `cuda:0,1` or `cuda:GPU-<uuid>[,...]`.
    pub fn parse(text: &str) -> Result<CudaSelection, CudaError> {
        let bad =
            |reason: &str| CudaError::BadSelection { text: text.to_string(), reason: reason.to_string() };
        let t = text.trim();
        let rest = match t.split_once(':') {
            None if t.eq_ignore_ascii_case("cuda") => return Ok(CudaSelection::All),
            Some((scheme, rest)) if scheme.eq_ignore_ascii_case("cuda") => rest.trim(),
            _ => return Err(bad("it does not start with 'cuda'")),
        };
        if rest.eq_ignore_ascii_case("all") {
            return Ok(CudaSelection::All);
        }
        if rest.is_empty() {
            return Err(bad("no device after 'cuda:'"));
        }
        let mut devices = Vec::new();
        for item in rest.split(',').map(str::trim) {
            let device = if !item.is_empty() && item.bytes().all(|b| b.is_ascii_digit()) {
                CudaDeviceRef::Ordinal(
                    item.parse().map_err(|_| bad(&format!("ordinal {item} is too large")))?,
                )
            } else if item.len() > 4 && item[..4].eq_ignore_ascii_case("GPU-") {
                let hex = &item[4..];
                if !hex.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-') {
                    return Err(bad(&format!("{item} is not a GPU UUID")));
                }
                CudaDeviceRef::Uuid(format!("GPU-{}", hex.to_ascii_lowercase()))
            } else if item.len() >= 4 && item[..4].eq_ignore_ascii_case("MIG-") {
                return Err(bad("MIG instances are not supported"));
            } else {
                return Err(bad(&format!("'{item}' is neither an ordinal nor a GPU-<uuid>")));
            };
            if devices.contains(&device) {
                return Err(bad(&format!("{device} is listed twice")));
            }
            devices.push(device);
        }
        Ok(CudaSelection::Devices(devices))
    }

    /// The CUDA ordinals this selection names, given the UUID of every
    /// visible device in ordinal order. A UUID may be a unique prefix; two
    /// names for one device are rejected, since one card opened twice would
    /// have its memory governed by two books.
    pub fn resolve(&self, visible: &[String]) -> Result<Vec<u32>, CudaError> {
        let wanted = match self {
            CudaSelection::All => return Ok((0..visible.len() as u32).collect()),
            CudaSelection::Devices(d) => d,
        };
        let mut out: Vec<(u32, &CudaDeviceRef)> = Vec::new();
        for device in wanted {
            let ordinal = match device {
                CudaDeviceRef::Ordinal(o) => {
                    if *o as usize >= visible.len() {
                        return Err(CudaError::NoSuchOrdinal { ordinal: *o, count: visible.len() });
                    }
                    *o
                }
                CudaDeviceRef::Uuid(prefix) => {
                    let hits: Vec<usize> = (0..visible.len())
                        .filter(|&i| {
                            visible[i].to_ascii_lowercase().starts_with(&prefix.to_ascii_lowercase())
                        })
                        .collect();
                    match hits.as_slice() {
                        [one] => *one as u32,
                        [] => {
                            return Err(CudaError::UnknownUuid {
                                uuid: prefix.clone(),
                                visible: if visible.is_empty() { "none".into() } else { visible.join(", ") },
                            })
                        }
                        many => {
                            return Err(CudaError::AmbiguousUuid {
                                uuid: prefix.clone(),
                                matches: many
                                    .iter()
                                    .map(|&i| visible[i].as_str())
                                    .collect::<Vec<_>>()
                                    .join(", "),
                            })
                        }
                    }
                }
            };
            if let Some((_, first)) = out.iter().find(|(o, _)| *o == ordinal) {
                return Err(CudaError::Duplicate {
                    device: format!("cuda:{ordinal}"),
                    first: first.to_string(),
                    second: device.to_string(),
                });
            }
            out.push((ordinal, device));
        }
        Ok(out.into_iter().map(|(o, _)| o).collect())
    }
}

impl FromStr for CudaSelection {
    type Err = CudaError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        CudaSelection::parse(s)
    }
}

/// A device UUID in NVIDIA's text form: `GPU-` and 16 bytes as
/// 8-4-4-4-12 lower-case hex digits, the form NVML and `nvidia-smi -L` print.
pub fn format_uuid(bytes: [u8; 16]) -> String {
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("GPU-{}-{}-{}-{}-{}", &hex[0..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..32])
}

/// The carve-out: what the board has (NVML) beyond what the driver offers
/// (`cuMemGetInfo` total). Zero if a driver ever reports more than the board.
pub fn carve_out(nvml_total: Bytes, driver_total: Bytes) -> Bytes {
    nvml_total.saturating_sub(driver_total)
}

/// NVML's per-process entries as one row per pid, sorted by pid. A pid can
/// appear more than once (one entry per compute instance); its bytes add
/// up. An entry whose bytes NVML cannot read counts as zero: the process is
/// still named, and what it holds shows up in the drift instead of vanishing.
pub fn merge_processes(entries: impl IntoIterator<Item = (u32, Option<u64>)>) -> Vec<ProcessBytes> {
    let mut by_pid: BTreeMap<u32, Bytes> = BTreeMap::new();
    for (pid, bytes) in entries {
        *by_pid.entry(pid).or_default() += Bytes(bytes.unwrap_or(0));
    }
    by_pid.into_iter().map(|(pid, bytes)| ProcessBytes { pid, bytes }).collect()
}

/// Why the commit table turned a request down.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TableError {
    /// No reservation starts at this base address.
    UnknownRange,
    /// Offset or size is not a multiple of the granularity, or the size is zero.
    Misaligned,
    /// The range runs past the end of the reservation.
    OutOfRange,
    /// Part of the range is committed already.
    Overlap,
    /// Nothing was committed at exactly this offset with exactly this size.
    NotCommitted,
}

/// A commit still in a range when the range is released.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Leftover<H> {
    pub(crate) offset: Bytes,
    pub(crate) bytes: Bytes,
    pub(crate) handle: H,
}

/// One address reservation: its reserved size and what is committed in it.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
#[derive(Debug)]
struct Reservation<H> {
    /// The size passed to the driver (rounded up to the granularity).
    reserved: Bytes,
    /// Offset → (size, physical handle) of each commit.
    commits: BTreeMap<u64, (Bytes, H)>,
}

/// Every address reservation of a card with the physical allocations mapped
/// into it. The driver unmaps and releases what was mapped in one piece, so
/// a decommit must name a commit exactly; this table is what checks it, and
/// what finds the handle to release.
#[derive(Debug)]
pub(crate) struct CommitTable<H> {
    ranges: HashMap<u64, Reservation<H>>,
}

impl<H> Default for CommitTable<H> {
    fn default() -> Self {
        CommitTable { ranges: HashMap::new() }
    }
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl<H: Copy> CommitTable<H> {
    pub(crate) fn add_range(&mut self, base: u64, reserved: Bytes) {
        self.ranges.insert(base, Reservation { reserved, commits: BTreeMap::new() });
    }

    /// May `[offset, offset + bytes)` of the range at `base` be committed?
    pub(crate) fn check_commit(
        &self,
        base: u64,
        offset: Bytes,
        bytes: Bytes,
        granularity: Bytes,
    ) -> Result<(), TableError> {
        let range = self.ranges.get(&base).ok_or(TableError::UnknownRange)?;
        let aligned = offset.round_down(granularity) == offset && bytes.round_down(granularity) == bytes;
        if !aligned || bytes == Bytes::ZERO {
            return Err(TableError::Misaligned);
        }
        match offset.get().checked_add(bytes.get()) {
            Some(end) if end <= range.reserved.get() => {}
            _ => return Err(TableError::OutOfRange),
        }
        let end = offset.get() + bytes.get();
        // The commit starting at or before `offset` and the first one after
        // it are the only ones that can overlap, since commits are disjoint.
        let before = range.commits.range(..=offset.get()).next_back();
        let after = range.commits.range(offset.get()..).next();
        let hits_before = before.is_some_and(|(o, (b, _))| o + b.get() > offset.get());
        let hits_after = after.is_some_and(|(o, _)| *o < end);
        if hits_before || hits_after {
            return Err(TableError::Overlap);
        }
        Ok(())
    }

    /// Record a commit that [`CommitTable::check_commit`] allowed and the
    /// driver carried out.
    pub(crate) fn insert(&mut self, base: u64, offset: Bytes, bytes: Bytes, handle: H) {
        if let Some(range) = self.ranges.get_mut(&base) {
            range.commits.insert(offset.get(), (bytes, handle));
        }
    }

    /// Take out the commit at exactly `offset` with exactly `bytes`.
    pub(crate) fn take(&mut self, base: u64, offset: Bytes, bytes: Bytes) -> Result<H, TableError> {
        let range = self.ranges.get_mut(&base).ok_or(TableError::UnknownRange)?;
        match range.commits.get(&offset.get()) {
            Some((b, h)) if *b == bytes => {
                let h = *h;
                range.commits.remove(&offset.get());
                Ok(h)
            }
            _ => Err(TableError::NotCommitted),
        }
    }

    /// Forget the range at `base`; returns its reserved size and any commits
    /// still in it (which the caller must release: a caller bug, but the
    /// physical memory must not leak because of it).
    pub(crate) fn remove_range(&mut self, base: u64) -> Option<(Bytes, Vec<Leftover<H>>)> {
        let range = self.ranges.remove(&base)?;
        let left = range.commits.into_iter().map(|(o, (bytes, handle))| Leftover {
            offset: Bytes(o),
            bytes,
            handle,
        });
        Some((range.reserved, left.collect()))
    }

    /// Physical bytes committed under every reservation.
    pub(crate) fn committed(&self) -> Bytes {
        self.ranges.values().flat_map(|r| r.commits.values().map(|(b, _)| *b)).sum()
    }
}

#[cfg(feature = "cuda")]
mod driver {
    //! The card itself: cudarc's driver bindings and NVML.

    use super::{carve_out, format_uuid, merge_processes, CommitTable, CudaError, CudaSelection, TableError};
    use crate::card::{CardError, CardKind, ProcessBytes, RawBlock, RawCard, VaRange};
    use crate::device::lock;
    use crate::Card;
    use corridor_units::{Bytes, CardId};
    use cudarc::driver::{result as cu, sys, CudaContext, DriverError};
    use nvml_wrapper::enums::device::UsedGpuMemory;
    use nvml_wrapper::error::NvmlError;
    use nvml_wrapper::Nvml;
    use std::sync::{Arc, Mutex};

    type Handle = sys::CUmemGenericAllocationHandle;

    fn reason(e: DriverError) -> String {
        e.error_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|_| format!("{:?}", e.0))
    }

    /// Whether the CUDA driver library can be loaded (by the names cudarc
    /// tries, on the loader's search path).
    pub fn driver_library_present() -> bool {
        // SAFETY: only tries to dlopen the driver by its usual names.
        unsafe { sys::is_culib_present() }
    }

    /// Fail with the library's name if the CUDA driver cannot be loaded;
    /// cudarc would panic on its first call instead.
    fn check_driver_library() -> Result<(), CudaError> {
        if driver_library_present() {
            Ok(())
        } else {
            Err(CudaError::MissingLibrary {
                library: "libcuda.so.1 (the CUDA driver)",
                detail: "no NVIDIA driver library was found".to_string(),
            })
        }
    }

    fn open_nvml() -> Result<Nvml, CudaError> {
        Nvml::init().map_err(|e| match e {
            NvmlError::LibloadingError(_) | NvmlError::LibraryNotFound | NvmlError::DriverNotLoaded => {
                CudaError::MissingLibrary { library: "libnvidia-ml.so.1 (NVML)", detail: e.to_string() }
            }
            other => CudaError::Nvml { uuid: "-".into(), op: "nvmlInit", reason: other.to_string() },
        })
    }

    /// The UUID of every visible CUDA device, in ordinal order.
    fn visible_uuids() -> Result<Vec<String>, CudaError> {
        // Errors before a device is chosen are reported against cuda:0.
        let err =
            |ordinal: i32, op| move |e| CudaError::Driver { ordinal: ordinal as u32, op, reason: reason(e) };
        cu::init().map_err(err(0, "cuInit"))?;
        let count = cu::device::get_count().map_err(err(0, "cuDeviceGetCount"))?;
        (0..count)
            .map(|i| {
                let dev = cu::device::get(i).map_err(err(i, "cuDeviceGet"))?;
                let uuid = cu::device::get_uuid(dev).map_err(err(i, "cuDeviceGetUuid"))?;
                Ok(format_uuid(uuid.bytes.map(|b| b as u8)))
            })
            .collect()
    }

    /// The UUID of CUDA device `ordinal`, so a caller holding a card can check
    /// it is the device it computes on.
    pub fn ordinal_uuid(ordinal: u32) -> Result<String, CudaError> {
        check_driver_library()?;
        let uuids = visible_uuids()?;
        uuids.get(ordinal as usize).cloned().ok_or(CudaError::NoSuchOrdinal { ordinal, count: uuids.len() })
    }

    /// Page-locked host memory for copies from a card at full link speed
    /// (the engine's logits, every step). It is host memory: it is not booked
    /// on any card, and the card's identity does not see it. The caller has a
    /// CUDA context current when it makes one.
    pub struct PinnedHost {
        ptr: *mut f32,
        len: usize,
    }

    // SAFETY: a plain host buffer owned by this value; access goes through &/&mut.
    unsafe impl Send for PinnedHost {}
    unsafe impl Sync for PinnedHost {}

    impl PinnedHost {
        /// Room for `len` f32 values (at least one).
        pub fn new(len: usize) -> Result<PinnedHost, CudaError> {
            let len = len.max(1);
            // SAFETY: a fresh page-locked allocation of `len` f32 values, freed in Drop.
            let ptr = unsafe { cu::malloc_host(len * 4, 0) }.map_err(|e| CudaError::Driver {
                ordinal: 0,
                op: "cuMemHostAlloc",
                reason: reason(e),
            })?;
            Ok(PinnedHost { ptr: ptr as *mut f32, len })
        }
        pub fn len(&self) -> usize {
            self.len
        }
        pub fn is_empty(&self) -> bool {
            self.len == 0
        }
        pub fn as_mut_slice(&mut self) -> &mut [f32] {
            // SAFETY: `len` f32 slots we own, borrowed mutably through &mut self; f32 has
            // no invalid bit patterns, so slots not yet written are still valid values.
            unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
        }
    }

    impl Drop for PinnedHost {
        fn drop(&mut self) {
            // SAFETY: allocated by cuMemHostAlloc in `new`, freed once.
            unsafe {
                let _ = cu::free_host(self.ptr as *mut std::ffi::c_void);
            }
        }
    }

    /// One GPU as a [`Card`].
    pub struct CudaCard {
        id: CardId,
        ordinal: u32,
        uuid: String,
        name: String,
        /// The device's primary context: the same one the compute backend
        /// retains for this ordinal, so pointers from here are valid there.
        ctx: Arc<CudaContext>,
        nvml: Arc<Nvml>,
        nvml_index: u32,
        nvml_total: Bytes,
        driver_total: Bytes,
        granularity: Bytes,
        vmm: bool,
        table: Mutex<CommitTable<Handle>>,
    }

    impl std::fmt::Debug for CudaCard {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("CudaCard")
                .field("id", &self.id)
                .field("ordinal", &self.ordinal)
                .field("uuid", &self.uuid)
                .field("name", &self.name)
                .finish_non_exhaustive()
        }
    }

    impl CudaCard {
        /// Open every device of `selection`, numbered `card0..` in its order.
        pub fn open_all(selection: &CudaSelection) -> Result<Vec<CudaCard>, CudaError> {
            check_driver_library()?;
            let nvml = Arc::new(open_nvml()?);
            let uuids = visible_uuids()?;
            let ordinals = selection.resolve(&uuids)?;
            ordinals
                .iter()
                .enumerate()
                .map(|(i, &o)| CudaCard::open_ordinal(CardId(i as u32), o, &uuids[o as usize], nvml.clone()))
                .collect()
        }

        /// Open CUDA device `ordinal` as card `id`.
        pub fn open(id: CardId, ordinal: u32) -> Result<CudaCard, CudaError> {
            check_driver_library()?;
            let nvml = Arc::new(open_nvml()?);
            let uuid = ordinal_uuid(ordinal)?;
            CudaCard::open_ordinal(id, ordinal, &uuid, nvml)
        }

        fn open_ordinal(
            id: CardId,
            ordinal: u32,
            uuid: &str,
            nvml: Arc<Nvml>,
        ) -> Result<CudaCard, CudaError> {
            let err = |op| move |e| CudaError::Driver { ordinal, op, reason: reason(e) };
            let ctx = CudaContext::new(ordinal as usize).map_err(err("cuDevicePrimaryCtxRetain"))?;
            let (_, driver_total) = ctx.mem_get_info().map_err(err("cuMemGetInfo"))?;
            let name = ctx.name().unwrap_or_else(|_| "unknown".into());
            let nvml_err = |op| {
                move |e: NvmlError| CudaError::Nvml { uuid: uuid.to_string(), op, reason: e.to_string() }
            };
            let (nvml_index, nvml_total) = {
                let dev = nvml.device_by_uuid(uuid).map_err(nvml_err("nvmlDeviceGetHandleByUUID"))?;
                let index = dev.index().map_err(nvml_err("nvmlDeviceGetIndex"))?;
                let total = dev.memory_info().map_err(nvml_err("nvmlDeviceGetMemoryInfo_v2"))?.total;
                (index, Bytes(total))
            };
            let vmm = ctx
                .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED)
                .map_err(err("cuDeviceGetAttribute"))?
                != 0;
            let granularity = if vmm {
                vmm_granularity(ordinal).map_err(err("cuMemGetAllocationGranularity"))?
            } else {
                // Without VMM only plain allocations work; the arena is
                // refused at its reservation, so the value only has to be sane.
                Bytes::mib(2)
            };
            tracing::info!(
                "{id}: cuda:{ordinal} {name} {uuid}: total {} (carve-out {}), granularity {granularity}{}",
                nvml_total,
                carve_out(nvml_total, Bytes(driver_total as u64)),
                if vmm { "" } else { ", no virtual memory management" }
            );
            Ok(CudaCard {
                id,
                ordinal,
                uuid: uuid.to_string(),
                name,
                ctx,
                nvml,
                nvml_index,
                nvml_total,
                driver_total: Bytes(driver_total as u64),
                granularity,
                vmm,
                table: Mutex::new(CommitTable::default()),
            })
        }

        /// The CUDA ordinal this card is.
        pub fn ordinal(&self) -> u32 {
            self.ordinal
        }
        /// The device's name ("NVIDIA H200").
        pub fn name(&self) -> &str {
            &self.name
        }
        /// The driver's total (`cuMemGetInfo`), what `total - carve_out` is.
        pub fn driver_total(&self) -> Bytes {
            self.driver_total
        }
        /// Physical bytes committed under this card's address reservations.
        pub fn committed(&self) -> Bytes {
            lock(&self.table).committed()
        }

        fn driver_error(&self, op: &str, e: DriverError) -> CardError {
            CardError::Driver { card: self.id, what: format!("{op} failed: {}", reason(e)) }
        }

        fn bind(&self) -> Result<(), CardError> {
            self.ctx.bind_to_thread().map_err(|e| self.driver_error("cuCtxSetCurrent", e))
        }

        /// An out-of-memory answer as the guard's refusal reason, anything
        /// else as a driver failure naming the call.
        fn alloc_error(&self, op: &str, want: Bytes, e: DriverError) -> CardError {
            if e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY {
                CardError::OutOfMemory { card: self.id, want, free: self.driver_free() }
            } else {
                self.driver_error(op, e)
            }
        }

        fn bad_range(&self, va: &VaRange, offset: Bytes, bytes: Bytes, why: TableError) -> CardError {
            tracing::warn!("{}: commit range {offset}+{bytes} refused: {why:?}", self.id);
            CardError::BadRange { card: self.id, offset, bytes, reserved: va.bytes }
        }

        /// Unmap `[ptr, ptr + bytes)` and release its physical handle.
        fn unmap_release(&self, ptr: u64, bytes: Bytes, handle: Handle) -> Result<(), CardError> {
            // SAFETY: the range was mapped in one piece by `commit` and nothing
            // maps it again until this returns (the table lock is held).
            unsafe { sys::cuMemUnmap(ptr, bytes.get() as usize).result() }
                .map_err(|e| self.driver_error("cuMemUnmap", e))?;
            // SAFETY: the handle came from cuMemCreate and is released once.
            unsafe { sys::cuMemRelease(handle).result() }.map_err(|e| self.driver_error("cuMemRelease", e))
        }
    }

    /// The property block of pinned device memory on `ordinal`.
    fn device_prop(ordinal: u32) -> sys::CUmemAllocationProp {
        // SAFETY: a plain C struct for which all-zero is a valid value (no
        // handle types requested, no flags).
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType_enum::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = sys::CUmemLocationType_enum::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = ordinal as i32;
        prop
    }

    /// The minimum granularity of physical commits: offsets and sizes of
    /// every commit must be multiples of it (2 MiB on an H200).
    fn vmm_granularity(ordinal: u32) -> Result<Bytes, DriverError> {
        let prop = device_prop(ordinal);
        let mut g: usize = 0;
        // SAFETY: out-parameter and a valid property block.
        unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut g,
                &prop,
                sys::CUmemAllocationGranularity_flags_enum::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
            .result()?
        };
        Ok(Bytes(g as u64))
    }

    impl Card for CudaCard {
        fn id(&self) -> CardId {
            self.id
        }
        fn uuid(&self) -> String {
            self.uuid.clone()
        }
        fn kind(&self) -> CardKind {
            CardKind::Cuda
        }
        fn total(&self) -> Bytes {
            self.nvml_total
        }
        fn carve_out(&self) -> Bytes {
            carve_out(self.nvml_total, self.driver_total)
        }
        fn driver_free(&self) -> Bytes {
            match self.ctx.mem_get_info() {
                Ok((free, _)) => Bytes(free as u64),
                Err(e) => {
                    // Reading zero makes the guard refuse and the sampler count
                    // the card as under its floor: the safe side when the
                    // driver cannot say how much is free.
                    tracing::error!(
                        "{}: cuMemGetInfo failed ({}); reading free memory as 0",
                        self.id,
                        reason(e)
                    );
                    Bytes::ZERO
                }
            }
        }
        fn process_bytes(&self) -> Bytes {
            let pid = self.self_pid();
            self.processes().iter().find(|p| p.pid == pid).map_or(Bytes::ZERO, |p| p.bytes)
        }
        fn processes(&self) -> Vec<ProcessBytes> {
            let list = self.nvml.device_by_index(self.nvml_index).and_then(|d| d.running_compute_processes());
            match list {
                Ok(list) => merge_processes(list.into_iter().map(|p| {
                    let bytes = match p.used_gpu_memory {
                        UsedGpuMemory::Used(b) => Some(b),
                        UsedGpuMemory::Unavailable => None,
                    };
                    (p.pid, bytes)
                })),
                Err(e) => {
                    tracing::warn!("{}: NVML process list unavailable: {e}", self.id);
                    Vec::new()
                }
            }
        }
        fn granularity(&self) -> Bytes {
            self.granularity
        }
    }

    impl RawCard for CudaCard {
        fn raw_alloc(&self, bytes: Bytes) -> Result<RawBlock, CardError> {
            self.bind()?;
            // A zero-byte request still gets a distinct, valid pointer.
            let size = bytes.get().max(1) as usize;
            // SAFETY: a plain allocation on the card's context, bound above.
            let ptr =
                unsafe { cu::malloc_sync(size) }.map_err(|e| self.alloc_error("cuMemAlloc", bytes, e))?;
            Ok(RawBlock { handle: ptr, bytes })
        }

        fn raw_free(&self, block: RawBlock) {
            if let Err(e) = self.bind() {
                tracing::error!("{e}; {} at {:#x} is not freed", block.bytes, block.handle);
                return;
            }
            // SAFETY: the pointer came from `raw_alloc` and its RAII guard
            // frees it exactly once.
            if let Err(e) = unsafe { cu::free_sync(block.handle) } {
                tracing::error!("{}: cuMemFree of {:#x} failed: {}", self.id, block.handle, reason(e));
            }
        }

        fn reserve_va(&self, bytes: Bytes) -> Result<VaRange, CardError> {
            if !self.vmm {
                return Err(CardError::Driver {
                    card: self.id,
                    what: "the device does not support virtual memory management (cuMemAddressReserve)"
                        .into(),
                });
            }
            self.bind()?;
            let reserved = bytes.max(self.granularity).round_up(self.granularity);
            let mut base: sys::CUdeviceptr = 0;
            // SAFETY: out-parameter; alignment 0 means the granularity, and
            // address 0 lets the driver choose.
            unsafe { sys::cuMemAddressReserve(&mut base, reserved.get() as usize, 0, 0, 0).result() }
                .map_err(|e| self.driver_error("cuMemAddressReserve", e))?;
            lock(&self.table).add_range(base, reserved);
            Ok(VaRange { handle: base, bytes })
        }

        fn release_va(&self, va: VaRange) {
            let mut table = lock(&self.table);
            let Some((reserved, left)) = table.remove_range(va.handle) else {
                tracing::error!("{}: releasing an unknown reservation at {:#x}", self.id, va.handle);
                return;
            };
            if let Err(e) = self.bind() {
                tracing::error!("{e}; reservation at {:#x} is not released", va.handle);
                return;
            }
            for super::Leftover { offset, bytes, handle } in left {
                // The chokepoint decommits before it releases, so this only
                // runs after a failed decommit; the memory must still go back.
                tracing::error!(
                    "{}: releasing a reservation with {bytes} still committed at +{offset}",
                    self.id
                );
                if let Err(e) = self.unmap_release(va.handle + offset.get(), bytes, handle) {
                    tracing::error!("{e}");
                }
            }
            // SAFETY: the range came from cuMemAddressReserve with this size
            // and nothing is mapped in it any more.
            if let Err(e) = unsafe { sys::cuMemAddressFree(va.handle, reserved.get() as usize).result() } {
                tracing::error!("{}: cuMemAddressFree failed: {}", self.id, reason(e));
            }
        }

        fn commit(&self, va: &VaRange, offset: Bytes, bytes: Bytes) -> Result<(), CardError> {
            // The table lock is held across the driver calls, so two commits
            // of overlapping ranges cannot both pass the check.
            let mut table = lock(&self.table);
            table
                .check_commit(va.handle, offset, bytes, self.granularity)
                .map_err(|why| self.bad_range(va, offset, bytes, why))?;
            self.bind()?;
            let prop = device_prop(self.ordinal);
            let mut handle: Handle = 0;
            // SAFETY: out-parameter and a valid property block; the size is a
            // multiple of the granularity (checked above).
            unsafe { sys::cuMemCreate(&mut handle, bytes.get() as usize, &prop, 0).result() }
                .map_err(|e| self.alloc_error("cuMemCreate", bytes, e))?;
            let ptr = va.handle + offset.get();
            // SAFETY: `[ptr, ptr + bytes)` lies inside the reservation and is
            // not mapped (checked above); the handle is exactly `bytes` long.
            if let Err(e) = unsafe { sys::cuMemMap(ptr, bytes.get() as usize, 0, handle, 0).result() } {
                // SAFETY: the handle was created above and is not mapped.
                let _ = unsafe { sys::cuMemRelease(handle).result() };
                return Err(self.driver_error("cuMemMap", e));
            }
            // SAFETY: a plain C struct for which all-zero is valid.
            let mut access: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
            access.location.type_ = sys::CUmemLocationType_enum::CU_MEM_LOCATION_TYPE_DEVICE;
            access.location.id = self.ordinal as i32;
            access.flags = sys::CUmemAccess_flags_enum::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
            // SAFETY: the range was just mapped; one access descriptor.
            if let Err(e) = unsafe { sys::cuMemSetAccess(ptr, bytes.get() as usize, &access, 1).result() } {
                if let Err(undo) = self.unmap_release(ptr, bytes, handle) {
                    tracing::error!("{undo}");
                }
                return Err(self.driver_error("cuMemSetAccess", e));
            }
            table.insert(va.handle, offset, bytes, handle);
            Ok(())
        }

        fn decommit(&self, va: &VaRange, offset: Bytes, bytes: Bytes) -> Result<(), CardError> {
            let mut table = lock(&self.table);
            let handle =
                table.take(va.handle, offset, bytes).map_err(|why| self.bad_range(va, offset, bytes, why))?;
            self.bind()?;
            let ptr = va.handle + offset.get();
            // SAFETY: the range was mapped in one piece by `commit`; the arena
            // decommits only chunks above its live watermark, which no
            // kernel reads or writes.
            if let Err(e) = unsafe { sys::cuMemUnmap(ptr, bytes.get() as usize).result() } {
                // Still mapped: keep it in the table so it stays booked and a
                // later release can try again.
                table.insert(va.handle, offset, bytes, handle);
                return Err(self.driver_error("cuMemUnmap", e));
            }
            // SAFETY: created by cuMemCreate in `commit`, released once.
            unsafe { sys::cuMemRelease(handle).result() }.map_err(|e| self.driver_error("cuMemRelease", e))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: Bytes = Bytes::mib(2);

    #[test]
    fn commits_must_be_aligned_inside_and_disjoint() {
        let mut t: CommitTable<u64> = CommitTable::default();
        t.add_range(0x1000_0000, Bytes::mib(64));
        assert_eq!(t.check_commit(0x2000_0000, Bytes::ZERO, G, G), Err(TableError::UnknownRange));
        assert_eq!(t.check_commit(0x1000_0000, Bytes::mib(1), G, G), Err(TableError::Misaligned));
        assert_eq!(t.check_commit(0x1000_0000, Bytes::ZERO, Bytes::mib(3), G), Err(TableError::Misaligned));
        assert_eq!(t.check_commit(0x1000_0000, Bytes::ZERO, Bytes::ZERO, G), Err(TableError::Misaligned));
        assert_eq!(
            t.check_commit(0x1000_0000, Bytes::mib(62), Bytes::mib(4), G),
            Err(TableError::OutOfRange)
        );
        assert_eq!(t.check_commit(0x1000_0000, Bytes::mib(62), G, G), Ok(()));

        t.insert(0x1000_0000, Bytes::mib(4), Bytes::mib(4), 7);
        // Overlapping the start, the end, covering, and inside are all refused;
        // touching either edge is fine.
        for (o, b) in [(2, 4), (6, 4), (2, 8), (4, 2), (6, 2)] {
            assert_eq!(
                t.check_commit(0x1000_0000, Bytes::mib(o), Bytes::mib(b), G),
                Err(TableError::Overlap),
                "{o}+{b}"
            );
        }
        assert_eq!(t.check_commit(0x1000_0000, Bytes::mib(2), G, G), Ok(()));
        assert_eq!(t.check_commit(0x1000_0000, Bytes::mib(8), G, G), Ok(()));
        assert_eq!(t.committed(), Bytes::mib(4));
    }

    #[test]
    fn a_decommit_must_name_a_commit_exactly() {
        let mut t: CommitTable<u64> = CommitTable::default();
        t.add_range(1, Bytes::mib(16));
        t.insert(1, Bytes::ZERO, Bytes::mib(4), 11);
        t.insert(1, Bytes::mib(4), G, 12);
        assert_eq!(t.take(1, Bytes::ZERO, G), Err(TableError::NotCommitted));
        assert_eq!(t.take(1, Bytes::mib(2), G), Err(TableError::NotCommitted));
        assert_eq!(t.take(9, Bytes::ZERO, Bytes::mib(4)), Err(TableError::UnknownRange));
        assert_eq!(t.take(1, Bytes::ZERO, Bytes::mib(4)), Ok(11));
        // Taken once only.
        assert_eq!(t.take(1, Bytes::ZERO, Bytes::mib(4)), Err(TableError::NotCommitted));
        assert_eq!(t.committed(), G);
        let (reserved, left) = t.remove_range(1).unwrap();
        assert_eq!(reserved, Bytes::mib(16));
        assert_eq!(left, vec![Leftover { offset: Bytes::mib(4), bytes: G, handle: 12 }]);
        assert!(t.remove_range(1).is_none());
    }
}
