#!/usr/bin/env python3
"""Writes expected token ids for the Unigram (t5) vocabulary llama.cpp ships
without test strings, into tests/fixtures/vocab/.

llama.cpp's ggml-vocab-nomic-bert-moe.gguf has no .inp/.out pair. This script
rebuilds a SentencePiece model from the GGUF metadata (pieces, scores, piece
types, the compiled normalization rules and the whitespace flags), encodes
the standard llama.cpp test strings (ggml-vocab-llama-spm.gguf.inp) with the
`sentencepiece` library itself, and writes one line of ids per string, in
llama.cpp's .out format, so the Rust tokenizer is compared with SentencePiece.

Run by hand after scripts/fetch_test_assets.sh:

    python3 scripts/make_vocab_fixtures.py [--vocab DIR] [--out DIR]

Needs `sentencepiece` and `protobuf` (pip).
"""

import argparse
import struct
from pathlib import Path

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as model_pb2

SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def read_metadata(path):
    """The key/value section of a GGUF v3 file (tensors are not needed)."""
    with open(path, "rb") as f:

        def scalar(fmt):
            size = struct.calcsize("<" + fmt)
            return struct.unpack("<" + fmt, f.read(size))[0]

        def string():
            return f.read(scalar("Q")).decode("utf-8")

        def value(kind):
            if kind == 8:
                return string()
            if kind == 9:
                item, count = scalar("I"), scalar("Q")
                return [value(item) for _ in range(count)]
            return scalar(SCALARS[kind])

        if f.read(4) != b"GGUF":
            raise SystemExit(f"{path}: not a GGUF file")
        scalar("I")  # version
        scalar("Q")  # tensor count
        meta = {}
        for _ in range(scalar("Q")):
            key = string()
            meta[key] = value(scalar("I"))
        return meta


def sentencepiece_from_gguf(meta):
    model = model_pb2.ModelProto()
    model.trainer_spec.model_type = model_pb2.TrainerSpec.UNIGRAM
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    if unk is not None:
        model.trainer_spec.unk_id = unk
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    pad = meta.get("tokenizer.ggml.padding_token_id")
    model.trainer_spec.bos_id = -1 if bos is None else bos
    model.trainer_spec.eos_id = -1 if eos is None else eos
    model.trainer_spec.pad_id = -1 if pad is None else pad
    for text, score, kind in zip(
        meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"], meta["tokenizer.ggml.token_type"]
    ):
        piece = model.pieces.add()
        piece.piece = text
        piece.score = score
        piece.type = kind  # GGUF token types use SentencePiece's numbering
    norm = model.normalizer_spec
    norm.name = "gguf"
    norm.precompiled_charsmap = bytes(b & 0xFF for b in meta.get("tokenizer.ggml.precompiled_charsmap", []))
    norm.add_dummy_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    norm.remove_extra_whitespaces = bool(meta.get("tokenizer.ggml.remove_extra_whitespaces", True))
    norm.escape_whitespaces = True
    return spm.SentencePieceProcessor(model_proto=model.SerializeToString())


def main():
    root = Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=Path, default=root / "target/test-assets/llama-cpp-python/vocab")
    parser.add_argument("--out", type=Path, default=root / "tests/fixtures/vocab")
    args = parser.parse_args()

    inp = (args.vocab / "ggml-vocab-llama-spm.gguf.inp").read_text(encoding="utf-8")
    texts = inp.split("\n__ggml_vocab_test__\n")
    if texts and texts[-1] == "":
        texts.pop()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in ["nomic-bert-moe"]:
        sp = sentencepiece_from_gguf(read_metadata(args.vocab / f"ggml-vocab-{name}.gguf"))
        lines = [" ".join(str(i) for i in sp.encode(text)) for text in texts]
        (args.out / f"{name}.out").write_text("".join(f" {line}\n" if line else "\n" for line in lines))
        print(f"{name}: {len(lines)} strings")


if __name__ == "__main__":
    main()
