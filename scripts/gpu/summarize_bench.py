#!/usr/bin/env python3
"""Summarise a Llama-3-8B benchmark directory (written by scripts/gpu/bench8b.sh) as markdown.

Usage:
    python3 scripts/gpu/summarize_bench.py OUTDIR

Reads the `corridor bench --json` reports in OUTDIR:

    decode_<B>.json    fixed workload at concurrency B (decode throughput and step time)
    prefill_<P>.json   prompts of P tokens, one output token, concurrency 1 (TTFT = prefill time)
    latency_<C>.json   fixed workload at concurrency C (TTFT and inter-token latency)

plus the `RESULT` line of logits.log (the logit comparison against transformers) and the step
outcomes in steps.txt when present, and prints markdown tables. Missing or unreadable files become rows saying so; nothing here fails.

Ceilings (one H200; an H100 named in nvidia-smi.txt takes 3.35 TB/s):
- Decode is bound by memory bandwidth. One decode step of a batch of B reads every weight once and
  the KV cache of every sequence:
      weight_bytes   = 16.06e9 (Llama-3-8B in bf16: 8.03e9 parameters, embedding and lm_head included)
      kv_bytes_read  = B * avg_context * 32 layers * 2 (K and V) * 8 KV heads * 128 head_dim * 2 bytes
      avg_context    = mean prompt tokens (as the server counted them) + mean output tokens / 2
                       (512 + 128 for the 512-in / 256-out decode runs)
      ceiling step   = (weight_bytes + kv_bytes_read) / 4.3e12 B/s (WEIGHT_BYTES, HBM_BYTES_PER_S override)
  The measured step is the ITL p50 (every gap between streamed tokens, all requests pooled), and the
  fraction of the ceiling is ceiling step / measured step.
- Prefill is bound by tensor-core throughput:
      FLOPs per prompt token = 2 * 8.03e9 + 4 * 32 layers * 4096 * P / 2 (causal attention)
      ceiling                = 800e12 FLOP/s (bf16 dense GEMM)
  Prefill time is the TTFT p50 of single requests (it includes the HTTP round trip and the first
  decode step, so the fraction is slightly pessimistic); tokens/s = P / TTFT p50. The 2 * 8.03e9
  counts the embedding and the lm_head for every token, which a server that projects only the
  last position does not spend; the fraction is computed with it as stated.
"""

import glob
import json
import os
import re
import sys

# The bf16 checkpoint's bytes; bench8b.sh sets WEIGHT_BYTES to a GGUF file's size when it serves one.
WEIGHT_BYTES = float(os.environ.get("WEIGHT_BYTES", 16.06e9))
PARAMS = 8.03e9
LAYERS = 32
KV_HEADS = 8
HEAD_DIM = 128
HIDDEN = 4096
KV_BYTES_PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_DIM * 2  # 131072 bytes, bf16 K and V
# Memory bandwidth by card (the H200's measured copy rate; the H100's specification), for the card
# named in OUTDIR/nvidia-smi.txt; HBM_BYTES_PER_S overrides.
CARD_BYTES_PER_S = {"H200": 4.3e12, "H100": 3.35e12}
HBM_BYTES_PER_S = 4.3e12
CARD = "H200"
GEMM_FLOP_PER_S = 800e12


def load_reports(outdir, prefix):
    """[(n, report or None, problem)] for every OUTDIR/prefix_<n>.json, sorted by n."""
    found = []
    for path in glob.glob(os.path.join(outdir, f"{prefix}_*.json")):
        m = re.fullmatch(rf"{prefix}_(\d+)\.json", os.path.basename(path))
        if not m:
            continue
        try:
            with open(path) as f:
                report = json.load(f)
            if not isinstance(report, dict):
                raise ValueError("not a JSON object")
            found.append((int(m.group(1)), report, None))
        except (OSError, ValueError) as e:
            found.append((int(m.group(1)), None, f"unreadable ({e.__class__.__name__})"))
    return sorted(found, key=lambda t: t[0])


