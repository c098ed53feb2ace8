#!/usr/bin/env python3
"""Reference logits of a Hugging Face checkpoint, computed by transformers in float32.

Usage:
    python3 scripts/gpu/hf_logits.py MODELDIR --ids 128000,791,6864,... --out FILE.f32 [--device cuda]

Loads MODELDIR with `AutoModelForCausalLM` in float32 (bf16 weights are widened exactly), runs one
forward pass over the token ids (no KV cache, eager attention, TF32 disabled so every matmul is a
true float32 product) and writes the logits of every position as raw little-endian float32,
row-major [positions, vocab], to FILE.f32: no header, so the file is exactly
positions * vocab * 4 bytes. `compare_logits.py` reads this format.

With `--dtype bfloat16` the same forward runs in bf16 (weights and activations), which gives the
error a plain bf16 implementation makes against float32: `compare_logits.py --peer` holds corridor
to it.

Prints the shape, the argmax token of each position and the time taken. GPU memory is released
before the script exits. An 8B model takes about 32 GB of device memory in float32.
"""

import argparse
import gc
import sys
import time


def parse_ids(text):
    """Comma-separated token ids -> list of ints."""
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        sys.exit(f"hf_logits: --ids must be comma-separated integers, got {text!r}")
    if not ids:
        sys.exit("hf_logits: --ids is empty")
    return ids


def strict_fp32(torch):
    """Make float32 matmuls and convolutions full precision (no TF32)."""
    try:
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        torch.backends.cudnn.conv.fp32_precision = "ieee"
    except (AttributeError, RuntimeError):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def load(model_dir, device, torch, dtype):
    """The checkpoint as a model of `dtype` on `device`."""
    from transformers import AutoModelForCausalLM

    kwargs = dict(dtype=dtype, attn_implementation="eager")
    if device != "cpu":
        try:
            # Loads the weights straight onto the device.
            return AutoModelForCausalLM.from_pretrained(model_dir, device_map=device, **kwargs)
        except Exception as e:  # e.g. an older transformers that wants `accelerate` for device_map
            print(f"hf_logits: device_map load unavailable ({e}); loading on the host, then moving")
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    return model.to(device)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", help="Hugging Face checkpoint directory (config.json + safetensors)")
    parser.add_argument("--ids", required=True, help="comma-separated token ids, e.g. 128000,791,6864")
    parser.add_argument("--out", required=True, help="output file: raw little-endian float32 [positions, vocab]")
    parser.add_argument("--device", default="cuda", help="device to run on (default cuda)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="compute dtype (default float32; bfloat16 gives the plain-bf16 peer)")
    args = parser.parse_args()

    ids = parse_ids(args.ids)

    import numpy as np
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("hf_logits: CUDA is not available (pass --device cpu to run on the host)")
    strict_fp32(torch)

    t0 = time.time()
    model = load(args.model_dir, args.device, torch, getattr(torch, args.dtype))
    model.eval()
    t1 = time.time()
    print(f"hf_logits: loaded {args.model_dir} in {args.dtype} on {args.device} in {t1 - t0:.1f} s")

    with torch.no_grad():
        input_ids = torch.tensor([ids], dtype=torch.long, device=args.device)
        out = model(input_ids=input_ids, use_cache=False)
        logits = out.logits[0].float()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        array = logits.cpu().numpy()
    t2 = time.time()

    positions, vocab = array.shape
    array.astype("<f4", copy=False).tofile(args.out)
    print(f"hf_logits: logits shape [{positions}, {vocab}] written to {args.out} "
          f"({positions * vocab * 4} bytes, raw little-endian f32) in {t2 - t1:.2f} s")
    print(f"hf_logits: argmax per position: {','.join(str(int(i)) for i in array.argmax(axis=1))}")
    if not np.isfinite(array).all():
        print("hf_logits: WARNING: the reference logits contain non-finite values")

    del out, logits, input_ids, model
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
