"""`--llama-cpp`: llama.cpp's autoregressive rows on the same GGUF and the same prompts.

Also where llama.cpp's C++ `llama-server` is found (`find_llama_server`): the peer of the serving
benchmarks, built from the llama.cpp tree vendored in the llama-cpp-python sdist by
benchmarks/llama_server.py (its wheel ships no server binary).

Driven through llama-cpp-python (the `interop` extra) exactly as k3kit's own rows are: one
repetition = reset, evaluate the prompt (a `pp` sample), then greedy-decode n_gen tokens one
`eval` at a time (a `tg` sample), after one warm-up run. F32 KV cache (k3kit keeps its MLA
latents in f32 on the CPU), n_batch = k3kit's prefill chunk, and the CPU "extra buffer types"
(AMX/repacked weights) off, as the interop tests run it.

Also the one place that decides llama.cpp's weight repacking for every benchmark (`repack_choice`,
`model_params`, `server_repack_args`): on a CPU with AMX-INT8, llama.cpp 0.3.36 places repacked
weights in its AMX buffer, whose supports_op takes MUL_MAT alone, and the graph scheduler aborts
(GGML_ASSERT(*cur_backend_id != -1)) on any kimi-k3 file; so there repacking is off unless asked for.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from k3kit.errors import K3Error

SDIST = "llama_cpp_python-0.3.36"        # the pinned llama-cpp-python, as the interop tests use it
LLAMA_SERVER_ENV = "K3KIT_LLAMA_SERVER"   # an explicit llama-server binary
LLAMA_SERVER_DIR_ENV = "K3KIT_LLAMA_SERVER_DIR"


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "k3kit"


def llama_server_dir() -> Path:
    """Where benchmarks/llama_server.py extracts (src/) and builds (build/) llama.cpp."""
    return Path(os.environ.get(LLAMA_SERVER_DIR_ENV) or cache_dir() / "llama-server" / SDIST)


def built_llama_server(root: Path | None = None) -> Path:
    return (root or llama_server_dir()) / "build" / "bin" / "llama-server"


def find_llama_server() -> Path | None:
    """$K3KIT_LLAMA_SERVER, else the binary benchmarks/llama_server.py built, else `llama-server` on
    PATH; None when there is none."""
    explicit = os.environ.get(LLAMA_SERVER_ENV)
    if explicit:
        p = Path(explicit)
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise K3Error(f"{p}: ${LLAMA_SERVER_ENV} is not an executable file")
        return p
    p = built_llama_server()
    if p.is_file() and os.access(p, os.X_OK):
        return p
    on_path = shutil.which("llama-server")
    return Path(on_path) if on_path else None


@dataclass
class PeerSamples:
    threads: int
    prefill_s: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)
    n_prompt: list[int] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)


AMX_REPACK_NOTE = "llama.cpp repack off (AMX CPU: llama.cpp aborts on kimi-k3 with it)"


def cpu_has_amx_int8(cpuinfo: str | None = None) -> bool:
    """Whether the CPU lists the amx_int8 flag in /proc/cpuinfo (or in `cpuinfo`, its text).

    The flag is what matters, not llama.cpp's system info: a llama.cpp built for the machine
    (GGML_NATIVE, as llama-cpp-python builds from source) compiles its AMX buffer in when the CPU
    has it, and the separately built llama-server does the same."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    return any(line.startswith("flags") and "amx_int8" in line.split(":", 1)[-1].split()
               for line in cpuinfo.splitlines())


def repack_choice(requested: bool | None, cpuinfo: str | None = None) -> tuple[bool, str]:
    """(repack on, the words a benchmark prints and records about it) for llama.cpp's weight repacking.

    `requested` is an explicit choice (a flag), kept as it is; None is llama.cpp's default (on),
    except on an AMX-INT8 CPU, where it is off: llama.cpp aborts on kimi-k3 files with it there."""
    if requested is not None:
        return requested, f"llama.cpp repack {'on' if requested else 'off'} (asked for)"
    if cpu_has_amx_int8(cpuinfo):
        return False, AMX_REPACK_NOTE
    return True, "llama.cpp repack on (its default)"


@contextlib.contextmanager
def model_params(llama_cpp: Any, repack: bool) -> Iterator[None]:
    """Models loaded through llama-cpp-python inside this block get `use_extra_bufts = repack`.

    llama_cpp.Llama takes its model parameters from llama_model_default_params() and has no
    argument for extra buffer types, so the default is swapped for the block."""
    original = llama_cpp.llama_cpp.llama_model_default_params

    def params() -> Any:
        p = original()
        p.use_extra_bufts = repack
        return p

    llama_cpp.llama_cpp.llama_model_default_params = params
    try:
        yield
    finally:
        llama_cpp.llama_cpp.llama_model_default_params = original


def server_repack_args(repack: bool) -> list[str]:
    """llama-server's command-line words for the repack choice (on is its default)."""
    return [] if repack else ["--no-repack"]


def run_peer(path: Path, prompts: list[list[int]], n_gen: int, threads: int, n_batch: int,
             tick: Callable[[str], None]) -> PeerSamples:
    try:
        import llama_cpp
    except ImportError:
        raise K3Error("--llama-cpp needs llama-cpp-python (pip install 'k3kit[interop]')") from None
    n_ctx = max(len(p) for p in prompts) + n_gen + 8
    out = PeerSamples(threads)
    with model_params(llama_cpp, repack=False):
        tick("llama.cpp: loading")
        try:
            llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch,
                                  n_threads=threads, n_threads_batch=threads, type_k=0, type_v=0,
                                  verbose=False)
        except (ValueError, RuntimeError) as e:
            raise K3Error(f"{path}: llama.cpp cannot load it ({str(e).splitlines()[0]})") from None
    try:
        n_vocab = llm.n_vocab()

        def last() -> int:
            """Greedy pick from the last evaluated row (without logits_all, `scores` stays empty)."""
            row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
            return int(np.argmax(row))

        def one(prompt: list[int], n: int) -> tuple[float, float, list[int]]:
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(prompt)
            t1 = time.perf_counter()
            toks = [last()]
            for _ in range(n):
                llm.eval([toks[-1]])
                toks.append(last())
            return t1 - t0, time.perf_counter() - t1, toks

        tick("llama.cpp: warm-up")
        one(prompts[0], min(n_gen, 2))
        for i, p in enumerate(prompts):
            tick(f"llama.cpp: prompt {i + 1}/{len(prompts)}")
            pre, dec, toks = one(p, n_gen)
            out.prefill_s.append(pre)
            out.decode_s.append(dec)
            out.n_prompt.append(len(p))
            out.token_ids.append(toks)
    finally:
        llm.close()
    return out
