//! GPU check of the CUDA card and the chokepoint on a real device.
//!
//! Opens one card, prints what the driver and NVML say about it, then drives
//! memory through the chokepoint and checks each step against the driver's
//! free memory:
//! 1. reserve 4 GiB of address space: free memory must not move;
//! 2. commit 1 GiB under it in granules (2 MiB on an H200): free drops by
//!    exactly 1 GiB, the books say 1 GiB of KV, and the memory is usable
//!    (filled and read back at both ends);
//! 3. decommit the upper half: free rises by exactly 512 MiB;
//! 4. a plain 64 MiB allocation booked as weights;
//! 5. the memory report with its drift (the identity
//!    `total = carve_out + foreign + residue + books + free`);
//! 6. give everything back: free returns to where it started.
//!
//! Exact checks assume nothing else allocates on the card meanwhile; the
//! process list is printed before and after so a foreign process is named.
//! Exit status: 0 every check passed, 1 a check failed, 2 the card could not
//! be opened (the message names the missing library or device).
//!
//! Usage: `cuda_card_check [cuda:0 | cuda:GPU-…] [--va-gib N] [--commit-mib N]
//! [--tolerance-mib N] [--max-drift-mib N] [--json PATH]`

use corridor_units::Bytes;
use corridor_vram::{
    render_table, Card, CardSettings, CudaCard, CudaSelection, Governor, GovernorConfig, Purpose,
    SystemClock, Urgency,
};
use cudarc::driver::{result as cu, CudaContext};
use std::sync::Arc;

/// Command-line options, parsed once.
struct Options {
    selection: String,
    va: Bytes,
    commit: Bytes,
    tolerance: Bytes,
    max_drift: Bytes,
    json: Option<String>,
}

fn parse_options() -> Result<Options, String> {
    let mut o = Options {
        selection: "cuda:0".into(),
        va: Bytes::gib(4),
        commit: Bytes::gib(1),
        tolerance: Bytes::ZERO,
        max_drift: Bytes::mib(16),
        json: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| args.next().ok_or(format!("{name} needs a value"));
        match a.as_str() {
            "--va-gib" => o.va = Bytes::gib(whole("--va-gib", value("--va-gib")?)?),
            "--commit-mib" => o.commit = Bytes::mib(whole("--commit-mib", value("--commit-mib")?)?),
            "--tolerance-mib" => {
                o.tolerance = Bytes::mib(whole("--tolerance-mib", value("--tolerance-mib")?)?)
            }
            "--max-drift-mib" => {
                o.max_drift = Bytes::mib(whole("--max-drift-mib", value("--max-drift-mib")?)?)
            }
            "--json" => o.json = Some(value("--json")?),
            "-h" | "--help" => return Err(String::new()),
            s if s.starts_with("cuda") => o.selection = s.to_string(),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if o.commit > o.va {
        return Err(format!("--commit-mib ({}) is larger than the reservation ({})", o.commit, o.va));
    }
    Ok(o)
}

fn whole(name: &str, text: String) -> Result<u64, String> {
    text.parse().map_err(|_| format!("{name} takes a whole number, not {text}"))
}

/// Counts checks and prints each one.
#[derive(Default)]
struct Checks {
    failed: usize,
    passed: usize,
}

impl Checks {
    fn check(&mut self, ok: bool, what: &str) {
        if ok {
            self.passed += 1;
            println!("  PASS  {what}");
        } else {
            self.failed += 1;
            println!("  FAIL  {what}");
        }
    }

    /// `moved` must equal `expected` within `tolerance` (signed byte counts).
    fn moved(&mut self, what: &str, moved: i64, expected: i64, tolerance: Bytes) {
        let off = (moved - expected).unsigned_abs();
        self.check(
            off <= tolerance.get(),
            &format!(
                "{what}: driver free moved {:+.1} MiB, expected {:+.1} MiB (off by {off} B, tolerance {})",
                mib(moved),
                mib(expected),
                tolerance
            ),
        );
    }
}

fn mib(bytes: i64) -> f64 {
    bytes as f64 / Bytes::MIB as f64
}

fn signed(b: Bytes) -> i64 {
    b.get() as i64
}

fn print_processes(card: &dyn Card) {
    let me = card.self_pid();
    let list = card.processes();
    if list.is_empty() {
        println!("  (NVML lists no compute process)");
    }
    for p in list {
        let who = if p.pid == me { "  <- this process" } else { "" };
        println!("  pid {:>8}  {:>10.1} MiB{who}", p.pid, p.bytes.as_mib_f64());
    }
}

fn main() {
    // The card logs what it opened and any driver failure it absorbed.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let options = match parse_options() {
        Ok(o) => o,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("cuda_card_check: {e}");
            }
            eprintln!(
                "usage: cuda_card_check [cuda:0 | cuda:GPU-<uuid>] [--va-gib 4] [--commit-mib 1024] \
                 [--tolerance-mib 0] [--max-drift-mib 16] [--json PATH]"
            );
            std::process::exit(2);
        }
    };
    let card = match CudaSelection::parse(&options.selection).and_then(|s| CudaCard::open_all(&s)) {
        Ok(mut cards) if !cards.is_empty() => cards.swap_remove(0),
        Ok(_) => {
            eprintln!("cuda_card_check: {} names no device", options.selection);
            std::process::exit(2);
        }
        Err(e) => {
            eprintln!("cuda_card_check: cannot open {}: {e}", options.selection);
            std::process::exit(2);
        }
    };
    match run(card, &options) {
        Ok(checks) => {
            println!("\n{} checks passed, {} failed", checks.passed, checks.failed);
            std::process::exit(if checks.failed == 0 { 0 } else { 1 });
        }
        Err(e) => {
            eprintln!("cuda_card_check: {e}");
            std::process::exit(1);
        }
    }
}

