#!/usr/bin/env python3
"""Compare two logit dumps: a float32 reference against the logits under test.

Usage:
    python3 scripts/gpu/compare_logits.py REF.f32 GOT.f32 --vocab 128256 [--tol 0.03]

Both files are raw little-endian float32, row-major [positions, vocab] with no header (what
`hf_logits.py` and `corridor-gpu-check logits` write). For every position it prints

    max|diff|     the largest absolute difference between the two rows
    max|ref|      the largest absolute reference logit
    rel           max|diff| / max|ref|
    argmax        the reference and the tested top-1 token, and whether they agree
    top2 gap      the reference's top-1 minus top-2 logit (how clear the choice is)
    top5          how many of the reference's top-5 tokens are in the tested top-5
    lsm20         the largest |difference| of log-softmax over the reference's top-20 tokens
                  (the probabilities a sampler actually sees)

then a summary for a benchmark report: a line beginning `RESULT` with the verdict.

Verdict: FAIL (exit status 1) when
  - the tested logits contain a NaN or an infinity, or
  - the argmax differs at a position whose reference top-2 gap exceeds 3x the run's typical
    max|diff| (the median over positions of the per-position max|diff|): a clear choice that the
    usual error cannot explain, or
  - the worst per-position relative error max|diff| / max|ref| exceeds --tol (default 0.03;
    bf16 weights, activations and KV cache against a float32 reference).
An argmax difference where the top-2 gap is within 3x the typical error is a near tie: reported,
not failed. (The position's own max|diff| cannot serve as the yardstick: a flipped argmax already
implies a difference of at least half the top-2 gap there, so "gap > 3x its own max|diff|" could
never hold.)
Exit status 2 means the files could not be compared (missing, or sizes that do not match).
"""

import argparse
import os
import sys

import numpy as np


def load(path, vocab):
    """The [positions, vocab] float32 array stored in `path`."""
    if not os.path.isfile(path):
        print(f"compare_logits: {path} does not exist")
        sys.exit(2)
    size = os.path.getsize(path)
    if size == 0 or size % (4 * vocab) != 0:
        print(f"compare_logits: {path} has {size} bytes, not a whole number of rows of {vocab} float32 values")
        sys.exit(2)
    return np.fromfile(path, dtype="<f4").reshape(-1, vocab)