def pct(report, series, key):
    """report[series][key] as a float, or None."""
    value = (report.get(series) or {}).get(key)
    return float(value) if isinstance(value, (int, float)) else None


def num(report, key):
    value = report.get(key)
    return float(value) if isinstance(value, (int, float)) else None


def fmt(value, spec=".1f", unit=""):
    return "-" if value is None else f"{value:{spec}}{unit}"


def means(report):
    """(mean prompt tokens, mean output tokens) over completed requests, server-counted, or Nones."""
    done = report.get("requests_completed") or 0
    if not done:
        return None, None
    inp, out = num(report, "input_tokens"), num(report, "output_tokens")
    return (inp / done if inp is not None else None, out / done if out is not None else None)


def requested(report):
    """(requested input, requested output) per request, from the first request summary."""
    reqs = report.get("requests") or []
    for r in reqs:
        if not r.get("injected"):
            return r.get("requested_input_tokens"), r.get("requested_output_tokens")
    return None, None


def done_cell(report):
    """`completed/sent`, with the error kinds when some failed."""
    sent, done = report.get("requests_sent", 0), report.get("requests_completed", 0)
    cell = f"{done}/{sent}"
    errors = report.get("errors") or {}
    if errors:
        cell += " (" + ", ".join(f"{k} {v}" for k, v in sorted(errors.items())) + ")"
    return cell


def length_note(report):
    """A warning when outputs were not the requested length (the ceilings assume they were)."""
    lengths = report.get("lengths") or {}
    short = lengths.get("output_shorter", 0) + lengths.get("output_longer", 0)
    return f"; {short} outputs not the requested length" if short else ""


def tpot_ms(report):
    """Mean over completed requests of (E2E - TTFT) / (output tokens - 1): the time per output token
    after the first, counted in tokens rather than in streamed chunks."""
    values = []
    for r in report.get("requests") or []:
        ttft, e2e, n = r.get("ttft_ms"), r.get("e2e_ms"), r.get("completion_tokens")
        if r.get("status") == "ok" and ttft is not None and e2e is not None and n and n > 1:
            values.append((e2e - ttft) / (n - 1))
    return sum(values) / len(values) if values else None


def chunk_share(report):
    """The share of output tokens that did not arrive as a chunk of their own, or None."""
    check = report.get("token_check") or {}
    reported, streamed = check.get("output_tokens_reported") or 0, check.get("output_tokens_streamed") or 0
    if check.get("usage_stream_mismatches") and reported:
        return (reported - streamed) / reported
    return None


def workload(rows, fallback):
    """The workload description of the first readable report."""
    for _, report, _ in rows:
        if report and report.get("workload"):
            return report["workload"]
    return fallback


def missing_row(n, problem, columns):
    return f"| {n} | {problem} |" + " - |" * (columns - 2)


def table_head(title, columns, rows, kind):
    """A markdown table's title, header and alignment rows, with one row saying so when no report exists."""
    out = [title, "", "| " + " | ".join(columns) + " |", "|" + "|".join("---" if i == 1 else "---:" for i in range(len(columns))) + "|"]
    if not rows:
        out.append(f"| - | no {kind}_*.json found |" + " - |" * (len(columns) - 2))
    return out


def note_lengths(report, label, notes, chunked):
    """Collect a run's length note and its share of chunk-less tokens."""
    note = length_note(report)
    if note:
        notes.append(f"{label}{note}")
    share = chunk_share(report)
    if share is not None:
        chunked.append(f"{label} {100 * share:.1f}%")


