#!/usr/bin/env python3
"""Checks the CUDA kernels' block-format decoder without a GPU. Run by hand, not in CI.

    pip install numpy      # and scripts/build_llama_cpp.sh's sdist unpacked (for gguf-py)
    python3 scripts/check_cuda_block_decoder.py

`bq_weight` in crates/backend/kernels/common.cu (used by the block-format GEMVs, the dequantizing
copy and the embedding lookup) is plain C apart from its qualifiers. This script compiles it with gcc
as host code, decodes every Q5_0, Q5_1, IQ4_NL, Q2_K..Q6_K and IQ4_XS tensor of the llama-quantize
fixtures (tests/fixtures/tiny/kquant/) with it, and compares each weight with gguf-py's own
dequantizer (from the llama.cpp sources). Exits non-zero on any difference.
"""

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "target/llama.cpp/src/vendor/llama.cpp/gguf-py"))

import numpy as np  # noqa: E402
import gguf  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

CODES = {"Q5_0": 5, "Q5_1": 6, "IQ4_NL": 7, "Q2_K": 8, "Q3_K": 9, "Q4_K": 10, "Q5_K": 11, "Q6_K": 12,
         "IQ4_XS": 13}

HOST = r"""
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
typedef unsigned char u8;
typedef unsigned int u32;
#define __device__
#define __forceinline__ static inline
#define __constant__ static const
static float f16_to_f32(unsigned short h) {
    unsigned s = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023;
    float v = e == 0 ? ldexpf((float)m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexpf((float)(m | 1024), (int)e - 25);
    return s ? -v : v;
}
static float f16_at(const u8* p) { return f16_to_f32((unsigned short)(p[0] | (p[1] << 8))); }
"""

MAIN = r"""
int main(int argc, char** argv) {
    int dt = atoi(argv[1]);
    long rows = atol(argv[2]), bytes = atol(argv[3]), cols = atol(argv[4]);
    u8* buf = malloc(bytes);
    if (fread(buf, 1, bytes, stdin) != (size_t)bytes) return 2;
    for (long r = 0; r < rows; r++)
        for (long e = 0; e < cols; e++) {
            float v = bq_weight(dt, buf + r * (bytes / rows), (int)e);
            fwrite(&v, 4, 1, stdout);
        }
    return 0;
}
"""


def main() -> int:
    src = (ROOT / "crates/backend/kernels/common.cu").read_text()
    defs = "\n".join(line for line in src.splitlines() if line.startswith("#define DT_"))
    body = src[src.index("// The 16 levels of IQ4_NL"):src.index("// Element `j` of a stored row")]
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "decode"
        c = Path(tmp) / "decode.c"
        c.write_text(HOST + defs + "\n" + body + MAIN)
        subprocess.run(["gcc", "-O1", "-o", str(exe), str(c), "-lm"], check=True)
        bad, seen = 0, set()
        for path in sorted((ROOT / "tests/fixtures/tiny/kquant").glob("llama-k-*.gguf")):
            for t in gguf.GGUFReader(str(path)).tensors:
                name = t.tensor_type.name
                if name not in CODES:
                    continue
                raw = np.asarray(t.data).tobytes()
                want = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)
                cols = int(t.shape[0])
                rows = want.size // cols
                out = subprocess.run([str(exe), str(CODES[name]), str(rows), str(len(raw)), str(cols)],
                                     input=raw, capture_output=True, check=True).stdout
                got = np.frombuffer(out, dtype=np.float32)
                if got.size != want.size or not np.allclose(got, want, rtol=1e-5, atol=1e-7):
                    print(f"MISMATCH {path.name} {t.name} ({name})")
                    bad += 1
                seen.add(name)
    print(f"bq_weight matches gguf-py on every tensor of: {', '.join(sorted(seen))}" if not bad else f"{bad} mismatches")
    return 1 if bad or len(seen) != len(CODES) else 0


if __name__ == "__main__":
    sys.exit(main())
