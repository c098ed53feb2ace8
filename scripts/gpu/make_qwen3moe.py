#!/usr/bin/env python3
"""Create a Qwen3-30B-A3B-shaped checkpoint with random bf16 weights, for benchmarks.

Usage:
    python3 scripts/gpu/make_qwen3moe.py OUTDIR --tokenizer-dir DIR [--seed 0] [--device cuda]
                                         [--layers 48]

The model has the shape of Qwen3-30B-A3B (48 layers, hidden 2048, 32 query heads and 4 KV heads of
128, every layer sparse: 128 experts of FFN 768 with 8 chosen per token and renormalized weights,
vocabulary 151936, untied lm_head, rope theta 1e6), so weight sizes, the bytes a token reads,
kernel shapes and timings match the real model. Only the values are random:

- every matrix is drawn from N(0, 0.02), the Hugging Face default initialiser range, from a
  generator seeded with --seed, in a fixed order, so two runs give the same checkpoint on the same
  device;
- every RMSNorm weight (input, post-attention, q/k norms, final) is one.

The tensors are written directly with `safetensors` under the Hugging Face Qwen3-MoE names (one
tensor per expert, `model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`, the router as
`model.layers.L.mlp.gate.weight`), in shards of about 4 GB with a `model.safetensors.index.json`,
plus a `config.json` (`Qwen3MoeForCausalLM`, `qwen3_moe`). No model object is built, so it needs
torch and safetensors only, and memory for one shard at a time. `tokenizer.json` and
`tokenizer_config.json` are copied from --tokenizer-dir; its ids must stay below the vocabulary
(a Qwen tokenizer; a Llama-3 one, whose 128256 ids fit, serves for timing too, and its BOS/EOS ids
are then written into the config).

Idempotent: when OUTDIR already holds config.json and every shard the index names, nothing is
rebuilt (missing tokenizer files are still copied).

Prints the parameter count, the total parameter bytes (about 61 GB) and the bytes one decoded
token reads at batch 1 (attention, the router, 8 experts per layer, one embedding row, lm_head).
"""

import argparse
import json
import math
import os
import shutil
import sys
import time

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
SHARD_BYTES = 4 << 30

# Qwen3-30B-A3B's shape.
SHAPE = dict(
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    vocab_size=151936,
)


def config_json(layers, bos, eos):
    c = dict(SHAPE)
    c.update(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        num_hidden_layers=layers,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        attention_bias=False,
        hidden_act="silu",
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=bos,
        eos_token_id=eos,
        torch_dtype="bfloat16",
    )
    return c


def tensor_list(layers):
    """(name, shape) of every tensor, in the order they are drawn."""
    s = SHAPE
    h, hd = s["hidden_size"], s["head_dim"]
    q, kv, ef = s["num_attention_heads"] * hd, s["num_key_value_heads"] * hd, s["moe_intermediate_size"]
    out = [("model.embed_tokens.weight", (s["vocab_size"], h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "self_attn.q_norm.weight", (hd,)),
            (p + "self_attn.k_norm.weight", (hd,)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate.weight", (s["num_experts"], h)),
        ]
        for e in range(s["num_experts"]):
            x = f"{p}mlp.experts.{e}."
            out += [(x + "gate_proj.weight", (ef, h)), (x + "up_proj.weight", (ef, h)), (x + "down_proj.weight", (h, ef))]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (s["vocab_size"], h))]
    return out


def token_read_bytes(layers):
    """Bytes of weights one decoded token reads at batch 1, bf16."""
    s = SHAPE
    h, hd = s["hidden_size"], s["head_dim"]
    q, kv, ef = s["num_attention_heads"] * hd, s["num_key_value_heads"] * hd, s["moe_intermediate_size"]
    attention = q * h + 2 * kv * h + h * q
    router = s["num_experts"] * h
    experts = s["num_experts_per_tok"] * 3 * ef * h
    return 2 * (layers * (attention + router + experts) + h + s["vocab_size"] * h)


def complete(outdir):
    """True when OUTDIR holds config.json, the index and every (non-empty) shard it names."""
    index = os.path.join(outdir, "model.safetensors.index.json")
    if not (os.path.isfile(os.path.join(outdir, "config.json")) and os.path.isfile(index)):
        return False
    try:
        with open(index) as f:
            shards = set(json.load(f)["weight_map"].values())
    except (OSError, ValueError, KeyError):
        return False
    paths = [os.path.join(outdir, n) for n in shards]
    return bool(paths) and all(os.path.isfile(p) and os.path.getsize(p) > 0 for p in paths)