fn run(card: CudaCard, o: &Options) -> Result<Checks, Box<dyn std::error::Error>> {
    let mut c = Checks::default();
    let ordinal = card.ordinal();
    println!("card {}: cuda:{ordinal} {} {}", card.id(), card.name(), card.uuid());
    println!("  total (NVML)        {:>10.1} MiB", card.total().as_mib_f64());
    println!("  total (driver)      {:>10.1} MiB", card.driver_total().as_mib_f64());
    println!("  carve-out           {:>10.1} MiB", card.carve_out().as_mib_f64());
    println!("  driver free         {:>10.1} MiB", card.driver_free().as_mib_f64());
    println!(
        "  this process (NVML) {:>10.1} MiB (pid {})",
        card.process_bytes().as_mib_f64(),
        card.self_pid()
    );
    println!("  granularity         {:>10.1} MiB", card.granularity().as_mib_f64());
    println!("processes on the card:");
    print_processes(&card);
    c.check(card.carve_out() + card.driver_total() == card.total(), "carve-out = NVML total - driver total");
    c.check(card.driver_free() <= card.driver_total(), "driver free <= driver total");
    c.check(
        card.processes().iter().any(|p| p.pid == card.self_pid()),
        "NVML lists this process (if not: a PID namespace hides it, and residue reads as -books)",
    );
    let gran = card.granularity();
    if o.commit.round_down(gran) != o.commit || o.commit < gran + gran {
        return Err(format!("--commit-mib must be a multiple of two granules ({gran})").into());
    }

    let card: Arc<dyn Card> = Arc::new(card);
    let gov = Governor::new(
        vec![card.clone()],
        GovernorConfig::uniform(1, CardSettings::default()),
        Arc::new(SystemClock::new()),
    )?;
    let dev = gov.devices()[0].clone();
    let floor = dev.settings().floor;
    let start = card.driver_free();
    if start < o.commit + Bytes::mib(64) + floor {
        return Err(format!(
            "only {start} free; this check needs {} above the {floor} floor",
            o.commit + Bytes::mib(64)
        )
        .into());
    }

    println!("\n1. reserve {} of address space", o.va);
    let before = card.driver_free();
    let va = dev.reserve_va(o.va)?;
    let after = card.driver_free();
    println!("  base {:#x}", va.base_address());
    c.moved("reservation", signed(after) - signed(before), 0, o.tolerance);
    c.check(dev.books().kv_reserved == o.va, &format!("books: kv reserved {}", dev.books().kv_reserved));

    let granules = (o.commit.get() / gran.get()) as usize;
    println!("\n2. commit {} as {granules} commits of {gran}", o.commit);
    let before = card.driver_free();
    let mut commits = Vec::with_capacity(granules);
    for i in 0..granules {
        commits.push(dev.commit(&va, Bytes(i as u64 * gran.get()), gran, Urgency::Deferrable)?);
    }
    let after_commit = card.driver_free();
    c.moved("commit", signed(after_commit) - signed(before), -signed(o.commit), o.tolerance);
    c.check(
        dev.books().kv_committed == o.commit,
        &format!("books: kv committed {}", dev.books().kv_committed),
    );
    // Fill the committed range and read both ends back: a mapping without
    // access rights would fault here instead of in a kernel later.
    let ctx = CudaContext::new(ordinal as usize)?;
    ctx.bind_to_thread()?;
    let base = va.base_address();
    // SAFETY: [base, base + commit) is mapped read-write by the commits above.
    unsafe { cu::memset_d8_sync(base, 0xA5, o.commit.get() as usize) }?;
    let mut head = [0u8; 16];
    let mut tail = [0u8; 16];
    // SAFETY: both reads lie inside the committed range.
    unsafe {
        cu::memcpy_dtoh_sync(&mut head, base)?;
        cu::memcpy_dtoh_sync(&mut tail, base + o.commit.get() - 16)?;
    }
    c.check(head.iter().chain(&tail).all(|&b| b == 0xA5), "committed memory is writable and reads back");
    c.check(
        dev.commit(&va, Bytes::ZERO, gran, Urgency::Deferrable).is_err(),
        "committing an already committed granule is refused",
    );

    println!("\n3. decommit the upper half");
    let before = card.driver_free();
    let upper = commits.split_off(granules / 2);
    let released = Bytes(upper.len() as u64 * gran.get());
    drop(upper);
    let after = card.driver_free();
    c.moved("decommit", signed(after) - signed(before), signed(released), o.tolerance);
    c.check(
        dev.books().kv_committed == o.commit - released,
        &format!("books: kv committed {}", dev.books().kv_committed),
    );

    println!("\n4. a plain 64 MiB allocation booked as weights");
    let before = card.driver_free();
    let weights = dev.reserve(Bytes::mib(64), Purpose::Weights)?;
    let after = card.driver_free();
    println!("  address {:#x}", weights.address());
    c.moved("cuMemAlloc", signed(after) - signed(before), -signed(Bytes::mib(64)), o.tolerance + gran);
    c.check(dev.books().weights == Bytes::mib(64), &format!("books: weights {}", dev.books().weights));

    // What the driver charges for a tiny buffer (the backend has a few):
    // informational, since the books record the bytes asked for.
    let before = card.driver_free();
    let tiny = dev.reserve(Bytes(256), Purpose::Other)?;
    let after = card.driver_free();
    println!(
        "  a 256-byte allocation moved driver free by {:+.3} MiB (kept until the end)",
        mib(signed(after) - signed(before))
    );

    println!("\n5. the memory report");
    let report = gov.memory_report();
    print!("{}", render_table(&report));
    for r in &report.cards {
        println!(
            "  {}: residue {:+.1} MiB (context, modules, what the driver rounds up), drift {:+.1} MiB",
            r.card,
            mib(r.residue_bytes),
            mib(r.drift_bytes)
        );
        c.check(
            r.drift_bytes.unsigned_abs() <= o.max_drift.get(),
            &format!("drift within {} (the identity closes)", o.max_drift),
        );
    }
    if let Some(path) = &o.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
        println!("  report written to {path}");
    }
    let stats = dev.guard_stats();
    println!("  guard: {stats:?}");

    println!("\n6. give everything back");
    drop(tiny);
    drop(weights);
    drop(commits);
    drop(va);
    let end = card.driver_free();
    c.moved("all released", signed(end) - signed(start), 0, o.tolerance);
    c.check(dev.books() == Default::default(), &format!("books empty: {:?}", dev.books()));
    println!("processes on the card at the end:");
    print_processes(card.as_ref());
    Ok(c)
}
