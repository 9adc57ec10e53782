"""Experts far larger than the expert cache: peak RSS stays bounded and the tokens do not change.

The model: `k3kit synth`'s mini geometry with 1024-wide expert latent and FFN (one MXFP4 expert
is 1.67 MB), top-4 routing, 2 MoE layers of 60 experts: 200 MB of experts against a 16 MiB
cache. `k3kit generate` runs greedily in a subprocess (`peak_rss_bytes` = VmHWM) through the
page cache (the default: misses copy out of the mapping or pread, and must not leave the file's
expert pages mapped in this process, where they would count in RSS like the ~160 MB of experts
the run touches), with --cold (O_DIRECT straight into the cache's buffers), and, through the
Python API, with both storage paths named (cold="direct" must really be O_DIRECT here, and
cold="fadvise", pread with POSIX_FADV_DONTNEED around every read, the one it falls back to).

Bound: peak RSS <= base + trunk + cache + MARGIN, where base is the peak RSS of the same
interpreter after loading the model (imports, torch's start-up, the module tree; no expert is
read at load and the mapped trunk is not touched yet), trunk the file's non-expert bytes (kept
as they are, mapped), and MARGIN = 48 MiB: torch's per-op buffers, the KV/KDA state, the
expert cache's spare buffers (cache.MAX_SPARE per size, 2.2 MB here), code pages first run
during generation and allocator slack. Measured here: peak = base + 35 MiB (cache and trunk
included), so ~15 MiB of the margin is used. A store that left its misses mapped would exceed
the bound by the ~160 MB of experts the run touches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from k3kit.gguf.reader import GGUFFile
from k3kit.gguf.synth import MINI, synthesize

MIB = 1 << 20
CACHE_MIB = 16
MARGIN = 48 * MIB
TOKENS = 24


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ooc")
    g = replace(MINI, name="ooc", n_ff_exp=1024, expert_latent=1024, top_k=4)
    return Path(synthesize(d, g, 3, 60, vocab=512, progress=False, name="ooc").paths[0])


# what `k3kit generate` does before its first forward: imports, torch's start-up, the model loaded
LOAD_ONLY = f"""
import sys, torch, k3kit.commands.generate
from k3kit.adapters import load_model
from k3kit.runtime.engine import peak_rss_bytes
from k3kit.runtime.loader import LoadOptions
torch.set_num_threads(1)
model = load_model(sys.argv[1], LoadOptions(expert_cache_mib={CACHE_MIB}))
print(peak_rss_bytes())
"""


# the same run through the Python API with a named storage path: tokens, peak RSS, O_DIRECT used
GENERATE_API = f"""
import json, sys, torch
from k3kit.adapters import load_model
from k3kit.runtime.engine import generate
from k3kit.runtime.loader import LoadOptions
from k3kit.runtime.sampling import make_sampling
torch.set_num_threads(1)
lm = load_model(sys.argv[1], LoadOptions(expert_cache_mib={CACHE_MIB}, cold=sys.argv[2]))
r = generate(lm.model, lm.codec.encode("once upon a time"), max_tokens={TOKENS},
             sampling=make_sampling(0.0, seed=0))
print(json.dumps({{"token_ids": r.token_ids, "payload_bytes": r.stats.payload_bytes,
                  "peak_rss_bytes": r.stats.peak_rss_bytes, "direct_io": lm.model.store.direct_io}}))
"""


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def _generate(path: Path, cache_mib: float, *extra: str) -> dict:
    r = _run("-m", "k3kit.cli", "generate", str(path), "--prompt", "once upon a time", "--max-tokens",
             str(TOKENS), "--expert-cache-mib", str(cache_mib), "--threads", "1", "--json", *extra)
    assert r.returncode == 0, r.stderr
    out: dict = json.loads(r.stdout)
    return out


def test_bounded_cache_bounds_rss_and_keeps_the_tokens(model):
    f = GGUFFile.open(model)
    experts = sum(t.nbytes for t in f.tensors if "_exps." in t.name)
    trunk = sum(t.nbytes for t in f.tensors if "_exps." not in t.name)
    assert experts >= 11 * CACHE_MIB * MIB                     # the cache is far smaller than the experts
    base = _run("-c", LOAD_ONLY, str(model))
    assert base.returncode == 0, base.stderr
    bound = int(base.stdout) + trunk + CACHE_MIB * MIB + MARGIN

    unbounded = _generate(model, 4096)
    want = unbounded["token_ids"]
    assert len(want) == TOKENS
    runs = [((), _generate(model, CACHE_MIB)), (("--cold",), _generate(model, CACHE_MIB, "--cold"))]
    for cold in ("direct", "fadvise"):
        r = _run("-c", GENERATE_API, str(model), cold)
        assert r.returncode == 0, r.stderr
        api = json.loads(r.stdout)
        assert api["direct_io"] == (cold == "direct"), cold     # this filesystem takes O_DIRECT
        runs.append(((f"cold={cold}",), {"token_ids": api["token_ids"], "stats": api}))
    for extra, got in runs:
        s = got["stats"]
        assert got["token_ids"] == want, extra
        assert s["payload_bytes"] >= 4 * CACHE_MIB * MIB, extra    # experts were streamed, not cached
        detail = (f"{extra}: peak {s['peak_rss_bytes'] / MIB:.0f} MiB > base {int(base.stdout) / MIB:.0f} + "
                  f"trunk {trunk / MIB:.0f} + cache {CACHE_MIB} + margin {MARGIN / MIB:.0f} MiB")
        assert s["peak_rss_bytes"] <= bound, detail