def log_softmax(row):
    """log-softmax of one row, in float64."""
    x = row.astype(np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def top_k(row, k):
    """Indices of the k largest values, largest first."""
    k = min(k, row.shape[0])
    idx = np.argpartition(row, -k)[-k:]
    return idx[np.argsort(row[idx])[::-1]]


def compare_row(ref, got, lsm_k):
    """Statistics of one position."""
    diff = np.abs(ref.astype(np.float64) - got.astype(np.float64))
    max_diff = float(diff.max())
    max_ref = float(np.abs(ref).max())
    ref_top = top_k(ref, max(5, lsm_k, 2))
    got_top5 = top_k(got, 5)
    ref_arg, got_arg = int(ref_top[0]), int(got_top5[0])
    gap = float(ref[ref_top[0]]) - float(ref[ref_top[1]])
    overlap = len(set(ref_top[:5].tolist()) & set(got_top5.tolist()))
    lsm_ref, lsm_got = log_softmax(ref), log_softmax(got)
    sel = ref_top[:lsm_k]
    lsm_diff = float(np.abs(lsm_ref[sel] - lsm_got[sel]).max())
    return dict(
        max_diff=max_diff,
        max_ref=max_ref,
        rel=max_diff / max_ref if max_ref > 0 else (0.0 if max_diff == 0 else float("inf")),
        ref_arg=ref_arg,
        got_arg=got_arg,
        agree=ref_arg == got_arg,
        gap=gap,
        overlap=overlap,
        lsm_diff=lsm_diff,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ref", help="reference logits (raw f32 [positions, vocab])")
    parser.add_argument("got", help="logits under test (raw f32 [positions, vocab])")
    parser.add_argument("--vocab", type=int, required=True, help="vocabulary size (row length)")
    parser.add_argument("--tol", type=float, default=0.03, help="largest allowed max|diff|/max|ref| per position (default 0.03)")
    parser.add_argument("--lsm-top", type=int, default=20, help="reference top-k tokens whose log-softmax is compared (default 20)")
    parser.add_argument("--peer", help="a peer's logits of the same prompt (e.g. transformers in bf16): the tolerance "
                        "becomes 1.5x the peer's own worst relative error against the reference")
    args = parser.parse_args()

    ref = load(args.ref, args.vocab)
    got = load(args.got, args.vocab)
    if ref.shape != got.shape:
        print(f"compare_logits: shapes differ: {args.ref} is {list(ref.shape)}, {args.got} is {list(got.shape)}")
        sys.exit(2)
    positions, vocab = ref.shape
    print(f"compare_logits: {args.ref} vs {args.got}: [{positions} positions, {vocab} vocab]")

    if not np.isfinite(ref).all():
        print("compare_logits: the reference contains NaN or infinite values")
        sys.exit(2)
    bad = ~np.isfinite(got)
    if bad.any():
        rows = sorted(set(np.nonzero(bad)[0].tolist()))
        print(f"compare_logits: the tested logits contain {int(bad.sum())} NaN/infinite values (positions {rows[:20]})")
        print(f"RESULT FAIL: non-finite logits at {len(rows)} of {positions} positions")
        sys.exit(1)

    if args.peer:
        peer = load(args.peer, args.vocab)
        if peer.shape != ref.shape or not np.isfinite(peer).all():
            print(f"compare_logits: the peer {args.peer} does not match the reference's shape or is not finite")
            sys.exit(2)
        peer_stats = [compare_row(ref[p], peer[p], args.lsm_top) for p in range(positions)]
        peer_rel = max(s["rel"] for s in peer_stats)
        peer_agree = sum(s["agree"] for s in peer_stats)
        peer_lsm = max(s["lsm_diff"] for s in peer_stats)
        print(f"peer {args.peer}: worst relative error {peer_rel:.4f}, argmax {peer_agree}/{positions}, "
              f"log-softmax top-{args.lsm_top} max|diff| {peer_lsm:.4f}")
        args.tol = 1.5 * peer_rel
        print(f"tolerance: 1.5 x the peer's worst relative error = {args.tol:.4f}")

    stats = [compare_row(ref[p], got[p], args.lsm_top) for p in range(positions)]
    # The run's usual error; a flipped argmax whose top-2 gap is well above it is a real mistake.
    typical = float(np.median([s["max_diff"] for s in stats]))
    for s in stats:
        s["clear_miss"] = not s["agree"] and s["gap"] > 3.0 * typical

    header = (f"{'pos':>4} {'max|diff|':>10} {'max|ref|':>9} {'rel':>8} {'argmax ref/got':>17} {'':>5} "
              f"{'top2 gap':>9} {'top5':>5} {'lsm' + str(args.lsm_top):>8}")
    print(header)
    for p, s in enumerate(stats):
        mark = "same" if s["agree"] else ("MISS" if s["clear_miss"] else "tie")
        print(f"{p:>4} {s['max_diff']:>10.4f} {s['max_ref']:>9.3f} {s['rel']:>8.4f} "
              f"{s['ref_arg']:>8}/{s['got_arg']:<8} {mark:>5} {s['gap']:>9.4f} {s['overlap']:>3}/5 {s['lsm_diff']:>8.4f}")

    worst = max(range(positions), key=lambda p: stats[p]["rel"])
    worst_rel = stats[worst]["rel"]
    max_diff = max(s["max_diff"] for s in stats)
    max_ref = max(s["max_ref"] for s in stats)
    agree = sum(s["agree"] for s in stats)
    ties = [p for p, s in enumerate(stats) if not s["agree"] and not s["clear_miss"]]
    misses = [p for p, s in enumerate(stats) if s["clear_miss"]]
    overlaps = [s["overlap"] for s in stats]
    lsm_worst = max(s["lsm_diff"] for s in stats)
    mean_abs = float(np.abs(ref.astype(np.float64) - got.astype(np.float64)).mean())

    failures = []
    if misses:
        failures.append(f"argmax differs at clear margins (top-2 gap > 3x the typical max|diff| {typical:.4f}) "
                        f"at positions {misses}")
    if worst_rel > args.tol:
        failures.append(f"relative error {worst_rel:.4f} at position {worst} exceeds the tolerance {args.tol}")

    print()
    print("Summary")
    print(f"  positions x vocab        {positions} x {vocab}")
    print(f"  max |diff|               {max_diff:.4f} (typical per position {typical:.4f}, mean |diff| {mean_abs:.2e}) "
          f"against max |ref| {max_ref:.3f}")
    print(f"  worst relative error     {worst_rel:.4f} at position {worst} (tolerance {args.tol})")
    print(f"  argmax agrees            {agree}/{positions}"
          + (f"; near ties (top-2 gap within 3x the typical error) at {ties}" if ties else "")
          + (f"; clear misses at {misses}" if misses else ""))
    print(f"  top-5 overlap            mean {np.mean(overlaps):.2f}/5, min {min(overlaps)}/5")
    print(f"  log-softmax, ref top-{args.lsm_top}  max |diff| {lsm_worst:.4f} nats")
    verdict = "FAIL" if failures else "PASS"
    print(f"RESULT {verdict}: argmax {agree}/{positions}, top-5 overlap {np.mean(overlaps):.2f}/5, "
          f"rel err {worst_rel:.4f} (tol {args.tol}), max|diff| {max_diff:.4f}, "
          f"log-softmax top-{args.lsm_top} max|diff| {lsm_worst:.4f}")
    for f in failures:
        print(f"  FAIL: {f}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
