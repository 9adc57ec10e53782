"""A routed expert with a non-finite block scale: a one-line error from `k3kit generate`, never text.

The check runs on every cache miss (ExpertStore.check_scales): the trunk is checked at load,
but a 2.8T model's experts are only ever read when routed, so that is where corruption shows.
The file: `k3kit synth`'s mini geometry with as many experts as top-k, so every expert is routed
on the first token and the corrupt one is certainly read.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from k3kit.gguf.quants import CorruptBlockError
from k3kit.gguf.reader import GGUFFile
from k3kit.gguf.synth import synthesize
from k3kit.runtime.experts import ExpertStore, ExpertTensor

TENSOR = "blk.1.ffn_gate_exps.weight"
EXPERT, BLOCK = 2, 5


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[Path, Path]:
    """(a valid mini file, the same with one MXFP4 block of one expert overflowing to inf)."""
    d = tmp_path_factory.mktemp("corrupt")
    good = Path(synthesize(d, "mini", 2, 4, vocab=512, progress=False, name="good").paths[0])
    t = next(t for t in GGUFFile.open(good).tensors if t.name == TENSOR)
    block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType.MXFP4][1]
    expert_bytes = t.nbytes // t.shape[2]
    at = t.offset + EXPERT * expert_bytes + BLOCK * block_bytes
    data = bytearray(good.read_bytes())
    data[at] = 255                                    # e8m0 exponent 2^127 ...
    data[at + 1 : at + block_bytes] = b"\x77" * (block_bytes - 1)   # ... times nibble 6: inf
    bad = d / "bad.gguf"
    bad.write_bytes(bytes(data))
    return good, bad


def _generate(path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3kit.cli", "generate", str(path), "--prompt", "ab",
                           "--max-tokens", "3", "--threads", "1", *args],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("args", [("--expert-kernel", "auto"), ("--expert-kernel", "torch"), ("--cold",)])
def test_generate_names_file_tensor_expert_and_block(files, args):
    """Whichever path read the expert: the caller's thread, a background reader (quantized kernel),
    or a background O_DIRECT read straight into the cache's buffer (--cold)."""
    good, bad = files
    ok = _generate(good, *args)
    assert ok.returncode == 0, ok.stderr
    r = _generate(bad, *args)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0] == (f"k3kit: error: {bad}: tensor {TENSOR} expert {EXPERT} (layer 1): "
                        f"MXFP4 block {BLOCK} has a non-finite scale; the file is corrupt")


@pytest.mark.parametrize("cold", [False, "direct"])
@pytest.mark.parametrize("read_ahead", [True, False])
def test_store_raises_on_the_miss_and_serves_the_valid_experts(files, read_ahead, cold):
    """Both read paths (the caller's thread, the background read-ahead) check; the valid experts
    of the same tensor still load, and nothing corrupt is cached."""
    _, bad = files
    f = GGUFFile.open(bad)
    by_name = {t.name: t for t in f.tensors}
    spec = {1: [ExpertTensor(bad, by_name[n].offset, by_name[n].ggml_type, tuple(by_name[n].shape[:2]),
                             by_name[n].shape[2], n)
                for n in (TENSOR, "blk.1.ffn_up_exps.weight", "blk.1.ffn_down_exps.weight")]}
    with ExpertStore(spec, cache_mib=1, keep="quantized", read_ahead=read_ahead, cold=cold) as store:
        store.plan(1, [0, 1, 2, 3])
        for e in (0, 1):
            store.get(1, [e])
        with pytest.raises(CorruptBlockError) as err:
            store.get(1, [EXPERT])
        assert str(err.value) == (f"{bad}: tensor {TENSOR} expert {EXPERT} (layer 1): MXFP4 block {BLOCK} "
                                  "has a non-finite scale; the file is corrupt")
        assert not store.is_cached(1, EXPERT)
        store.get(1, [3])
        assert store.stats().check_seconds > 0
    with ExpertStore(spec, cache_mib=1, check_scales=False) as store:   # what the check prevents
        w = store.get(1, [EXPERT])[EXPERT][0]
        assert not np.isfinite(w.numpy()).all()
