//! The parts of the CUDA card that run without a GPU: device selection, UUID
//! text, the carve-out, the per-process list, and (with the `cuda` feature
//! on a machine without a driver) a missing library reported as an error.

use corridor_units::Bytes;
use corridor_vram::card::ProcessBytes;
use corridor_vram::cuda::{carve_out, format_uuid, merge_processes};
use corridor_vram::{CudaDeviceRef, CudaError, CudaSelection};

const A: &str = "GPU-1a2b3c4d-0000-1111-2222-333344445555";
const B: &str = "GPU-1a2b9999-0000-1111-2222-333344445555";
const C: &str = "GPU-77777777-0000-1111-2222-333344445555";

fn visible() -> Vec<String> {
    [A, B, C].iter().map(|s| s.to_string()).collect()
}

#[test]
fn selections_parse() {
    assert_eq!(CudaSelection::parse("cuda").unwrap(), CudaSelection::All);
    assert_eq!(CudaSelection::parse("CUDA:all").unwrap(), CudaSelection::All);
    assert_eq!(
        CudaSelection::parse("cuda:0,1").unwrap(),
        CudaSelection::Devices(vec![CudaDeviceRef::Ordinal(0), CudaDeviceRef::Ordinal(1)])
    );
    // UUIDs are matched in lower case, whatever case they were typed in.
    assert_eq!(
        "cuda:GPU-1A2B3C4D, 2".parse::<CudaSelection>().unwrap(),
        CudaSelection::Devices(vec![CudaDeviceRef::Uuid("GPU-1a2b3c4d".into()), CudaDeviceRef::Ordinal(2)])
    );
}

#[test]
fn bad_selections_are_errors_naming_the_text() {
    for text in
        ["sim:32GiB", "cuda:", "cuda:0,,1", "cuda:x", "cuda:GPU-zz", "cuda:MIG-abc", "cuda:1,1", "cuda:-1"]
    {
        match CudaSelection::parse(text) {
            Err(CudaError::BadSelection { text: t, .. }) => assert_eq!(t, text),
            other => panic!("{text}: {other:?}"),
        }
    }
}

#[test]
fn selections_resolve_to_ordinals_in_their_own_order() {
    let v = visible();
    assert_eq!(CudaSelection::All.resolve(&v).unwrap(), vec![0, 1, 2]);
    assert_eq!(CudaSelection::parse("cuda:2,0").unwrap().resolve(&v).unwrap(), vec![2, 0]);
    let by_uuid = CudaSelection::parse(&format!("cuda:{C},{A}")).unwrap();
    assert_eq!(by_uuid.resolve(&v).unwrap(), vec![2, 0]);
    // A unique prefix is enough.
    assert_eq!(CudaSelection::parse("cuda:GPU-7").unwrap().resolve(&v).unwrap(), vec![2]);
}

#[test]
fn unresolvable_selections_say_why() {
    let v = visible();
    let resolve = |t: &str| CudaSelection::parse(t).unwrap().resolve(&v);
    assert_eq!(resolve("cuda:3"), Err(CudaError::NoSuchOrdinal { ordinal: 3, count: 3 }));
    assert!(matches!(resolve("cuda:GPU-ffff"), Err(CudaError::UnknownUuid { .. })));
    match resolve("cuda:GPU-1a2b") {
        Err(CudaError::AmbiguousUuid { matches, .. }) => assert!(matches.contains(A) && matches.contains(B)),
        other => panic!("{other:?}"),
    }
    // One card under two names would be governed by two sets of books.
    assert!(matches!(resolve(&format!("cuda:0,{A}")), Err(CudaError::Duplicate { .. })));
    assert_eq!(CudaSelection::All.resolve(&[]), Ok(vec![]));
    let none = CudaSelection::parse("cuda:0").unwrap().resolve(&[]);
    assert_eq!(none, Err(CudaError::NoSuchOrdinal { ordinal: 0, count: 0 }));
}

#[test]
fn uuids_print_as_nvml_does() {
    let bytes =
        [0x1a, 0x2b, 0x3c, 0x4d, 0x00, 0x00, 0x11, 0x11, 0x22, 0x22, 0x33, 0x33, 0x44, 0x44, 0x55, 0x55];
    assert_eq!(format_uuid(bytes), A);
}

#[test]
fn carve_out_is_nvml_total_minus_driver_total() {
    // The H200 test machine: NVML 150,754,820,096 B, cuMemGetInfo 150,109,880,320 B.
    let carve = carve_out(Bytes(150_754_820_096), Bytes(150_109_880_320));
    assert_eq!(carve, Bytes(644_939_776));
    assert_eq!(carve.as_mib_f64().round(), 615.0);
    assert_eq!(carve_out(Bytes::mib(1), Bytes::mib(2)), Bytes::ZERO);
}

#[test]
fn process_entries_merge_by_pid() {
    let merged = merge_processes([(30, Some(100)), (10, Some(5)), (30, Some(20)), (20, None)]);
    assert_eq!(
        merged,
        vec![
            ProcessBytes { pid: 10, bytes: Bytes(5) },
            ProcessBytes { pid: 20, bytes: Bytes::ZERO },
            ProcessBytes { pid: 30, bytes: Bytes(120) },
        ]
    );
}

/// On a machine without the NVIDIA driver, opening a card must be an error
/// naming the library, never cudarc's panic. Where a driver is installed
/// this checks nothing about libraries; the GPU check covers that side.
#[cfg(feature = "cuda")]
#[test]
fn a_missing_driver_is_an_error_naming_it() {
    if corridor_vram::cuda::driver_library_present() {
        return;
    }
    let err = corridor_vram::CudaCard::open(corridor_units::CardId(0), 0).unwrap_err();
    match &err {
        CudaError::MissingLibrary { library, .. } => assert!(library.contains("libcuda"), "{err}"),
        other => panic!("expected a missing library, got {other}"),
    }
    assert!(err.to_string().contains("libcuda.so.1"), "{err}");
    let all = corridor_vram::CudaCard::open_all(&CudaSelection::All).unwrap_err();
    assert!(matches!(all, CudaError::MissingLibrary { .. }), "{all}");
    let uuid = corridor_vram::cuda::ordinal_uuid(0).unwrap_err();
    assert!(matches!(uuid, CudaError::MissingLibrary { .. }), "{uuid}");
}
