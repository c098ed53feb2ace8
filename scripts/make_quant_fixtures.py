#!/usr/bin/env python3
"""Tiny llama checkpoints quantized by llama.cpp's own quantizer (tests/fixtures/tiny/kquant/).

Run by hand, not in CI:

    pip install cmake ninja numpy
    scripts/build_llama_cpp.sh            # builds target/llama.cpp/build/bin/llama-quantize
    python3 scripts/make_quant_fixtures.py

It writes `llama-k-f16.gguf`, a random-weight llama whose every matrix row is a whole number of
256-weight K-quant super-blocks (hidden 256, intermediate 512), so llama-quantize applies its real
per-tensor mixes instead of falling back to other types for narrow rows; then one file per llama.cpp
file type (`llama-k-Q4_K_M.gguf`, ...) made by `llama-quantize`, and `types.json` with the storage
type of every tensor of every file, as llama-quantize chose it. Likewise `qwen3moe-k-f16.gguf`, a
random-weight qwen3moe of the same widths (8 experts of width 256, 2 a token, stacked as llama.cpp's
converter lays them out, Qwen3's q/k norms), and its `MOE_FILE_TYPES` (the mixed files people
download for Qwen3-30B-A3B: experts Q4_K, the last layer's down projections Q6_K). The tokenizer is the one of
`tests/fixtures/tiny/llama-bf16.gguf` (vocab 384); one layer keeps the files small (llama-quantize
still applies its per-layer rules: a lone layer counts as a first and a last one). Weights come from a fixed numpy seed, so a
re-run with the same numpy and llama.cpp writes the same files.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ROOT / "target/llama.cpp"
sys.path.insert(0, str(LLAMA / "src/vendor/llama.cpp/gguf-py"))

import numpy as np  # noqa: E402
import gguf  # noqa: E402

HIDDEN = 256
INTERMEDIATE = 512
LAYERS = 1
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
CONTEXT = 256
# llama.cpp file types, named as llama-quantize takes them.
FILE_TYPES = ["Q4_K_M", "Q5_K_M", "Q6_K", "Q3_K_M", "Q2_K", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS"]
# The mixture of experts: experts, experts a token, one expert's width.
EXPERTS = 8
TOP_K = 2
EXPERT_FFN = 256
MOE_FILE_TYPES = ["Q4_K_M"]


def copy_tokenizer(src: Path, w: gguf.GGUFWriter) -> int:
    """Copies every `tokenizer.*` key of `src` into `w`; returns the vocabulary size."""
    r = gguf.GGUFReader(str(src))
    vocab = 0
    for key, field in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, value, field.types[0], sub_type=field.types[-1])
            if key == "tokenizer.ggml.tokens":
                vocab = len(value)
        else:
            w.add_key_value(key, value, field.types[0])
    return vocab


def start(path: Path, arch: str, name: str, eps: float, rope_base: float) -> tuple[gguf.GGUFWriter, int]:
    """A writer of `arch` with the tokenizer and the keys both models share; returns the vocabulary size."""
    w = gguf.GGUFWriter(str(path), arch)
    vocab = copy_tokenizer(ROOT / "tests/fixtures/tiny/llama-bf16.gguf", w)
    w.add_name(name)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(INTERMEDIATE)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(eps)
    w.add_rope_freq_base(rope_base)
    return w, vocab


# std 1/sqrt(fan-in) keeps activations of order 1 through the layers, so the
# logits are spread out rather than saturated or nearly tied.
def matrix(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale / np.sqrt(shape[-1])).astype(np.float16)


def norm(rng: np.random.Generator, n: int) -> np.ndarray:
    return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)


def add_attention(w: gguf.GGUFWriter, rng: np.random.Generator, p: str, qk_norms: bool) -> None:
    """Layer `p`'s attention with its norm (and Qwen3's q/k norms), then the FFN's norm."""
    w.add_tensor(p + "attn_norm.weight", norm(rng, HIDDEN))
    w.add_tensor(p + "attn_q.weight", matrix(rng, HEADS * HEAD_DIM, HIDDEN))
    w.add_tensor(p + "attn_k.weight", matrix(rng, KV_HEADS * HEAD_DIM, HIDDEN))
    w.add_tensor(p + "attn_v.weight", matrix(rng, KV_HEADS * HEAD_DIM, HIDDEN))
    if qk_norms:
        w.add_tensor(p + "attn_q_norm.weight", norm(rng, HEAD_DIM))
        w.add_tensor(p + "attn_k_norm.weight", norm(rng, HEAD_DIM))
    w.add_tensor(p + "attn_output.weight", matrix(rng, HIDDEN, HEADS * HEAD_DIM))
    w.add_tensor(p + "ffn_norm.weight", norm(rng, HIDDEN))


def finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_f16(path: Path) -> None:
    rng = np.random.default_rng(20261201)
    w, vocab = start(path, "llama", "llama-k-f16", 1e-5, 10000.0)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tensor("token_embd.weight", (rng.standard_normal((vocab, HIDDEN))).astype(np.float16))
    for i in range(LAYERS):
        p = f"blk.{i}."
        add_attention(w, rng, p, qk_norms=False)
        w.add_tensor(p + "ffn_gate.weight", matrix(rng, INTERMEDIATE, HIDDEN))
        w.add_tensor(p + "ffn_up.weight", matrix(rng, INTERMEDIATE, HIDDEN))
        w.add_tensor(p + "ffn_down.weight", matrix(rng, HIDDEN, INTERMEDIATE))
    w.add_tensor("output_norm.weight", norm(rng, HIDDEN))
    w.add_tensor("output.weight", matrix(rng, vocab, HIDDEN, scale=2.0))
    finish(w)


def write_moe_f16(path: Path) -> None:
    """A qwen3moe GGUF as llama.cpp's converter writes it: a router (`ffn_gate_inp`, F32) and the
    experts stacked per layer (`ffn_{gate,up,down}_exps`, numpy shape [experts, rows, cols])."""
    rng = np.random.default_rng(20261207)
    w, vocab = start(path, "qwen3moe", "qwen3moe-k-f16", 1e-6, 1000000.0)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_expert_count(EXPERTS)
    w.add_expert_used_count(TOP_K)
    w.add_expert_feed_forward_length(EXPERT_FFN)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tensor("token_embd.weight", (rng.standard_normal((vocab, HIDDEN))).astype(np.float16))
    for i in range(LAYERS):
        p = f"blk.{i}."
        add_attention(w, rng, p, qk_norms=True)
        # A router of large logits: the top experts of a token stand apart, so the quantized
        # files route most tokens as the f16 file does.
        w.add_tensor(p + "ffn_gate_inp.weight", matrix(rng, EXPERTS, HIDDEN, scale=4.0).astype(np.float32))
        w.add_tensor(p + "ffn_gate_exps.weight", matrix(rng, EXPERTS, EXPERT_FFN, HIDDEN))
        w.add_tensor(p + "ffn_up_exps.weight", matrix(rng, EXPERTS, EXPERT_FFN, HIDDEN))
        w.add_tensor(p + "ffn_down_exps.weight", matrix(rng, EXPERTS, HIDDEN, EXPERT_FFN))
    w.add_tensor("output_norm.weight", norm(rng, HIDDEN))
    w.add_tensor("output.weight", matrix(rng, vocab, HIDDEN, scale=2.0))
    finish(w)


def tensor_types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "tests/fixtures/tiny/kquant")
    ap.add_argument("--quantize", type=Path, default=LLAMA / "build/bin/llama-quantize")
    args = ap.parse_args()
    if not args.quantize.exists():
        print(f"missing {args.quantize}: run scripts/build_llama_cpp.sh first", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    src = args.out / "llama-k-f16.gguf"
    write_f16(src)
    types = {"llama-k-f16.gguf": tensor_types(src)}
    for ft in FILE_TYPES:
        dst = args.out / f"llama-k-{ft}.gguf"
        subprocess.run([str(args.quantize), str(src), str(dst), ft, "1"], check=True,
                       stdout=subprocess.DEVNULL)
        types[dst.name] = tensor_types(dst)
        print(dst.name, sorted(set(types[dst.name].values())), dst.stat().st_size, "bytes")
    moe = args.out / "qwen3moe-k-f16.gguf"
    write_moe_f16(moe)
    types[moe.name] = tensor_types(moe)
    for ft in MOE_FILE_TYPES:
        dst = args.out / f"qwen3moe-k-{ft}.gguf"
        subprocess.run([str(args.quantize), str(moe), str(dst), ft, "1"], check=True,
                       stdout=subprocess.DEVNULL)
        types[dst.name] = tensor_types(dst)
        print(dst.name, sorted(set(types[dst.name].values())), dst.stat().st_size, "bytes")
    (args.out / "types.json").write_text(json.dumps(types, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