def copy_tokenizer(tokenizer_dir, outdir):
    for name in TOKENIZER_FILES:
        src, dst = os.path.join(tokenizer_dir, name), os.path.join(outdir, name)
        if os.path.isfile(dst):
            continue
        if not os.path.isfile(src):
            sys.exit(f"make_qwen3moe: {src} is missing (--tokenizer-dir must hold {', '.join(TOKENIZER_FILES)})")
        shutil.copyfile(src, dst)


def tokenizer_ids(tokenizer_dir):
    """How many ids the tokenizer in TOKENIZER_DIR has: one past its largest, added tokens included."""
    with open(os.path.join(tokenizer_dir, "tokenizer.json")) as f:
        t = json.load(f)
    return 1 + max(list(t["model"]["vocab"].values()) + [a["id"] for a in t.get("added_tokens", [])])


def special_ids(tokenizer_dir):
    """(bos, eos) ids from the tokenizer's added tokens: Qwen's or Llama 3's, else Qwen's defaults."""
    try:
        with open(os.path.join(tokenizer_dir, "tokenizer.json")) as f:
            added = {t["content"]: t["id"] for t in json.load(f).get("added_tokens", [])}
    except (OSError, ValueError, KeyError):
        added = {}
    if "<|begin_of_text|>" in added:
        return added["<|begin_of_text|>"], added.get("<|end_of_text|>", added["<|begin_of_text|>"])
    eos = added.get("<|endoftext|>", 151643)
    return eos, added.get("<|im_end|>", eos)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir")
    parser.add_argument("--tokenizer-dir", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"], help="layers (default 48; fewer for a quick try)")
    parser.add_argument(
        "--vocab",
        help="vocabulary rows (default 151936), or `tokenizer`: as many as --tokenizer-dir has ids. A server "
        "detokenizes every sampled id, and random logits pick the padding rows past a tokenizer's ids, so "
        "serve with no more rows than the tokenizer has ids",
    )
    args = parser.parse_args()
    if args.vocab:
        SHAPE["vocab_size"] = tokenizer_ids(args.tokenizer_dir) if args.vocab == "tokenizer" else int(args.vocab)

    os.makedirs(args.outdir, exist_ok=True)
    tensors = tensor_list(args.layers)
    count = sum(math.prod(sh) for _, sh in tensors)
    read = token_read_bytes(args.layers)
    if complete(args.outdir):
        copy_tokenizer(args.tokenizer_dir, args.outdir)
        print(f"make_qwen3moe: {args.outdir} already holds a complete checkpoint; not rebuilt")
    else:
        import torch
        from safetensors.torch import save_file

        if args.device.startswith("cuda") and not torch.cuda.is_available():
            sys.exit("make_qwen3moe: CUDA is not available (pass --device cpu to build on the host, slowly)")
        t0 = time.time()
        gen = torch.Generator(device=args.device)
        gen.manual_seed(args.seed)
        weight_map, shard, shard_bytes, shards = {}, {}, 0, []

        def flush():
            nonlocal shard, shard_bytes
            if not shard:
                return
            name = f"model-{len(shards) + 1:05d}.safetensors"
            save_file(shard, os.path.join(args.outdir, name), metadata={"format": "pt"})
            for k in shard:
                weight_map[k] = name
            shards.append(name)
            shard, shard_bytes = {}, 0

        for name, shape in tensors:
            if len(shape) == 1:
                t = torch.ones(shape, dtype=torch.bfloat16)
            else:
                t = torch.empty(shape, dtype=torch.bfloat16, device=args.device)
                t.normal_(mean=0.0, std=0.02, generator=gen)
                t = t.cpu()
            shard[name] = t
            shard_bytes += t.numel() * 2
            if shard_bytes >= SHARD_BYTES:
                flush()
        flush()
        # Shard names carry the total, as transformers writes them.
        final = {}
        for i, old in enumerate(shards):
            new = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            os.replace(os.path.join(args.outdir, old), os.path.join(args.outdir, new))
            final[old] = new
        index = {
            "metadata": {"total_size": 2 * count},
            "weight_map": {k: final[v] for k, v in weight_map.items()},
        }
        bos, eos = special_ids(args.tokenizer_dir)
        with open(os.path.join(args.outdir, "config.json"), "w") as f:
            json.dump(config_json(args.layers, bos, eos), f, indent=2)
        with open(os.path.join(args.outdir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
        copy_tokenizer(args.tokenizer_dir, args.outdir)
        print(f"make_qwen3moe: wrote {len(tensors)} tensors in {len(shards)} shards in {time.time() - t0:.1f} s")
    print(f"make_qwen3moe: parameters {count:,}, parameter bytes {2 * count:,} ({2 * count / 1e9:.2f} GB, bf16)")
    print(f"make_qwen3moe: bytes one token reads at batch 1: {read:,} ({read / 1e9:.3f} GB)")


if __name__ == "__main__":
    main()
