"""Peak RSS of `k3kit generate` with the default (quantized) trunk: the file's trunk bytes, not more.

The model: `k3kit synth`'s K3 geometry (hidden 7168, real MLA / KDA / latent-MoE widths, MXFP4
experts of K3's size, Q8_0 trunk) with 8 heads instead of 96, 2 layers, 4 experts per layer and a
512-token vocabulary: a 452 MiB trunk in the file, larger than the interpreter's own resident
set (torch + k3kit, ~235 MiB here), so a trunk held twice, or dequantized, cannot hide in the
margin. Synthesis ~10 s, one generate ~12 s on one core.

Bound: peak RSS (the child's VmHWM) <= the file's trunk bytes + the expert cache budget + MARGIN,
MARGIN = BASE + 2 quantized experts + MAX_SPARE spare projection buffers + 160 MiB, where
* BASE is the resident set of the same interpreter after importing the engine (measured in the
  same run: torch's and k3kit's code and tables, which no model choice changes);
* 2 experts: the one being read while the previous is still referenced, beyond the budget;
* MAX_SPARE buffers: evicted quantized projections the cache keeps to read the next miss into;
* 160 MiB: activations and per-op buffers, the float pieces of the trunk (norms, router, MLA
  kv_b, KDA convs: ~10 MiB in f32 here), the tokenizer, glibc's retention (which moves the
  peak of the same command by up to ~65 MiB from run to run: 906-974 MiB measured here).
The float trunk holds every trunk value in the compute dtype (f32 by default: 3.8x the Q8_0
bytes, 1.7 GiB here); the test asserts that this alone exceeds the bound, so a regression to
dequantizing the trunk fails it. (test_engine_quantized_trunk runs both trunks on one file.)
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
CACHE_MIB = 64


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_peak_rss_is_the_files_trunk_bytes_plus_cache_and_margin(tmp_path):
    if not native_available() or not os.path.exists("/proc/self/status"):
        pytest.skip("native kernel not built, or no /proc")
    path = synthesize(tmp_path, replace(K3, n_dense_lead=0, n_head=8), 2, 4, vocab=512, progress=False,
                      name="k3slice").paths[0]
    f = GGUFFile.open(path)
    trunk = [t for t in f.tensors if "_exps." not in t.name]
    experts = [t for t in f.tensors if "_exps." in t.name]
    trunk_file = sum(t.nbytes for t in trunk)
    float_trunk = 4 * sum(t.n_elements for t in trunk)               # --trunk float, f32 (default dtype)
    one_expert = sum(t.nbytes for t in experts[:3]) // experts[0].shape[2]
    assert sum(t.nbytes for t in experts) > CACHE_MIB * MIB            # the cache evicts

    base = _run("-c", "import torch, k3kit.runtime.engine, k3kit.tokenizer.codec, k3kit.adapters.kimi_k3, "
                "k3kit.commands.generate, k3kit.cli; print(k3kit.runtime.engine.peak_rss_bytes())")
    assert base.returncode == 0, base.stderr
    base_rss = int(base.stdout)
    assert trunk_file > base_rss                                      # the trunk dominates the margin

    r = _run("-m", "k3kit.cli", "generate", str(path), "--prompt", "ab", "--max-tokens", "2",
             "--expert-cache-mib", str(CACHE_MIB), "--threads", "1", "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)["stats"]
    assert s["trunk"] == "quantized" and s["generated_tokens"] == 2
    assert s["trunk_bytes"] < trunk_file + 32 * MIB                   # the file's bytes (+ kv_b in f32)
    margin = base_rss + 2 * one_expert + MAX_SPARE * one_expert // 3 + 160 * MIB
    bound = trunk_file + CACHE_MIB * MIB + margin
    peak = s["peak_rss_bytes"]
    detail = (f"peak {peak / MIB:.0f} MiB <= trunk file {trunk_file / MIB:.0f} + cache {CACHE_MIB} + margin "
              f"{margin / MIB:.0f} (base {base_rss / MIB:.0f}) = {bound / MIB:.0f} MiB; a float trunk holds "
              f"{float_trunk / MIB:.0f} MiB")
    print(detail)
    assert peak <= bound, detail
    assert base_rss + float_trunk > bound, detail                    # the float trunk could not pass
