"""Build llama.cpp's `llama-server`, bench/bfcl.py's baseline, from the llama.cpp sources that the
llama-cpp-python package of bench/build_llama_cpp.py carries (its sdist vendors them), so that the
server and the benches' Python binding are the same llama.cpp.

The binary goes to .venv/llama-cpp/server/bin/llama-server, built once (a second run finds it and
stops). Its instruction sets are bench/build_llama_cpp.py's `native` ones (from /proc/cpuinfo, not
-march=native, for the reason that file gives).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.build_llama_cpp import VERSION, cmake_args  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / ".venv" / "llama-cpp" / "server"


def binary() -> Path:
    return TARGET / "bin" / "llama-server"


def main() -> None:
    if binary().exists():
        print(f"{binary()} is built")
        return
    with tempfile.TemporaryDirectory(prefix="llama-server-") as tmp:
        print(f"fetching the llama-cpp-python {VERSION} sdist", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        "-d", tmp, f"llama-cpp-python=={VERSION}"], check=True)
        (sdist,) = Path(tmp).glob("*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        src = Path(tmp) / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
        build = Path(tmp) / "build"
        # No web UI (its prebuilt assets would be downloaded from Hugging Face) and no HTTPS.
        args = cmake_args("native") + ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF",
                                       "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON",
                                       "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_USE_PREBUILT_UI=OFF",
                                       "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF"]
        print(f"building llama-server into {TARGET} with {' '.join(args)}", flush=True)
        subprocess.run(["cmake", "-S", str(src), "-B", str(build), *args], check=True)
        jobs = str(os.cpu_count() or 2)
        subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs], check=True)
        binary().parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(build / "bin" / "llama-server", binary())
    print(f"built {binary()}")


if __name__ == "__main__":
    main()
