"""QuantizedLinear / QuantizedEmbedding: products and lookups straight from ggml bytes.

Contract: a QuantizedLinear computes what dequantize + F.linear computes, to the float32
rounding bound of a k-term dot product (native kernel for few rows, dequantize + GEMM for many),
with the output in x's dtype; F32/F16 weights are held as a view of their bytes. An embedding
row is bitwise the row of the whole dequantized table. The swap helper replaces modules of a
meta-built model and refuses bytes of the wrong shape.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from torch import nn

from k3kit.kernels.dequant import dequantize
from k3kit.kernels.qmatmul import NATIVE_MAX_ROWS
from k3kit.layers.quantized_linear import (
    GGMLWeight,
    QuantizedEmbedding,
    QuantizedLinear,
    quantized_modules,
    use_quantized_weights,
)

N_IN, N_OUT = 512, 48
F16_AT = {T.Q8_0: (0,), T.Q4_K: (0, 2), T.Q6_K: (208,)}   # byte offsets of each block's f16 scales


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here runs torch on one thread (tests/conftest.py)."""


def ggml_weight(qtype: T, n_in: int, n_out: int, seed: int = 0) -> GGMLWeight:
    """Random valid bytes of a ggml [n_in, n_out] tensor: random quants, finite small scales."""
    rng = np.random.default_rng(seed)
    if qtype in (T.F32, T.F16):
        a = rng.standard_normal(n_in * n_out).astype(np.float32 if qtype == T.F32 else np.float16)
        raw = a.view(np.uint8)
    else:
        qk, nb = GGML_QUANT_SIZES[qtype]
        n_blocks = n_in * n_out // qk
        b = rng.integers(0, 256, size=(n_blocks, nb), dtype=np.uint8)
        for off in F16_AT[qtype]:
            d = (rng.standard_normal(n_blocks) * 0.01).astype(np.float16)
            b[:, off:off + 2] = d.view(np.uint8).reshape(n_blocks, 2)
        raw = b.reshape(-1)
    return GGMLWeight(torch.from_numpy(raw.copy()), qtype, (n_in, n_out))


def check_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """|y - x @ W.T| <= (k + 8) 2^-24 (|x| @ |W|.T), against the float64 product."""
    xd, wd = x.double(), w.double()
    err = (y.double() - xd @ wd.T).abs()
    bound = (xd.abs() @ wd.abs().T) * (x.shape[1] + 8) * 2.0**-24 + 1e-300
    assert bool((err <= bound).all()), f"max excess {float((err - bound).max())}"


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q6_K, T.F16, T.F32])
@pytest.mark.parametrize("rows", [1, max(NATIVE_MAX_ROWS.values()) + 8])
def test_matches_dequantize_and_linear(qtype, rows):
    wt = ggml_weight(qtype, N_IN, N_OUT)
    layer = QuantizedLinear(wt, torch.float32)
    w = dequantize(wt.raw, qtype, wt.shape, torch.float32)           # [n_out, n_in]
    x = torch.randn(rows, N_IN, generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        y = layer(x)
    assert y.shape == (rows, N_OUT) and y.dtype == torch.float32
    check_bound(y, x, w)
    ref = F.linear(x, w)
    assert torch.allclose(y, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
    # leading dims are kept; a bf16 input gives a bf16 output (--dtype sets activations only)
    with torch.no_grad():
        y3 = layer(x.view(1, rows, N_IN).bfloat16())
    assert y3.shape == (1, rows, N_OUT) and y3.dtype == torch.bfloat16
    assert torch.allclose(y3.float()[0], F.linear(x.bfloat16().float(), w), rtol=2e-2,
                          atol=2e-2 * float(ref.abs().max()))
    assert layer.nbytes == wt.nbytes and layer.numel == N_IN * N_OUT


def test_float_weights_are_a_view_of_their_bytes():
    wt = ggml_weight(T.F16, N_IN, N_OUT)
    layer = QuantizedLinear(wt)
    assert layer.dense is not None and layer.dense.dtype == torch.float16
    assert layer.dense.data_ptr() == wt.raw.data_ptr()               # no copy, no widening


def test_embedding_rows_are_the_dequantized_table_rows():
    wt = ggml_weight(T.Q8_0, 256, 40)                                 # 40 tokens of width 256
    emb = QuantizedEmbedding(wt, torch.bfloat16)
    table = dequantize(wt.raw, T.Q8_0, wt.shape, torch.bfloat16)      # [40, 256]
    ids = torch.tensor([[3, 0, 39, 3]])
    out = emb(ids)
    assert out.shape == (1, 4, 256) and out.dtype == torch.bfloat16
    assert torch.equal(out[0], table[ids[0]])
    with pytest.raises(IndexError):
        emb(torch.tensor([40]))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(40, 256)
        self.proj = nn.Linear(256, 64, bias=False)
        self.keep = nn.Linear(64, 8, bias=False)


def test_swap_on_a_meta_model():
    weights = {"embed": ggml_weight(T.Q8_0, 256, 40), "proj": ggml_weight(T.Q4_K, 256, 64)}
    with torch.device("meta"):
        net = _Net()
    done = use_quantized_weights(net, weights.get, torch.float32)
    assert done == ["embed", "proj"]
    assert isinstance(net.proj, QuantizedLinear) and isinstance(net.embed, QuantizedEmbedding)
    assert type(net.keep) is nn.Linear and net.keep.weight.is_meta     # not named: left for the loader
    assert len(quantized_modules(net)) == 2
    with torch.no_grad():
        h = net.proj(net.embed(torch.tensor([1, 2])))
    w = dequantize(weights["proj"].raw, T.Q4_K, (256, 64), torch.float32)
    e = dequantize(weights["embed"].raw, T.Q8_0, (256, 40), torch.float32)
    check_bound(h, e[[1, 2]], w)

    with torch.device("meta"):
        net = _Net()
    with pytest.raises(ValueError, match="does not fit"):
        use_quantized_weights(net, {"proj": ggml_weight(T.Q8_0, 256, 32)}.get)
