//! `corridor memory`: where every byte on every card goes.
//!
//! `--url` asks a running server's `GET /v1/memory` and renders it as a table
//! (or passes the JSON through with `--json`); `--flight-dir` reads the
//! flight recorder's marks and renders each recorded boot, grouped by boot id
//! and process, never differencing two boots.

use anyhow::{bail, Context, Result};
use clap::Args;
use corridor_units::Bytes;
use corridor_vram::recorder::{group_by_boot_and_pid, read_dir, MarkKind};
use corridor_vram::{render_table, MemoryReport};
use std::io::{Read, Write};
use std::path::PathBuf;

#[derive(Args, Debug)]
#[command(after_help = corridor_vram::report::LEGEND)]
pub struct MemoryArgs {
    /// A running corridor server, e.g. http://127.0.0.1:8000.
    #[arg(long, conflicts_with = "flight_dir")]
    url: Option<String>,
    /// A flight-recorder directory written by `serve --flight-dir`.
    #[arg(long)]
    flight_dir: Option<PathBuf>,
    /// Print JSON for machines instead of a table.
    #[arg(long)]
    json: bool,
    /// Bearer key, when the server was started with --api-key.
    #[arg(long, env = "CORRIDOR_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
}

pub fn run(a: &MemoryArgs) -> Result<()> {
    match (&a.url, &a.flight_dir) {
        (Some(url), _) => {
            let body = http_get(url, "/v1/memory", a.api_key.as_deref())?;
            if a.json {
                println!("{body}");
            } else {
                let report: MemoryReport = serde_json::from_str(&body)
                    .with_context(|| format!("{url}/v1/memory did not return a memory report"))?;
                print!("{}", render_table(&report));
                if let Some(line) = layout_line(&body) {
                    println!("{line}");
                }
            }
            Ok(())
        }
        (None, Some(dir)) => flight(dir, a.json),
        (None, None) => bail!("give --url URL (a running server) or --flight-dir DIR (recorded boots)"),
    }
}

/// The serving layout of a flipping group, from the report's `layout`
/// object (`None` for a server that holds one layout).
fn layout_line(body: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(body).ok()?;
    let l = v.get("layout")?;
    let serving = l.get("serving")?.as_str()?;
    let f = l.get("flips")?;
    let n = |k: &str| f.get(k).and_then(|x| x.as_u64()).unwrap_or(0);
    let abandoned: u64 = f
        .get("abandoned")
        .and_then(|a| a.as_object())
        .map_or(0, |a| a.values().filter_map(|x| x.as_u64()).sum());
    let mode = l.get("phase_flip").and_then(|m| m.as_str()).unwrap_or("?");
    let off = if f.get("disabled").and_then(|d| d.as_bool()).unwrap_or(false) {
        ", turned off after abandons"
    } else {
        ""
    };
    Some(format!(
        "layout: serving in {serving} (phase flips {mode}{off}: {} to pp, {} to tp, {abandoned} abandoned, {} moved)",
        n("to_pp"),
        n("to_tp"),
        Bytes(n("bytes_moved"))
    ))
}

fn mib(b: Bytes) -> String {
    format!("{:.0}", b.as_mib_f64())
}

fn flight(dir: &std::path::Path, json: bool) -> Result<()> {
    let marks = read_dir(dir).with_context(|| format!("reading {}", dir.display()))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&marks)?);
        return Ok(());
    }
    if marks.is_empty() {
        println!("no marks in {}", dir.display());
        return Ok(());
    }
    for ((boot, pid), group) in group_by_boot_and_pid(&marks) {
        println!("boot {} pid {pid}", boot.0);
        println!(
            "  {:<16} {:<6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
            "mark", "card", "total", "free", "self", "books", "weights", "kv", "foreign"
        );
        for m in &group {
            let name = match &m.kind {
                MarkKind::Boot(p) => format!("{p:?}"),
                MarkKind::Serving => "serving".to_string(),
                MarkKind::Flip => match &m.flip {
                    Some(f) if f.committed => format!("flip {}->{}", f.from, f.to),
                    Some(f) => format!("flip {}->{} abandoned", f.from, f.to),
                    None => "flip".to_string(),
                },
            };
            let foreign: Bytes = m.processes.iter().filter(|p| p.pid != m.pid).map(|p| p.bytes).sum();
            println!(
                "  {:<16} {:<6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
                name,
                m.card.to_string(),
                mib(m.total_bytes),
                mib(m.free_bytes),
                mib(m.self_bytes),
                mib(m.books.total()),
                mib(m.books.weights),
                mib(m.books.kv_committed),
                mib(foreign)
            );
            for p in m.processes.iter().filter(|p| p.pid != m.pid) {
                println!("  {:<16} {:<6} foreign pid {} holds {} MiB", "", "", p.pid, mib(p.bytes));
            }
        }
        println!("  (MiB)");
    }
    Ok(())
}

/// A minimal HTTP/1.1 GET over a plain TCP connection (loopback servers).
fn http_get(base: &str, path: &str, key: Option<&str>) -> Result<String> {
    let rest =
        base.strip_prefix("http://").with_context(|| format!("{base}: only http:// URLs are supported"))?;
    let hostport = rest.trim_end_matches('/').trim_end_matches("/v1");
    let addr = if hostport.contains(':') { hostport.to_string() } else { format!("{hostport}:80") };
    let mut s = std::net::TcpStream::connect(&addr).with_context(|| format!("cannot reach {addr}"))?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))?;
    let auth = key.map(|k| format!("Authorization: Bearer {k}\r\n")).unwrap_or_default();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {hostport}\r\n{auth}Connection: close\r\n\r\n")?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").context("malformed HTTP response")?;
    let status = head.split_whitespace().nth(1).unwrap_or("?");
    let body = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        dechunk(body)
    } else {
        body.to_string()
    };
    if status != "200" {
        bail!("{addr}{path} answered {status}: {}", body.trim());
    }
    Ok(body)
}

fn dechunk(body: &str) -> String {
    let mut out = String::new();
    let mut rest = body;
    while let Some((len, tail)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(len.trim(), 16).unwrap_or(0);
        if n == 0 || tail.len() < n {
            break;
        }
        out.push_str(&tail[..n]);
        rest = tail[n..].trim_start_matches("\r\n");
    }
    out
}
