"""QuantizedLinear / QuantizedEmbedding on the Triton kernels (mode="triton"; what "auto" takes on
CUDA), and the fallback to torch dequantization when they cannot run.

On the CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set here first).
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")    # before triton is imported (see test_triton_kernels)

from k3kit.gguf import quants  # noqa: E402
from k3kit.kernels import gpu  # noqa: E402
from k3kit.kernels.dequant import dequantize  # noqa: E402
from k3kit.layers import quantized_linear as ql  # noqa: E402
from k3kit.layers.quantized_linear import GGMLWeight, QuantizedEmbedding, QuantizedLinear  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_kernels = pytest.mark.skipif(not gpu.available(DEV),
                                   reason="no triton, or no CUDA and TRITON_INTERPRET=0")


def _weight(qtype: T, n_in: int, n_out: int, seed: int = 0) -> GGMLWeight:
    n_blocks = n_in * n_out // GGML_QUANT_SIZES[qtype][0]
    raw = quants.random_blocks(qtype, n_blocks, np.random.default_rng(seed), (1e-3, 1e-2)).reshape(-1)
    return GGMLWeight(torch.from_numpy(raw.copy()).to(DEV), qtype, (n_in, n_out))


@needs_kernels
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.MXFP4], ids=lambda t: t.name)
def test_linear_runs_the_triton_kernels(qtype):
    """The layer's product is gpu.matmul's (GEMV rows: row-invariant up to its limit, which the
    layer reports), in x's dtype and on x's shape, plus the bias."""
    n_in, n_out = 256, 24
    wt = _weight(qtype, n_in, n_out)
    bias = torch.randn(n_out, device=DEV)
    layer = QuantizedLinear(wt, torch.float32, bias, mode="triton")
    assert layer.triton and layer.matrix is None and layer.invariant_rows == gpu.GEMV_MAX_ROWS
    x = torch.randn(2, 3, n_in, generator=torch.Generator().manual_seed(1)).to(DEV)
    with torch.no_grad():
        y = layer(x)
        ref = gpu.matmul(x.reshape(6, n_in), wt.raw, qtype, n_in, n_out) + bias
        assert y.shape == (2, 3, n_out) and torch.equal(y.reshape(6, n_out), ref)
        alone = torch.cat([layer(x.reshape(6, n_in)[i:i + 1]) for i in range(6)])
        assert torch.equal(alone, y.reshape(6, n_out))
        w = dequantize(wt.raw.cpu(), qtype, wt.shape, torch.float32)
        err = (y.reshape(6, n_out).cpu() - bias.cpu() - x.reshape(6, n_in).cpu() @ w.t()).abs().max()
        assert float(err) < 1e-4
        yh = layer(x.half())
        assert yh.dtype == torch.float16


@needs_kernels
def test_embedding_rows_are_bitwise_the_cpu_rows():
    wt = _weight(T.Q4_K, 256, 40)
    emb = QuantizedEmbedding(wt, torch.bfloat16, mode="triton")
    assert emb.triton
    ids = torch.tensor([[3, 7], [39, 3]])
    table = dequantize(wt.raw.cpu(), T.Q4_K, wt.shape, torch.bfloat16)
    got = emb(ids)
    assert got.shape == (2, 2, 256)
    assert torch.equal(got.cpu().view(torch.int16), table[ids].view(torch.int16))


def test_mode_triton_refuses_what_it_cannot_run(monkeypatch):
    monkeypatch.setattr(gpu, "available", lambda device=None: False)
    with pytest.raises(ValueError, match="mode 'triton': no Triton kernel for Q8_0"):
        QuantizedLinear(_weight(T.Q8_0, 64, 4), mode="triton")
    with pytest.raises(ValueError, match="mode 'triton': no Triton kernel for Q2_K"):
        QuantizedEmbedding(_weight(T.Q2_K, 256, 4), mode="triton")


def test_cuda_without_triton_falls_back_to_torch_dequant_and_says_so_once(monkeypatch):
    """What "auto" decides for a CUDA device: the kernels where they run, else the per-product
    torch dequantization, with one warning per process."""
    monkeypatch.setattr(gpu, "_notified", False)
    cuda = torch.device("cuda")
    monkeypatch.setattr(gpu, "available", lambda device=None: True)
    assert ql._use_triton("auto", T.Q4_K, cuda)
    assert not ql._use_triton("auto", T.Q4_K, torch.device("cpu"))
    assert not ql._use_triton("dequant", T.Q4_K, cuda)
    monkeypatch.setattr(gpu, "available", lambda device=None: False)
    with pytest.warns(RuntimeWarning, match="dequantize the weights with torch ops"):
        assert not ql._use_triton("auto", T.Q4_K, cuda)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not ql._use_triton("auto", T.Q8_0, cuda)        # said once


def test_cpu_import_does_not_import_triton():
    """`import k3kit.kernels.gpu` and the layers leave triton unimported until a kernel runs."""
    import subprocess
    import sys

    code = ("import sys, k3kit.layers.quantized_linear, k3kit.kernels.gpu as g; g.available('cpu'); "
            "print('triton' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "False"
