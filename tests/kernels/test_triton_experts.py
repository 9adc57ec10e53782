"""Routed experts kept as their bytes for the Triton kernels (`--expert-kernel triton`, the default
on CUDA): the grouped GEMV (`kernels.gpu.grouped_gemv`: a MoE layer's routed rows, each against
its expert's matrix, in one launch) against `matmul` row by row, and the shipped mini end to end
with its experts held that way. On the CPU through Triton's interpreter (TRITON_INTERPRET=1, set
here before triton is first imported), as tests/kernels/test_triton_kernels.py runs the kernels."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from triton_device import device  # noqa: E402  (sets TRITON_INTERPRET before triton loads)

DEV = device()

from k3kit.adapters import load_model  # noqa: E402
from k3kit.gguf import quants  # noqa: E402
from k3kit.kernels import gpu  # noqa: E402
from k3kit.layers import moe  # noqa: E402
from k3kit.mini.paths import shipped_gguf  # noqa: E402
from k3kit.runtime.loader import LoadOptions  # noqa: E402


def _raw(qtype: T, n_in: int, n_out: int, seed: int) -> torch.Tensor:
    n_blocks = n_in * n_out // GGML_QUANT_SIZES[qtype][0]
    blocks = quants.random_blocks(qtype, n_blocks, np.random.default_rng(seed), (1e-3, 1e-2))
    return torch.from_numpy(blocks.reshape(-1).copy()).to(DEV)


@pytest.mark.parametrize("qtype", [T.MXFP4, T.Q4_K, T.Q8_0, T.IQ2_XXS])
def test_grouped_gemv_is_matmul_row_by_row(qtype):
    n_in, n_out = 256, 40
    mats = [_raw(qtype, n_in, n_out, seed) for seed in range(4)]
    x = torch.randn(6, n_in, device=DEV)
    pair_mat, pair_row = [3, 0, 0, 2, 3, 1, 1], [0, 1, 5, 2, 4, 3, 0]
    y = gpu.grouped_gemv(x, mats, pair_mat, pair_row, int(qtype), n_in, n_out)
    assert y.shape == (7, n_out) and y.dtype == torch.float32
    for p, (m, r) in enumerate(zip(pair_mat, pair_row, strict=True)):
        alone = gpu.matmul(x[r:r + 1], mats[m], int(qtype), n_in, n_out)[0]
        assert torch.equal(y[p], alone), p
    with pytest.raises(ValueError, match="names no matrix"):
        gpu.grouped_gemv(x, mats, [4], [0], int(qtype), n_in, n_out)
    with pytest.raises(ValueError, match="bytes"):
        gpu.grouped_gemv(x, [*mats, mats[0][:-1]], [0], [0], int(qtype), n_in, n_out)


def _decode(lm, n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and each step's logits (a short prompt: the interpreter runs every program)."""
    model = lm.model
    model.reset()
    ids = lm.codec.encode("def f(x):")
    logits = model.forward(ids)[-1]
    out, seen = [], []
    for _ in range(n):
        seen.append(logits)
        out.append(int(logits.argmax()))
        logits = model.forward([out[-1]])[-1]
    return out, seen


def test_mini_with_its_experts_as_bytes_for_triton(monkeypatch):
    with load_model(shipped_gguf(), LoadOptions(expert_kernel="torch", arith="float")) as lm:
        plain, _ = _decode(lm, 6)
    triton = LoadOptions(expert_kernel="triton", device=str(DEV), arith="float")
    with load_model(shipped_gguf(), triton) as lm:
        store = lm.model.store
        layer = min(store.layers)
        assert {store.keep_of(il) for il in store.layers} == {"triton"}
        weights = store.get(layer, [0])[0]
        assert all(isinstance(w, gpu.TritonMatrix) for w in weights)
        assert store.cached_expert_nbytes(layer) == store.expert_nbytes(layer)     # the file's bytes
        assert lm.expert_kernel == "triton" and lm.kernels["experts"]["MXFP4"].startswith("triton")
        calls = []
        real = gpu.grouped_gemv
        monkeypatch.setattr(gpu, "grouped_gemv", lambda *a, **k: calls.append(1) or real(*a, **k))
        grouped, logits = _decode(lm, 6)
        assert calls                     # decode rows ran grouped once their experts were cached
        # the per-expert path (one launch per expert and projection) gives the same bits
        monkeypatch.setattr(moe, "GROUPED_MAX_ROWS", 0)
        calls.clear()
        each, each_logits = _decode(lm, 6)
        assert not calls
    assert grouped == each
    assert all(torch.equal(a, b) for a, b in zip(logits, each_logits, strict=True))
    # against the float experts dequantized by torch: the same greedy tokens on this prompt
    assert grouped == plain