def decode_table(outdir, notes, chunked):
    rows = load_reports(outdir, "decode")
    out = table_head(
        f"## Decode: {workload(rows, 'fixed (input 512, output 256 tokens)')}",
        ["batch B", "completed/sent", "output tok/s", "ITL p50 ms", "ITL p99 ms", "TPOT ms", "avg context",
         "ceiling step ms", "% of ceiling", "achieved GB/s"],
        rows, "decode")
    for b, report, problem in rows:
        if report is None:
            out.append(missing_row(b, problem, 10))
            continue
        prompt, output = means(report)
        if prompt is None or output is None:
            req_in, req_out = requested(report)
            prompt = prompt if prompt is not None else (req_in or 512)
            output = output if output is not None else (req_out or 256)
        avg_context = prompt + output / 2
        step = pct(report, "itl_ms", "p50")
        kv_bytes = b * avg_context * KV_BYTES_PER_TOKEN
        ceiling_ms = (WEIGHT_BYTES + kv_bytes) / HBM_BYTES_PER_S * 1e3
        fraction = ceiling_ms / step if step else None
        achieved = (WEIGHT_BYTES + kv_bytes) / (step / 1e3) / 1e9 if step else None
        out.append(
            f"| {b} | {done_cell(report)} | {fmt(num(report, 'output_tokens_per_s'))} | {fmt(step, '.2f')} | "
            f"{fmt(pct(report, 'itl_ms', 'p99'), '.2f')} | {fmt(tpot_ms(report), '.2f')} | {avg_context:.0f} | {ceiling_ms:.2f} | "
            f"{fmt(None if fraction is None else 100 * fraction, '.0f', '%')} | {fmt(achieved, '.0f')} |"
        )
        note_lengths(report, f"decode B={b}", notes, chunked)
    out += [
        "",
        f"Ceiling step = (weight bytes {WEIGHT_BYTES / 1e9:.2f} GB + B x avg context x {KV_BYTES_PER_TOKEN} KV bytes "
        f"per token) / {HBM_BYTES_PER_S / 1e12:.2f} TB/s ({CARD}); measured step = ITL p50; % of ceiling = ceiling / measured. "
        f"Achieved GB/s = the same bytes / ITL p50. TPOT = mean per request of (E2E - TTFT) / (tokens - 1), "
        f"a cross-check of the step time counted in tokens. Output tok/s is the aggregate over the whole run "
        f"(including prefill and the ramp-down of the last requests).",
    ]
    return out


def prefill_table(outdir):
    rows = load_reports(outdir, "prefill")
    out = table_head(
        "## Prefill: one request at a time, 1 output token",
        ["prompt P", "completed/sent", "prompt tokens (server)", "TTFT p50 ms", "TTFT p99 ms", "prefill tok/s",
         "TFLOP/s", "% of 800 TFLOP/s"],
        rows, "prefill")
    for p_req, report, problem in rows:
        if report is None:
            out.append(missing_row(p_req, problem, 8))
            continue
        prompt, _ = means(report)
        p = prompt if prompt is not None else float(p_req)
        ttft = pct(report, "ttft_ms", "p50")
        flops = p * (2 * PARAMS + 4 * LAYERS * HIDDEN * p / 2)
        if ttft:
            tok_s = p / (ttft / 1e3)
            tflops = flops / (ttft / 1e3) / 1e12
            fraction = flops / GEMM_FLOP_PER_S / (ttft / 1e3)
        else:
            tok_s = tflops = fraction = None
        out.append(
            f"| {p_req} | {done_cell(report)} | {p:.0f} | {fmt(ttft)} | {fmt(pct(report, 'ttft_ms', 'p99'))} | "
            f"{fmt(tok_s, '.0f')} | {fmt(tflops, '.0f')} | {fmt(None if fraction is None else 100 * fraction, '.0f', '%')} |"
        )
    out += [
        "",
        "FLOPs per prompt = P x (2 x 8.03e9 + 4 x 32 x 4096 x P/2); % = (FLOPs / 800e12) / TTFT p50. "
        "TTFT includes the HTTP round trip and the first sampled token.",
    ]
    return out


