#!/usr/bin/env python3
"""Summarise a Qwen3.5 benchmark directory (written by scripts/gpu/bench_qwen35.sh) as fractions of
the floors, in markdown.

Usage:
    python3 scripts/gpu/qwen35_floors.py OUTDIR MODELDIR

Reads `decode_<B>.json` and `prefill_<P>.json` (`corridor bench --json` reports) in OUTDIR and the
shape from MODELDIR/config.json, the weight bytes from its safetensors headers. Missing or
unreadable reports become rows saying so; nothing here fails.

Floors (one H200; the same yardsticks as summarize_bench.py):
- Decode is bound by memory traffic. One decode step of a batch of B reads every weight once, the
  KV of every sequence in the full-attention layers, and reads and writes every sequence's
  recurrent state in the linear-attention layers (its delta-rule matrices and convolution window,
  f32):
      state bytes per sequence = 2 x linear layers x (v_heads x k_dim x v_dim + (taps-1) x channels) x 4
      KV bytes per token       = full layers x 2 x kv_heads x head_dim x 2
      floor step               = (weights + B x state + B x avg context x KV per token) / 4.3e12 B/s
  The measured step is the ITL p50; the fraction is floor / measured.
- Prefill is bound by tensor-core throughput:
      FLOPs per prompt = P x (2 x parameters + 6 x linear layers x v_heads x k_dim x v_dim)
                         + 4 x full layers x heads x head_dim x P^2 / 2     (causal attention)
      floor            = FLOPs / 800e12 FLOP/s
  (the delta rule's share counts its state decay, read, update and read-out per token and head).
  The measured time is the TTFT p50 of single requests; the fraction is floor / measured.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from summarize_bench import load_reports, means, pct, fmt, done_cell  # noqa: E402
from make_llama8b import safetensors_bytes  # noqa: E402

HBM_BYTES_PER_S = 4.3e12
GEMM_FLOP_PER_S = 800e12


def shape(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    c = c.get("text_config", c)
    types = c.get("layer_types") or [
        "full_attention" if (i + 1) % c.get("full_attention_interval", 4) == 0 else "linear_attention"
        for i in range(c["num_hidden_layers"])
    ]
    linear = sum(t == "linear_attention" for t in types)
    full = len(types) - linear
    kd, vd = c["linear_key_head_dim"], c["linear_value_head_dim"]
    kh, vh = c["linear_num_key_heads"], c["linear_num_value_heads"]
    channels = 2 * kh * kd + vh * vd
    taps = c["linear_conv_kernel_dim"]
    _, weight_bytes = safetensors_bytes(model_dir)
    return dict(
        linear=linear,
        full=full,
        heads=c["num_attention_heads"],
        head_dim=c["head_dim"],
        weight_bytes=weight_bytes,
        params=weight_bytes / 2,
        state_bytes=2 * linear * (vh * kd * vd + (taps - 1) * channels) * 4,
        kv_per_token=full * 2 * c["num_key_value_heads"] * c["head_dim"] * 2,
        delta_flops=6 * linear * vh * kd * vd,
    )


def decode_rows(outdir, s):
    out = [
        "## Decode (fixed workload, 512 in / 256 out)",
        "",
        "| batch B | completed/sent | ITL p50 ms | floor step ms | % of floor | of which state ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    rows = load_reports(outdir, "decode")
    if not rows:
        out.append("| - | no decode_*.json found | - | - | - | - |")
    for b, report, problem in rows:
        if report is None:
            out.append(f"| {b} | {problem} | - | - | - | - |")
            continue
        prompt, output = means(report)
        avg_context = (prompt or 512) + (output or 256) / 2
        step = pct(report, "itl_ms", "p50")
        state = b * s["state_bytes"]
        floor_ms = (s["weight_bytes"] + state + b * avg_context * s["kv_per_token"]) / HBM_BYTES_PER_S * 1e3
        frac = floor_ms / step if step else None
        out.append(
            f"| {b} | {done_cell(report)} | {fmt(step, '.2f')} | {floor_ms:.2f} | "
            f"{fmt(None if frac is None else 100 * frac, '.0f', '%')} | {state / HBM_BYTES_PER_S * 1e3:.2f} |"
        )
    return out


def prefill_rows(outdir, s):
    out = [
        "## Prefill (one request at a time, 1 output token)",
        "",
        "| prompt P | completed/sent | TTFT p50 ms | floor ms | % of floor | prefill tok/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    rows = load_reports(outdir, "prefill")
    if not rows:
        out.append("| - | no prefill_*.json found | - | - | - | - |")
    for p_req, report, problem in rows:
        if report is None:
            out.append(f"| {p_req} | {problem} | - | - | - | - |")
            continue
        prompt, _ = means(report)
        p = prompt if prompt is not None else float(p_req)
        flops = p * (2 * s["params"] + s["delta_flops"]) + 4 * s["full"] * s["heads"] * s["head_dim"] * p * p / 2
        floor_ms = flops / GEMM_FLOP_PER_S * 1e3
        ttft = pct(report, "ttft_ms", "p50")
        frac = floor_ms / ttft if ttft else None
        tok_s = p / (ttft / 1e3) if ttft else None
        out.append(
            f"| {p_req} | {done_cell(report)} | {fmt(ttft)} | {floor_ms:.1f} | "
            f"{fmt(None if frac is None else 100 * frac, '.0f', '%')} | {fmt(tok_s, '.0f')} |"
        )
    return out


def main():
    if len(sys.argv) != 3 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) == 3 else 2)
    outdir, model_dir = sys.argv[1], sys.argv[2]
    try:
        s = shape(model_dir)
    except (OSError, ValueError, KeyError) as e:
        print(f"qwen35_floors: cannot read the shape of {model_dir}: {e}")
        return
    lines = [
        "# corridor on one H200: Qwen3.5-27B shape, random bf16 weights",
        "",
        f"- {s['linear']} linear-attention and {s['full']} full-attention layers; weights {s['weight_bytes'] / 1e9:.2f} GB; "
        f"recurrent state read + written per sequence per step {s['state_bytes'] / 1e6:.0f} MB; "
        f"KV {s['kv_per_token']} bytes per token",
        "",
    ]
    lines += decode_rows(outdir, s) + [""] + prefill_rows(outdir, s)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
