"""Expert store figures: dequant speed vs gguf-py, read modes, route-batch payload vs per-token.

    python benchmarks/expert_store.py [--experts 24] [--dir /tmp] [--threads 1]

Writes one layer of random MXFP4 experts with the latent-MoE geometry of a 3584-wide
expert space (gate/up 3584x3072, down 3072x3584: 17.5 MB per expert) to a temp file, then:
  1. torch dequant of one 3584x3072 matrix per type vs gguf-py's numpy dequant and, when
     llama-cpp-python is installed, libggml's own C dequantize_row_* (same bytes, same run);
  2. misses through the store in mmap (warm page cache), cold fadvise and cold O_DIRECT mode;
  3. bytes read for one batch of routed tokens: RoutedMoE vs a per-token loop (ledger).
Every figure is printed with its peer and the ratio; absolute times depend on the machine.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from k3kit.kernels.dequant import dequantize, nbytes_for
from k3kit.layers.moe import ExpertWeights, RoutedMoE
from k3kit.runtime.experts import ExpertStore, ExpertTensor

LATENT, FF = 3584, 3072


def write_layer(path: Path, n_experts: int, rng: np.random.Generator) -> list[ExpertTensor]:
    shapes = [(LATENT, FF), (LATENT, FF), (FF, LATENT)]
    specs, pos = [], 4096
    with open(path, "wb") as f:
        f.write(b"\0" * pos)
        for name, shape in zip(("gate", "up", "down"), shapes, strict=True):
            per = nbytes_for(T.MXFP4, shape[0] * shape[1])
            for _ in range(n_experts):
                blocks = rng.integers(0, 256, per, dtype=np.uint8).reshape(-1, 17)
                blocks[:, 0] = rng.integers(118, 127, blocks.shape[0])
                f.write(blocks.tobytes())
            specs.append(ExpertTensor(path, pos, T.MXFP4, shape, n_experts, name))
            pos += per * n_experts
        f.flush()
        os.fsync(f.fileno())
    return specs


def ggml_to_float():
    """libggml-base's dequantize_row_* for a type, through ctypes; None without llama_cpp."""
    spec = importlib.util.find_spec("llama_cpp")
    libs = [p for r in (spec.submodule_search_locations or []) for p in Path(r).rglob("libggml-base.so*")] \
        if spec else []
    if not libs:
        return None
    lib = ctypes.CDLL(str(libs[0]))

    class Traits(ctypes.Structure):
        _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                    ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                    ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                    ("from_float_ref", ctypes.c_void_p)]

    lib.ggml_get_type_traits.restype = ctypes.POINTER(Traits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    proto = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)

    def run(raw: np.ndarray, qtype: int, n: int) -> np.ndarray:
        fn = proto(lib.ggml_get_type_traits(int(qtype)).contents.to_float)
        y = np.empty(n, dtype=np.float32)
        fn(raw.ctypes.data, y.ctypes.data, n)
        return y

    return run


