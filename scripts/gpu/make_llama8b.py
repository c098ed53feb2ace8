#!/usr/bin/env python3
"""Create a Llama-3-8B-shaped checkpoint with random bf16 weights, for benchmarks.

Usage:
    python3 scripts/gpu/make_llama8b.py OUTDIR --tokenizer-dir DIR [--seed 0] [--device cuda]

The model has exactly the shape of Meta-Llama-3-8B (32 layers, hidden 4096, FFN 14336, 32 query
heads and 8 KV heads of 128, vocabulary 128256, untied lm_head, rope theta 500000), so weight and
KV-cache sizes, kernel shapes and timings match the real model. Only the values are random:

- every matrix (embedding, projections, lm_head) is drawn from N(0, 0.02), the Hugging Face
  default initialiser range, from a generator seeded with --seed, so two runs produce the same
  checkpoint on the same device;
- every RMSNorm weight is one.

The model is built directly on the device ("cuda" by default) in bfloat16, which takes seconds, and
written with `save_pretrained(OUTDIR, safe_serialization=True)` (safetensors shards, config.json,
generation_config.json). `tokenizer.json` and `tokenizer_config.json` are copied from
--tokenizer-dir (a Llama-3 tokenizer) so the directory can be served as it is.

Idempotent: when OUTDIR already holds config.json and every safetensors file the checkpoint
names, the weights are not rebuilt (missing tokenizer files are still copied).

Prints the parameter count and the total parameter bytes (16.06 GB for this shape).
"""

import argparse
import json
import os
import shutil
import sys
import time

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# Meta-Llama-3-8B's shape.
LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=128000,
    eos_token_id=128001,
)


def checkpoint_complete(outdir):
    """True when OUTDIR holds config.json and all the safetensors weights it needs."""
    if not os.path.isfile(os.path.join(outdir, "config.json")):
        return False
    single = os.path.join(outdir, "model.safetensors")
    if os.path.isfile(single) and os.path.getsize(single) > 0:
        return True
    index = os.path.join(outdir, "model.safetensors.index.json")
    if not os.path.isfile(index):
        return False
    try:
        with open(index) as f:
            shards = set(json.load(f)["weight_map"].values())
    except (OSError, ValueError, KeyError):
        return False
    return bool(shards) and all(
        os.path.isfile(os.path.join(outdir, s)) and os.path.getsize(os.path.join(outdir, s)) > 0 for s in shards
    )


def copy_tokenizer(tokenizer_dir, outdir):
    """Copy the tokenizer files into OUTDIR (skipping those already there)."""
    for name in TOKENIZER_FILES:
        src = os.path.join(tokenizer_dir, name)
        dst = os.path.join(outdir, name)
        if os.path.isfile(dst):
            continue
        if not os.path.isfile(src):
            sys.exit(f"make_llama8b: {src} is missing (--tokenizer-dir must hold {', '.join(TOKENIZER_FILES)})")
        shutil.copyfile(src, dst)


def make_config(**overrides):
    """The LlamaConfig of the checkpoint; overrides replace fields of the Llama-3-8B shape."""
    from transformers import LlamaConfig

    fields = dict(LLAMA3_8B)
    fields.update(overrides)
    config = LlamaConfig(**fields)
    # `dtype` is the current spelling; older transformers read `torch_dtype`.
    config.dtype = "bfloat16"
    config.architectures = ["LlamaForCausalLM"]
    return config


def build(config, device, seed):
    """A LlamaForCausalLM of `config` on `device` in bfloat16 with seeded random weights."""
    import torch
    from transformers import LlamaForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model = model.to(dtype=torch.bfloat16)

    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    with torch.no_grad():
        # named_parameters() has a fixed order, so the draws are reproducible.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(mean=0.0, std=0.02, generator=generator)
    model.eval()
    return model


def safetensors_bytes(outdir):
    """(tensor count, bytes of tensor data) read from the safetensors headers in OUTDIR."""
    count = size = 0
    for name in sorted(os.listdir(outdir)):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(outdir, name), "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len))
        for key, info in header.items():
            if key == "__metadata__":
                continue
            start, end = info["data_offsets"]
            count += 1
            size += end - start
    return count, size


def parameter_bytes(model):
    """(parameter count, bytes) over every parameter, embedding and lm_head included."""
    count = sum(p.numel() for p in model.parameters())
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    return count, size


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir", help="where to write the checkpoint")
    parser.add_argument("--tokenizer-dir", required=True, help="directory with a Llama-3 tokenizer.json and tokenizer_config.json")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    parser.add_argument("--device", default="cuda", help="where to build the weights (default cuda)")
    args = parser.parse_args()

    os.makedirs(args.outdir, exist_ok=True)
    if checkpoint_complete(args.outdir):
        copy_tokenizer(args.tokenizer_dir, args.outdir)
        tensors, size = safetensors_bytes(args.outdir)
        print(f"make_llama8b: {args.outdir} already holds a complete checkpoint; not rebuilt")
        print(f"make_llama8b: {tensors} tensors, parameter bytes {size:,} ({size / 1e9:.2f} GB)")
        return

    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("make_llama8b: CUDA is not available (pass --device cpu to build on the host, slowly)")

    t0 = time.time()
    config = make_config()
    model = build(config, args.device, args.seed)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    t1 = time.time()
    count, size = parameter_bytes(model)
    print(f"make_llama8b: built {count:,} parameters on {args.device} in {t1 - t0:.1f} s")

    model.save_pretrained(args.outdir, safe_serialization=True)
    t2 = time.time()
    copy_tokenizer(args.tokenizer_dir, args.outdir)
    on_disk = sum(
        os.path.getsize(os.path.join(args.outdir, f)) for f in os.listdir(args.outdir) if f.endswith(".safetensors")
    )
    print(f"make_llama8b: saved to {args.outdir} in {t2 - t1:.1f} s ({on_disk / 1e9:.2f} GB of safetensors)")
    print(f"make_llama8b: parameters {count:,}, parameter bytes {size:,} ({size / 1e9:.2f} GB, bf16)")

    del model
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
