"""Build llama.cpp's C++ `llama-server` from the tree vendored in the llama-cpp-python sdist, and find it.

    python benchmarks/llama_server.py [--dir DIR] [--jobs 2] [--force]

llama-cpp-python 0.3.36 (the version the interop tests pin) ships llama.cpp's sources in its sdist
under vendor/llama.cpp, but its wheel has no server binary and `python -m llama_cpp.server` is one
model serving one request at a time. The serving benchmark's peer is the real thing: `llama-server`
with parallel slots and continuous batching, built here once:

  1. the sdist: ~/.cache/k3kit/llama_cpp_python-0.3.36/llama_cpp_python-0.3.36.tar.gz, where
     tests/interop/test_convert_vs_llama.py keeps it (`pip download` when absent);
  2. vendor/llama.cpp extracted to DIR/src (DIR = $K3KIT_LLAMA_SERVER_DIR, default
     ~/.cache/k3kit/llama-server/llama_cpp_python-0.3.36);
  3. `cmake -S src -B build` (Release, -march=native, static, no curl/OpenSSL, no web UI: the UI is
     fetched from a Hugging Face bucket or built with npm, neither of which a benchmark needs),
     then `cmake --build build --target llama-server -j JOBS` under `nice -n 10`;
  4. DIR/build/bin/llama-server, printed on the last line.

Took 30 min (1789 s) on this 2-core box under nice with other work running. Re-running finds
the binary and returns at once; `--force` rebuilds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from k3kit.bench.llama_cpp import (
    LLAMA_SERVER_DIR_ENV,
    SDIST,
    built_llama_server,
    cache_dir,
    find_llama_server,
    llama_server_dir,
)
from k3kit.errors import K3Error

PIP_SPEC = "llama-cpp-python==0.3.36"
LOCAL_SDIST = Path("/tmp/sdist") / SDIST / "vendor" / "llama.cpp"

CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",   # no npm, no download: the server has no UI
]


class BuildError(Exception):
    """A one-line reason the binary cannot be had; main() prints it and exits 1."""


def build_dir() -> Path:
    return llama_server_dir()


def built_binary(root: Path | None = None) -> Path:
    return built_llama_server(root)


def find_binary() -> Path | None:
    """$K3KIT_LLAMA_SERVER, else the one this script built, else `llama-server` on PATH; None if none."""
    try:
        return find_llama_server()
    except K3Error as e:
        raise BuildError(str(e)) from None


def sdist_tarball() -> Path:
    """The llama-cpp-python sdist, downloaded with pip into the cache the interop tests share."""
    cache = cache_dir() / SDIST
    tarball = cache / f"{SDIST}.tar.gz"
    if tarball.is_file():
        return tarball
    cache.mkdir(parents=True, exist_ok=True)
    print(f"downloading {PIP_SPEC} (sdist) into {cache}", flush=True)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        PIP_SPEC, "-d", str(cache)], capture_output=True, text=True, timeout=600)
    if r.returncode != 0 or not tarball.is_file():
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise BuildError(f"{tarball}: pip download {PIP_SPEC} failed ({last})")
    return tarball


def extract(tarball: Path, dest: Path) -> Path:
    """vendor/llama.cpp of the sdist to dest, whole or not at all (a temporary sibling, then a rename)."""
    prefix = f"{SDIST}/vendor/llama.cpp/"
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with tarfile.open(tarball) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix) and len(m.name) > len(prefix)]
            if not any(m.name == prefix + "CMakeLists.txt" for m in members):
                raise BuildError(f"{tarball}: no {prefix}CMakeLists.txt in the sdist")
            for m in members:
                m.name = m.name[len(prefix):]
            tar.extractall(tmp, members=members, filter="data")
    except (tarfile.TarError, OSError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise BuildError(f"{tarball}: cannot extract vendor/llama.cpp ({e})") from None
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(dest)
    return dest


def source_tree(root: Path) -> Path:
    """llama.cpp's sources: /tmp/sdist when a whole tree is unpacked there, else root/src from the sdist."""
    if (LOCAL_SDIST / "tools" / "server" / "CMakeLists.txt").is_file():
        return LOCAL_SDIST
    src = root / "src"
    if (src / "tools" / "server" / "CMakeLists.txt").is_file():
        return src
    return extract(sdist_tarball(), src)


def configure_cmd(src: Path, build: Path) -> list[str]:
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    return ["cmake", "-S", str(src), "-B", str(build), *gen, *CMAKE_FLAGS]


def build_cmd(build: Path, jobs: int) -> list[str]:
    return ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)]


def _run_logged(cmd: list[str], log: Path, what: str) -> None:
    """cmd under `nice -n 10` (other work on the box goes first), its output to log; progress lines
    ("[12/206] ...") echoed as they come."""
    full = (["nice", "-n", "10"] if shutil.which("nice") else []) + cmd
    print(f"{what}: {' '.join(cmd)}  (log: {log})", flush=True)
    with open(log, "a") as f:
        f.write(f"$ {' '.join(full)}\n")
        f.flush()
        proc = subprocess.Popen(full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        tail: list[str] = []
        for line in proc.stdout:
            f.write(line)
            tail = (tail + [line.rstrip()])[-20:]
            if line.startswith("[") and "/" in line.split("]")[0]:
                print("  " + line.rstrip()[:120], flush=True)
        rc = proc.wait()
    if rc != 0:
        err = next((t for t in reversed(tail) if "error" in t.lower()), tail[-1] if tail else "no output")
        raise BuildError(f"{what} failed (exit {rc}): {err.strip()[:300]}; full log: {log}")


def build(root: Path | None = None, jobs: int = 2, force: bool = False) -> Path:
    """The llama-server binary under root, built first if it is not there (or force)."""
    root = root or build_dir()
    binary = built_binary(root)
    if binary.is_file() and not force:
        return binary
    if shutil.which("cmake") is None:
        raise BuildError("cmake not found on PATH: install cmake (>= 3.14) and a C++17 compiler")
    if shutil.which("c++") is None and shutil.which("g++") is None and shutil.which("clang++") is None:
        raise BuildError("no C++ compiler (c++, g++ or clang++) on PATH")
    root.mkdir(parents=True, exist_ok=True)
    src = source_tree(root)
    build_path = root / "build"
    log = root / "build.log"
    t0 = time.monotonic()
    _run_logged(configure_cmd(src, build_path), log, "configure")
    _run_logged(build_cmd(build_path, jobs), log, "build")
    if not binary.is_file():
        raise BuildError(f"{binary}: the build finished but left no binary; log: {log}")
    print(f"built {binary} in {time.monotonic() - t0:.0f} s", flush=True)
    return binary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None,
                    help=f"build directory (default: ${LLAMA_SERVER_DIR_ENV} or {build_dir()})")
    ap.add_argument("--jobs", type=int, default=2, help="parallel compile jobs")
    ap.add_argument("--force", action="store_true", help="configure and build even if the binary exists")
    args = ap.parse_args()
    try:
        path = build(Path(args.dir) if args.dir else None, args.jobs, args.force)
    except BuildError as e:
        sys.exit(f"llama_server.py: {e}")
    print(path)


if __name__ == "__main__":
    main()
