#!/usr/bin/env python3
"""Compile the CUDA backend's kernels with NVRTC, as the backend does at run time, without a GPU.

    python3 -m pip install nvidia-cuda-nvrtc   # NVRTC 13 as a wheel; no toolkit, no driver
    python3 scripts/check_kernels.py [ARCH ...]   (default: every architecture in ARCHS)

The sources are read in the order crates/backend/src/cuda/nvrtc.rs includes them and compiled with
its options. Fails on any compile error, and on any kernel the backend's table asks for
(crates/backend/src/cuda/kernels.rs: each `f("name")`, and each `format!` pattern of names) that
the sources do not define, which the driver would only report at start-up on a GPU; prints how many
kernels each architecture got and any that spill registers (the decode GEMVs are tuned to fit their
register budget).
"""
import ctypes
import glob
import os
import re
import site
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The generations the README promises: A100 (sm_80), RTX 30xx / A10 / A40 (sm_86), RTX 40xx / L4 /
# L40 (sm_89), H100 / H200 (sm_90) and RTX 50xx (sm_120). The backend compiles for the card it
# runs on, so each of these must compile.
ARCHS = ["sm_80", "sm_86", "sm_89", "sm_90", "sm_120"]


def nvrtc():
    dirs = site.getsitepackages() + [site.getusersitepackages()]
    for d in dirs:
        for lib in sorted(glob.glob(os.path.join(d, "nvidia", "cu1*", "lib", "libnvrtc.so.*"))):
            if "builtins" not in lib:
                return ctypes.CDLL(lib), lib
    sys.exit("libnvrtc not found: python3 -m pip install nvidia-cuda-nvrtc")


def sources():
    rs = open(os.path.join(ROOT, "crates/backend/src/cuda/nvrtc.rs")).read()
    names = re.findall(r'include_str!\("\.\./\.\./kernels/([a-z0-9_]+\.cu)"\)', rs)
    if not names:
        sys.exit("no kernel sources listed in nvrtc.rs")
    return names, "".join(open(os.path.join(ROOT, "crates/backend/kernels", n)).read() for n in names)


def wanted():
    """The kernel names kernels.rs loads: literal names, and `format!` patterns as regexes."""
    rs = open(os.path.join(ROOT, "crates/backend/src/cuda/kernels.rs")).read()
    literal = set(re.findall(r'\bf\("([A-Za-z0-9_]+)"\)', rs))
    patterns = set()
    for fmt in re.findall(r'f\(&format!\("([^"]+)"', rs):
        patterns.add("^" + re.sub(r"\\\{[^}]*\\\}", "[a-z0-9_]+", re.escape(fmt)) + "$")
    return literal, patterns


def missing(kernels):
    literal, patterns = wanted()
    have = set(kernels)
    gone = sorted(literal - have)
    gone += [p for p in sorted(patterns) if not any(re.match(p, k) for k in have)]
    return gone


def compile_for(lib, src, arch):
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"corridor.cu", 0, None, None) != 0:
        sys.exit("nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture={arch}", "--std=c++17", "-lineinfo", "--ptxas-options=-v"]
    arr = (ctypes.c_char_p * len(opts))(*(o.encode() for o in opts))
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(errors="replace")


def main():
    lib, path = nvrtc()
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    names, src = sources()
    print(f"NVRTC {major.value}.{minor.value} ({path}); sources: {', '.join(names)}")
    failed = False
    for arch in sys.argv[1:] or ARCHS:
        rc, log = compile_for(lib, src, arch)
        kernels = re.findall(r"Compiling entry function '([^']+)'", log)
        spills = []
        current = None
        for line in log.splitlines():
            m = re.search(r"Function properties for (\S+)", line)
            if m:
                current = m.group(1)
            m = re.search(r"(\d+) bytes spill stores", line)
            if m and int(m.group(1)) > 0 and current:
                spills.append(f"{current} ({m.group(1)} bytes)")
        if rc != 0:
            failed = True
            print(f"FAIL {arch}: compile error\n" + "\n".join(l for l in log.splitlines() if "ptxas" not in l))
        elif missing(kernels):
            failed = True
            print(f"FAIL {arch}: the backend loads kernels the sources do not define: {', '.join(missing(kernels))}")
        else:
            print(f"ok {arch}: {len(kernels)} kernels" + (f" (spills: {', '.join(spills)})" if spills else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