def sane_random(qtype: T, n: int, rng: np.random.Generator) -> np.ndarray:
    """Random quants with finite scales, like a real model's (random fp16 scales hit NaN/inf)."""
    if qtype in (T.F16, T.BF16):
        x = rng.standard_normal(n).astype(np.float32)
        return x.astype(np.float16).view(np.uint8) if qtype == T.F16 else \
            (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    raw = rng.integers(0, 256, nbytes_for(qtype, n), dtype=np.uint8)
    bb = {T.MXFP4: 17, T.Q8_0: 34, T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210}[qtype]
    blocks = raw.reshape(-1, bb)
    scales = rng.uniform(1e-4, 1e-2, (blocks.shape[0], 2)).astype(np.float16).view(np.uint8)
    if qtype == T.MXFP4:
        blocks[:, 0] = rng.integers(118, 127, blocks.shape[0])
    elif qtype == T.Q6_K:
        blocks[:, 208:210] = scales[:, :2]
    elif qtype == T.Q8_0:
        blocks[:, 0:2] = scales[:, :2]
    else:
        blocks[:, 0:4] = scales
    return raw


def best_of(fn, n=3) -> float:
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=24)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)

    ggml = ggml_to_float()
    print(f"dequant {LATENT}x{FF}, {args.threads} torch thread(s); 'x' = peer time / torch time")
    for qtype in (T.MXFP4, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.F16, T.BF16):
        raw = sane_random(qtype, LATENT * FF, rng)
        t_torch = best_of(lambda r=raw, q=qtype: dequantize(r, q, (LATENT, FF)))
        t_numpy = best_of(lambda r=raw, q=qtype: gguf_dequantize(r.reshape(FF, -1), q))
        line = (f"  {qtype.name:5s}: torch {t_torch * 1e3:6.1f} ms | gguf-py {t_numpy * 1e3:6.1f} ms "
                f"({t_numpy / t_torch:.2f}x)")
        if ggml is not None:
            t_c = best_of(lambda r=raw, q=qtype: ggml(r, q, LATENT * FF))
            line += f" | ggml C {t_c * 1e3:6.1f} ms ({t_c / t_torch:.2f}x)"
        print(line)

    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = Path(d) / "experts.bin"
        specs = write_layer(path, args.experts, rng)
        ids = list(range(0, args.experts, 2))
        results = {}
        modes = [  # label, drop the file from the page cache first, store options
            ("mmap, warm page cache", False, {}),
            ("mmap, warm, no slice readahead", False, {"slice_readahead": False}),
            ("mmap, cold", True, {}),
            ("mmap, cold, no slice readahead", True, {"slice_readahead": False}),
            ("cold=fadvise (pread)", False, {"cold": "fadvise"}),
            ("cold=direct (O_DIRECT)", False, {"cold": "direct"}),
        ]
        for label, drop, opts in modes:
            if drop:
                fd = os.open(path, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
            with ExpertStore({0: specs}, **opts) as store:
                store.get(0, ids)
                s = store.stats()
                if opts.get("cold") == "direct" and not store.direct_io:
                    label += " (fell back to fadvise)"
                results[label] = s
                print(f"{label:32s}: {s.misses} misses, {s.bytes_read / 1e6:.1f} MB payload, "
                      f"io {s.io_bytes / 1e6:.1f} MB, read {s.bytes_read / s.read_seconds / 1e9:.2f} GB/s, "
                      f"dequant {s.dequant_seconds:.2f} s")
        base = results["mmap, cold"]
        for label, s in results.items():
            print(f"  read time relative to 'mmap, cold': {label}: {s.read_seconds / base.read_seconds:.2f}x")

        # one verify-sized batch: 8 tokens, top-8 of the layer's experts, nothing cached
        n_tok, k = 8, min(8, args.experts)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(n_tok, LATENT, generator=g)
        w, top = torch.topk(torch.rand(n_tok, args.experts, generator=g), k, dim=1)

        def mlp(xs, ws):
            gate, up, down = ws
            return (torch.nn.functional.silu(xs @ gate.T) * (xs @ up.T)) @ down.T

        class Provider:   # RoutedMoE's default expert is the same SwiGLU as mlp()
            def __init__(self, store):
                self.store = store

            def get(self, layer, e):
                return ExpertWeights(*self.store.get(layer, [e])[e])

        moe = RoutedMoE(args.experts, LATENT, FF, 0, with_experts=False)
        with ExpertStore({0: specs}) as store:
            moe.run_experts(x, top, w, Provider(store))
            batched = store.stats().bytes_read
            store.reset_stats()
            for t in range(n_tok):
                for j in range(k):
                    e = int(top[t, j])
                    mlp(x[t : t + 1], store.get(0, [e])[e])
            per_token = store.stats().bytes_read
        print(f"RoutedMoE {n_tok} tok top-{k} of {args.experts}: {batched / 1e6:.1f} MB vs per-token loop "
              f"{per_token / 1e6:.1f} MB ({per_token / batched:.2f}x fewer bytes)")


if __name__ == "__main__":
    main()
