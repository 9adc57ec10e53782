"""Peak memory with experts several times the cache, on a K3-geometry slice, in a subprocess.

The model: `k3kit synth`'s K3 geometry (hidden 7168, MLA q_lora 1536 / kv_lora 512 / 128+64 /
v 128, KDA head_dim 128, expert latent 3584 and expert FFN 3072 in MXFP4, 2 shared experts,
vocab cut to 512) with 2 layers (KDA + MoE, MLA + MoE) and 16 experts per layer, and 8 heads
instead of 96 so that the trunk (0.45 GiB of Q8_0) loads in seconds on CI. Every routed
expert is exactly K3's: 17.6 MB of MXFP4, 66 MiB dequantized to bf16; 32 of them is ~2.1 GiB
dequantized against a 128 MiB cache.

Bound: peak RSS <= (RSS of the same interpreter after importing the engine) + the file's trunk
bytes (the default quantized trunk holds those, mapped) + cache budget + MARGIN, with
MARGIN = two experts as the cache holds them (the one being read while the previous one is
still referenced; with the torch kernel a third, for the BLAS's repacked copy of bf16 weights)
+ 256 MiB (dequantization scratch, the float pieces of the trunk, torch's
per-op buffers, the allocator's free pages: runs of the same code on one machine peak up to ~50
MiB apart). Holding every expert would exceed the bound by hundreds of MiB. With the native kernel the cache
holds quantized experts, and keeps up to MAX_SPARE evicted buffers for reuse: those count too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from k3kit.gguf.reader import GGUFFile
from k3kit.gguf.synth import K3, synthesize
from k3kit.kernels.qmatmul import native_available
from k3kit.runtime.experts.cache import MAX_SPARE

MIB = 1 << 20
CACHE_MIB = 128


@pytest.fixture(scope="module")
def k3_slice(tmp_path_factory):
    d = tmp_path_factory.mktemp("k3slice")
    geometry = replace(K3, n_dense_lead=0, n_head=8)
    r = synthesize(d, geometry, 2, 16, vocab=512, progress=False, name="k3slice")
    return r.paths[0]


def _run(code: str | None, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "k3kit.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_peak_rss_stays_within_trunk_cache_and_margin(k3_slice, kernel):
    if kernel == "native" and not native_available():
        pytest.skip("native kernel not built")
    f = GGUFFile.open(k3_slice)
    experts = [t for t in f.tensors if "_exps." in t.name]
    trunk_bytes = sum(t.nbytes for t in f.tensors if "_exps." not in t.name)   # held as in the file
    one_expert = 2 * sum(t.n_elements for t in experts[:3]) // experts[0].shape[2]   # bf16
    all_experts = 2 * sum(t.n_elements for t in experts)
    assert all_experts >= 8 * CACHE_MIB * MIB                       # experts are many times the cache
    if kernel == "native":
        one_quantized = sum(t.nbytes for t in experts[:3]) // experts[0].shape[2]
        assert sum(t.nbytes for t in experts) >= 4 * CACHE_MIB * MIB   # ... as quantized bytes too
        margin = 2 * one_quantized + MAX_SPARE * one_quantized // 3 + 256 * MIB
    else:
        # + a third expert: a CPU BLAS may repack bf16 weights for its product (oneDNN does on
        # AVX-512-BF16/AMX CPUs), which measured ~40 MiB more there than on an AVX2 box.
        margin = 3 * one_expert + 256 * MIB

    base = _run("import torch, k3kit.runtime.engine, k3kit.tokenizer.codec, "
                "k3kit.adapters.kimi_k3, k3kit.commands.generate; "
                "print(k3kit.runtime.engine.peak_rss_bytes())")
    assert base.returncode == 0, base.stderr
    base_rss = int(base.stdout)

    r = _run(None, "generate", str(k3_slice), "--prompt", "ab", "--max-tokens", "2", "--dtype", "bf16",
             "--expert-cache-mib", str(CACHE_MIB), "--expert-kernel", kernel, "--threads", "1", "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)["stats"]
    assert s["generated_tokens"] >= 1
    assert s["payload_bytes"] >= 16 * 17_000_000            # at least one token's experts were read
    peak = s["peak_rss_bytes"]
    bound = base_rss + trunk_bytes + CACHE_MIB * MIB + margin
    detail = (f"peak {peak / MIB:.0f} MiB, base {base_rss / MIB:.0f} + trunk {trunk_bytes / MIB:.0f} + "
              f"cache {CACHE_MIB} + margin {margin / MIB:.0f} = {bound / MIB:.0f} MiB")
    assert peak <= bound, detail
    assert peak < base_rss + trunk_bytes + all_experts / 2, detail   # far from holding the experts
