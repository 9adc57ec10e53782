"""llama.cpp loads a `k3kit synth` file laid out like the published low-bit K3 GGUFs.

IQ2_XXS gate/up + IQ3_XXS down experts (UD-IQ1_S's expert mix), a Q4_K trunk, and a first
shard that holds only metadata: llama.cpp must find every tensor in shards 2..3, accept the
generated i-quant and K-quant blocks, and produce finite logits. mini256 keeps it small
(4 layers, 8 experts, 256-wide expert rows so the 256-weight block types apply): ~4 MB.

Weight repacking into "extra" buffer types is switched off for all interop tests (conftest.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from k3kit.gguf import synth

llama_cpp = pytest.importorskip("llama_cpp")

pytestmark = pytest.mark.interop


def test_iq_experts_q4_k_trunk_metadata_shard_runs_in_llama_cpp(tmp_path):
    result = synth.synthesize(tmp_path, "mini256", 4, 8, shards=3, seed=4, expert_type="IQ2_XXS",
                              expert_type_down="IQ3_XXS", trunk_type="Q4_K", metadata_shard=True,
                              progress=False)
    assert len(result.paths) == 3 and result.trunk_kept_q8_0 > 0
    model = llama_cpp.Llama(model_path=result.paths[0], n_ctx=64, n_threads=1, verbose=False,
                            logits_all=True)
    try:
        assert model.n_vocab() == 1024 and model.n_embd() == 256
        assert model.metadata["general.architecture"] == "kimi-k3"
        assert model.metadata["general.file_type"] == str(result.file_type)
        tokens = model.tokenize(b"the quick brown fox jumps", add_bos=False)
        logits = []
        for _ in range(2):
            model.reset()
            model.eval(tokens)
            logits.append(np.array(model.scores[:len(tokens)], dtype=np.float32))
        assert np.isfinite(logits[0]).all()
        assert logits[0].std() > 1e-3                         # not a constant output
        assert not np.allclose(logits[0][0], logits[0][-1])   # depends on the input
        np.testing.assert_allclose(logits[0], logits[1], rtol=1e-5, atol=1e-5)
    finally:
        model.close()
