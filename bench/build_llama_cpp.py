"""Build llama-cpp-python, the baseline of bench/decode.py and bench/speculative.py, for this machine.

`--isa native` enables every instruction set the CPU reports (from /proc/cpuinfo, not -march=native:
KVM guests on Intel advertise AMX that a process may not use, and ggml's AMX code then crashed in its
first decode); `--isa avx2` builds for AVX2 + FMA + F16C only, as on a CPU without AVX-512 or VNNI. Each
build goes into its own folder (.venv/llama-cpp/ISA), which the benches put on the path of a
subprocess that runs llama.cpp, so both builds can be compared in one run.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

VERSION = "0.3.36"  # its other dependencies (numpy, jinja2, typing-extensions) are wafer's too
ROOT = Path(__file__).resolve().parent.parent
# ggml's CMake options and the /proc/cpuinfo flags that allow each.
X86 = {"AVX": ["avx"], "AVX2": ["avx2"], "FMA": ["fma"], "F16C": ["f16c"], "BMI2": ["bmi2"],
       "AVX_VNNI": ["avx_vnni"],
       "AVX512": ["avx512f", "avx512bw", "avx512dq", "avx512vl"], "AVX512_VNNI": ["avx512_vnni"],
       "AVX512_BF16": ["avx512_bf16"], "AVX512_VBMI": ["avx512vbmi"]}
AVX2_ONLY = ("AVX", "AVX2", "FMA", "F16C", "BMI2")


def target(isa: str) -> Path:
    return ROOT / ".venv" / "llama-cpp" / isa


def cmake_args(isa: str) -> list[str]:
    if platform.machine() not in ("x86_64", "AMD64"):
        return ["-DGGML_NATIVE=ON"]
    flags: set[str] = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    args = ["-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    for opt, need in X86.items():
        on = all(f in flags for f in need) and (isa == "native" or opt in AVX2_ONLY)
        args.append(f"-DGGML_{opt}={'ON' if on else 'OFF'}")
    return args


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--isa", choices=["native", "avx2"], default="native")
    isa = ap.parse_args().isa
    out = target(isa)
    env = dict(os.environ, CMAKE_ARGS=" ".join(cmake_args(isa)))
    if out.exists():
        shutil.rmtree(out)
    print(f"building llama-cpp-python {VERSION} into {out} with CMAKE_ARGS={env['CMAKE_ARGS']}", flush=True)
    # No wheel cache: pip would reuse the other build's wheel, whatever CMAKE_ARGS says.
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-cache-dir", "--target", str(out),
                    f"llama-cpp-python=={VERSION}", "diskcache==5.6.3"], env=env, check=True)


if __name__ == "__main__":
    main()
