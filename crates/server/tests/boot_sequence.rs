//! Every boot runs the same sequence, whatever the cards and the group: the
//! flight recorder's boot marks come in the same order for the whole model
//! on the host card, on a sim card, a layout over sim cards, CPU threads
//! sharing the host card and a flipping group.

use corridor_engine::flips::FlipMode;
use corridor_model::layout::{LayoutSpec, Split};
use corridor_server::boot::{boot, BootOptions, Devices};
use corridor_units::{Bytes, CardId};
use corridor_vram::recorder::{read_dir, BootPhase, MarkKind};
use std::path::Path;

fn fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny").join(name)
}

/// The boot phases `opts` leaves marks for, in order.
fn phases(mut opts: BootOptions) -> Vec<BootPhase> {
    let dir = tempfile::tempdir().unwrap();
    opts.flight_dir = Some(dir.path().to_path_buf());
    opts.max_running = 4;
    opts.context_len = Some(128);
    let booted = boot(&opts, |_, _| {}).unwrap();
    booted.engine.shutdown();
    drop(booted);
    // One mark per card at each phase, in the order they were taken.
    read_dir(dir.path())
        .unwrap()
        .iter()
        .filter(|m| m.card == CardId(0))
        .filter_map(|m| match m.kind {
            MarkKind::Boot(p) => Some(p),
            _ => None,
        })
        .collect()
}

#[test]
fn every_card_kind_and_group_boots_through_the_same_phases() {
    let expected = vec![
        BootPhase::ProcessStart,
        BootPhase::ContextReady,
        BootPhase::WeightsLoaded,
        BootPhase::WorkspaceReady,
        BootPhase::GraphsCaptured,
        BootPhase::KvSized,
        BootPhase::BootComplete,
    ];
    let model = fixture("llama-f32");
    let tp2 = LayoutSpec { tp: 2, tp_split: Split::Even, pp: 1, pp_split: Split::Even };
    let sim = |sizes: &[u64]| Devices::Sim(sizes.iter().map(|&g| Bytes::gib(g)).collect());

    let host = BootOptions::new(model.clone());
    let one_sim = BootOptions { devices: sim(&[2]), ..BootOptions::new(model.clone()) };
    let sim_layout =
        BootOptions { devices: sim(&[2, 2]), layout: Some(tp2.clone()), ..BootOptions::new(model.clone()) };
    let host_threads = BootOptions { layout: Some(tp2), ..BootOptions::new(model.clone()) };
    let flipping = BootOptions {
        devices: sim(&[2, 2]),
        phase_flip: FlipMode::Manual,
        ..BootOptions::new(model.clone())
    };
    for (name, opts) in [
        ("host", host),
        ("one sim card", one_sim),
        ("a layout over sim cards", sim_layout),
        ("threads on the host card", host_threads),
        ("a flipping group", flipping),
    ] {
        assert_eq!(phases(opts), expected, "{name}");
    }
}
