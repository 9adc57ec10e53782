"""llama.cpp runs what `k3kit rewrite` writes exactly as it ran the input.

Re-sharding (one file -> several shards) and a KV edit must leave the model llama.cpp sees
unchanged: same vocab, same logits bit for bit, since no tensor byte moves.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from k3kit.cli import main
from k3kit.gguf import synth
from k3kit.gguf.shards import Model

llama_cpp = pytest.importorskip("llama_cpp")

pytestmark = pytest.mark.interop


def _logits(path: Path, text: bytes) -> np.ndarray:
    model = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=2, logits_all=True, verbose=False)
    try:
        tokens = model.tokenize(text, add_bos=False)
        model.eval(tokens)
        return np.array(model.scores[: len(tokens)], dtype=np.float32)
    finally:
        model.close()


def test_resharded_rewrite_runs_identically(tmp_path):
    src = synth.synthesize(tmp_path / "src", "mini", 4, 8, shards=1, seed=5, progress=False)
    out = tmp_path / "out" / "resharded.gguf"
    out.parent.mkdir()
    rc = main(["rewrite", str(src.paths[0]), "-o", str(out), "--split-max-size", "1M",
               "--set", "general.name=str:resharded"])
    assert rc == 0
    model = Model.open(sorted(out.parent.glob("*.gguf"))[0])
    try:
        assert len(model.paths) >= 3
        assert model.kv["general.name"].value == "resharded"
    finally:
        model.close()

    before = _logits(Path(src.paths[0]), b"def main():\n    return 42")
    after = _logits(model.paths[0], b"def main():\n    return 42")
    assert np.isfinite(before).all() and before.std() > 1e-3
    assert np.array_equal(before, after)
