#!/usr/bin/env python3
"""Create a Qwen3.5-27B-shaped checkpoint with random bf16 weights, for benchmarks.

Usage:
    python3 scripts/gpu/make_qwen35_27b.py OUTDIR --tokenizer-dir DIR [--seed 0] [--device cuda] [--layers N]
                                              [--vocab N]

The shape is the text model of Qwen3.5-27B (`qwen3_5_text`), as far as it is known here:

- 64 layers, every fourth full attention (layer_types from full_attention_interval 4): 48 gated
  delta-net layers and 16 full-attention layers;
- hidden 5120, FFN 17408, vocabulary 248320, untied lm_head;
- full attention: 24 query heads (q_proj doubled for the output gate) and 4 KV heads of 256,
  a quarter of each head rotated (partial_rotary_factor 0.25), rope theta 10^7;
- linear attention: 16 key heads and 48 value heads of 128 (three value heads per key head,
  grouped as transformers orders them), a 4-tap causal convolution.

The linear-attention head counts are an assumption (the published config was not at hand when this
was written); every other field follows the published model card. The parameters come to about
26.9e9 (53.8 GB in bf16). --layers N keeps the first N layers, for a quick test of the pipeline;
--vocab N replaces the vocabulary size (a server detokenizes every sampled id, so a model served
with a smaller tokenizer than its vocabulary must not have more rows than the tokenizer has ids).

Values: every matrix is drawn from N(0, 0.02) from a generator seeded with --seed; the zero-centred
RMSNorm weights (applied as 1 + w) are zero and the delta-net's gated norm weights one; A_log is
log(U(1, 16)) and dt_bias one, transformers' own initialisation of the decay. Built directly on the
device in bfloat16 and written with `save_pretrained(OUTDIR, safe_serialization=True)`; the
tokenizer files are copied from --tokenizer-dir (any tokenizer whose ids fall inside the vocabulary:
the benchmark uses Llama 3's, whose BOS and EOS ids the config names).

Idempotent: when OUTDIR already holds config.json and every safetensors file the checkpoint
names, the weights are not rebuilt.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_llama8b import checkpoint_complete, copy_tokenizer, parameter_bytes, safetensors_bytes  # noqa: E402

# Qwen3.5-27B's text shape (see the module doc for what is assumed).
QWEN35_27B = dict(
    vocab_size=248320,
    hidden_size=5120,
    intermediate_size=17408,
    num_hidden_layers=64,
    full_attention_interval=4,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    attention_bias=False,
    # Llama 3's BOS and EOS: the benchmark serves the model with that tokenizer.
    bos_token_id=128000,
    eos_token_id=128001,
)


def make_config(layers=None, vocab=None):
    from transformers import Qwen3_5TextConfig

    fields = dict(QWEN35_27B)
    if layers is not None:
        fields["num_hidden_layers"] = layers
    if vocab is not None:
        fields["vocab_size"] = vocab
    config = Qwen3_5TextConfig(
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        **fields,
    )
    config.dtype = "bfloat16"
    config.architectures = ["Qwen3_5ForCausalLM"]
    return config


def build(config, device, seed):
    import torch
    from transformers import Qwen3_5ForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen3_5ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model = model.to(dtype=torch.bfloat16)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    with torch.no_grad():
        # named_parameters() has a fixed order, so the draws are reproducible.
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                param.fill_(1.0)
            elif "norm" in name:
                param.zero_()
            elif name.endswith("A_log"):
                param.uniform_(1.0, 16.0, generator=generator).log_()
            elif name.endswith("dt_bias"):
                param.fill_(1.0)
            else:
                param.normal_(mean=0.0, std=0.02, generator=generator)
    model.eval()
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir", help="where to write the checkpoint")
    parser.add_argument("--tokenizer-dir", required=True, help="directory with tokenizer.json and tokenizer_config.json")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    parser.add_argument("--device", default="cuda", help="where to build the weights (default cuda)")
    parser.add_argument("--layers", type=int, default=None, help="keep only the first N layers (default: all 64)")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 248320)")
    args = parser.parse_args()

    os.makedirs(args.outdir, exist_ok=True)
    if checkpoint_complete(args.outdir):
        copy_tokenizer(args.tokenizer_dir, args.outdir)
        tensors, size = safetensors_bytes(args.outdir)
        print(f"make_qwen35_27b: {args.outdir} already holds a complete checkpoint; not rebuilt")
        print(f"make_qwen35_27b: {tensors} tensors, parameter bytes {size:,} ({size / 1e9:.2f} GB)")
        return

    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("make_qwen35_27b: CUDA is not available (pass --device cpu to build on the host, slowly)")
    t0 = time.time()
    model = build(make_config(args.layers, args.vocab), args.device, args.seed)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    t1 = time.time()
    count, size = parameter_bytes(model)
    print(f"make_qwen35_27b: built {count:,} parameters on {args.device} in {t1 - t0:.1f} s")
    model.save_pretrained(args.outdir, safe_serialization=True)
    copy_tokenizer(args.tokenizer_dir, args.outdir)
    t2 = time.time()
    tensors, on_disk = safetensors_bytes(args.outdir)
    print(f"make_qwen35_27b: saved {tensors} tensors to {args.outdir} in {t2 - t1:.1f} s")
    print(f"make_qwen35_27b: parameters {count:,}, parameter bytes {size:,} ({size / 1e9:.2f} GB, bf16; {on_disk / 1e9:.2f} GB on disk)")


if __name__ == "__main__":
    main()