def latency_table(outdir, notes, chunked):
    rows = load_reports(outdir, "latency")
    out = table_head(
        f"## Latency: {workload(rows, 'fixed (input 512, output 128 tokens)')}",
        ["concurrency C", "completed/sent", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "TPOT ms",
         "E2E p50 ms", "output tok/s"],
        rows, "latency")
    for c, report, problem in rows:
        if report is None:
            out.append(missing_row(c, problem, 9))
            continue
        out.append(
            f"| {c} | {done_cell(report)} | {fmt(pct(report, 'ttft_ms', 'p50'))} | {fmt(pct(report, 'ttft_ms', 'p99'))} | "
            f"{fmt(pct(report, 'itl_ms', 'p50'), '.2f')} | {fmt(pct(report, 'itl_ms', 'p99'), '.2f')} | "
            f"{fmt(tpot_ms(report), '.2f')} | {fmt(pct(report, 'e2e_ms', 'p50'))} | {fmt(num(report, 'output_tokens_per_s'))} |"
        )
        note_lengths(report, f"latency C={c}", notes, chunked)
    return out


def logits_line(outdir):
    path = os.path.join(outdir, "logits.log")
    try:
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return "not run (no logits.log)"
    results = [l for l in lines if l.startswith("RESULT")]
    if results:
        return results[-1][len("RESULT "):]
    return "no RESULT line in logits.log (see the log)"


def step_lines(outdir):
    """Summary lines of steps.txt (written by bench8b.sh): what failed and what was skipped."""
    try:
        with open(os.path.join(outdir, "steps.txt"), errors="replace") as f:
            entries = [line.strip().split(" ", 1) for line in f if line.strip()]
    except OSError:
        return []
    by_kind = {}
    for entry in entries:
        by_kind.setdefault(entry[0], []).append(entry[1] if len(entry) > 1 else "?")
    lines = [f"- Steps: {len(by_kind.get('ok', []))} ok, {len(by_kind.get('failed', []))} failed, "
             f"{len(by_kind.get('skipped', []))} skipped"]
    for kind in ("failed", "skipped"):
        for what in by_kind.get(kind, []):
            lines.append(f"  - {kind}: {what}")
    return lines


def card_bandwidth(outdir):
    """(card, bytes/s): the card named in OUTDIR/nvidia-smi.txt and its bandwidth (H200 when unknown)."""
    card = "H200"
    try:
        with open(os.path.join(outdir, "nvidia-smi.txt")) as f:
            text = f.read()
        card = next((c for c in CARD_BYTES_PER_S if c in text), card)
    except OSError:
        pass
    bw = float(os.environ.get("HBM_BYTES_PER_S", CARD_BYTES_PER_S[card]))
    return card, bw


def main():
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) == 2 else 2)
    outdir = sys.argv[1]
    global CARD, HBM_BYTES_PER_S
    CARD, HBM_BYTES_PER_S = card_bandwidth(outdir)
    notes, chunked = [], []
    weights = "random bf16 weights" if WEIGHT_BYTES == 16.06e9 else f"weights of {WEIGHT_BYTES / 1e9:.2f} GB"
    lines = [
        f"# corridor on one {CARD}: Llama-3-8B shape, {weights}",
        "",
        f"Reports from `{outdir}`.",
        "",
        f"- Logits against transformers (float32): {logits_line(outdir)}",
    ]
    lines += step_lines(outdir)
    for name in ("memory.txt", "metrics.txt", "serve.log"):
        if os.path.isfile(os.path.join(outdir, name)):
            lines.append(f"- `{name}` is in the directory")
    lines.append("")
    lines += decode_table(outdir, notes, chunked)
    lines.append("")
    lines += prefill_table(outdir)
    lines.append("")
    lines += latency_table(outdir, notes, chunked)
    if chunked:
        notes.append("ITL samples are gaps between streamed chunks; a token with no text of its own (e.g. part of a "
                     "UTF-8 character) arrives with a later one, so some gaps span two steps. Tokens without a "
                     "chunk of their own: " + ", ".join(chunked) + ". TPOT counts tokens and is not affected.")
    if notes:
        lines += ["", "Notes:"] + [f"- {n}" for n in notes]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
