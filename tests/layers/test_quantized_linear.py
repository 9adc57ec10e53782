"""QuantizedLinear / QuantizedEmbedding: products and lookups straight from ggml bytes.

Contract: a QuantizedLinear computes what dequantize + F.linear computes, to the float32
rounding bound of a k-term dot product (native kernel for few rows, dequantize + GEMM for many),
with the output in x's dtype; F32/F16 weights are held as a view of their bytes. An embedding
row is bitwise the row of the whole dequantized table. The swap helper replaces modules of a
meta-built model and refuses bytes of the wrong shape.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from torch import nn

from k3kit.gguf import quants
from k3kit.kernels import dequant as dequant_module
from k3kit.kernels import qmatmul
from k3kit.kernels.dequant import dequantize
from k3kit.kernels.qmatmul import NATIVE_MAX_ROWS, NATIVE_TYPES, native_max_rows
from k3kit.layers.quantized_linear import (
    DENSE_MAX_ROWS,
    FLOAT_TYPES,
    GGMLWeight,
    QuantizedEmbedding,
    QuantizedLinear,
    fused_products,
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
    if qtype in (T.F32, T.F16, T.BF16):
        a = rng.standard_normal(n_in * n_out).astype(np.float32 if qtype != T.F16 else np.float16)
        if qtype == T.BF16:
            a = (a.view(np.uint32) >> 16).astype(np.uint16)
        raw = a.view(np.uint8)
    elif qtype in F16_AT:
        qk, nb = GGML_QUANT_SIZES[qtype]
        n_blocks = n_in * n_out // qk
        b = rng.integers(0, 256, size=(n_blocks, nb), dtype=np.uint8)
        for off in F16_AT[qtype]:
            d = (rng.standard_normal(n_blocks) * 0.01).astype(np.float16)
            b[:, off:off + 2] = d.view(np.uint8).reshape(n_blocks, 2)
        raw = b.reshape(-1)
    else:
        raw = quants.random_blocks(qtype, n_in * n_out // GGML_QUANT_SIZES[qtype][0], rng,
                                   (1e-3, 1e-2)).reshape(-1)
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


# Batched serving (several sequences' rows in one call) relies on this: up to
# `invariant_rows`, a row's output bits do not depend on the other rows of the call.
ROW_TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K, T.MXFP4,
             T.IQ2_XXS, T.IQ2_XS, T.IQ3_XXS, T.IQ1_S, T.IQ1_M]
MAX_TESTED_ROWS = 64        # the native kernels without a row limit are tested this far


@pytest.mark.parametrize("arith", ["float", "ggml"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("qtype", ROW_TYPES, ids=lambda t: t.name)
def test_each_row_is_bitwise_independent_of_the_other_rows(qtype, dtype, arith, monkeypatch):
    """For F32/F16/BF16 weights (one torch.mv per row) and every native type, in both of the
    native kernels' arithmetics (float32 products; ggml's int8 activation blocks)."""
    if qtype not in FLOAT_TYPES and qtype not in NATIVE_TYPES:
        pytest.skip("native kernel not built")
    if arith not in getattr(qmatmul, "ARITHS", ("float",)):
        pytest.skip(f"no {arith} arithmetic in this build")
    if arith != "float":
        if qtype in FLOAT_TYPES:
            pytest.skip("float weights have one arithmetic")
        monkeypatch.setattr(qmatmul, "DEFAULT_ARITH", arith)
    layer = QuantizedLinear(ggml_weight(qtype, N_IN, N_OUT), dtype)
    limit = layer.invariant_rows
    if qtype in FLOAT_TYPES:
        want = DENSE_MAX_ROWS
    else:
        want = native_max_rows(qtype, dtype) if arith == "float" else sys.maxsize
    assert limit == want > 0
    n = min(limit, MAX_TESTED_ROWS)
    g = torch.Generator().manual_seed(int(qtype))
    x = torch.randn(n, N_IN, generator=g).to(dtype)
    with torch.no_grad():
        alone = torch.cat([layer(x[i:i + 1]) for i in range(n)])
        for m in range(2, n + 1):
            assert torch.equal(layer(x[:m]), alone[:m]), f"{m} rows"
            # the same rows in another order and next to other rows: each row's bits unchanged
            perm = torch.randperm(m, generator=g)
            assert torch.equal(layer(x[perm]), alone[perm]), f"{m} rows permuted"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q6_K, T.MXFP4, T.IQ2_XXS, T.Q4_0],
                         ids=lambda t: t.name)
def test_dequant_mode_is_dequantize_then_matmul_in_row_chunks(qtype, dtype):
    """mode="dequant" (what a CUDA layer runs): each chunk of output rows is bitwise the product
    with those rows of the whole dequantized matrix (the chunk's weights are bit for bit the
    whole matrix's), for chunks that do and do not divide the output rows and for one chunk;
    the whole result is the whole product up to the GEMM's summation order (a 1-row chunk is
    a dot product, which orders its sums differently from a wide GEMM)."""
    n_in, n_out = 256, 200
    wt = ggml_weight(qtype, n_in, n_out, seed=3)
    w = dequantize(wt.raw, qtype, wt.shape, dtype)
    x = torch.randn(7, n_in, generator=torch.Generator().manual_seed(1)).to(dtype)
    for rows in (1, 48, 50, n_out):
        layer = QuantizedLinear(wt, dtype, mode="dequant", chunk_bytes=rows * n_in * dtype.itemsize)
        assert layer.matrix is None and layer.chunk_rows() == rows and layer.invariant_rows == 0
        with torch.no_grad():
            for m in (1, 7):
                y = layer(x[:m])
                chunked = torch.cat([x[:m] @ w[r0:r0 + rows].t() for r0 in range(0, n_out, rows)], dim=1)
                assert torch.equal(y, chunked), (rows, m)
                whole = (x[:m] @ w.t()).float()
                tol = 1e-5 if dtype == torch.float32 else 1e-2
                assert torch.allclose(y.float(), whole, rtol=tol, atol=tol * float(whole.abs().max()))


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith(field + ":"))


def _peak_growth(fn) -> int:
    """How far the resident set rose above its level before `fn()` (VmHWM reset first)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                   # resets VmHWM to the current RSS
    before = _vm("VmRSS")
    fn()
    return _vm("VmHWM") - before


def test_dequant_mode_holds_one_chunk_of_dequantized_weight():
    """Peak extra memory of a product is the chunk (plus small buffers), not the whole matrix
    in the compute dtype; the whole-matrix way measured the same way exceeds the bound."""
    try:
        _peak_growth(lambda: None)
    except OSError:
        pytest.skip("no /proc/self/clear_refs")
    n_in, n_out, mib = 4096, 4096, 1 << 20                   # 64 MiB in float32, 17 MiB of Q8_0
    wt = ggml_weight(T.Q8_0, n_in, n_out)
    chunk = 4 * mib
    layer = QuantizedLinear(wt, torch.float32, mode="dequant", chunk_bytes=chunk)
    x = torch.randn(4, n_in)
    with torch.no_grad():
        layer(x)                                              # warm: tables, allocator
        chunked = _peak_growth(lambda: layer(x))
        whole = _peak_growth(lambda: x @ dequantize(wt.raw, T.Q8_0, wt.shape, torch.float32).t())
    bound = 2 * chunk + 8 * mib        # the chunk, the kernels' per-call temporaries, glibc slack
    assert chunked <= bound, f"{chunked / mib:.1f} MiB > {bound / mib:.0f} MiB"
    assert whole > bound, f"whole-matrix peak {whole / mib:.1f} MiB should exceed {bound / mib:.0f}"


def test_mxfp4_device_copy_path_matches_the_numpy_one(monkeypatch):
    """Off the CPU, MXFP4's nibble interleave is a torch copy (no numpy on the hot path):
    forced on the CPU here, it gives the same bits."""
    wt = ggml_weight(T.MXFP4, 256, 16)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        ref = dequantize(wt.raw, T.MXFP4, wt.shape, dtype)
        monkeypatch.setattr(dequant_module, "_numpy_copy", lambda t: False)
        got = dequantize(wt.raw, T.MXFP4, wt.shape, dtype)
        monkeypatch.undo()
        assert torch.equal(got.view(torch.int16 if dtype.itemsize == 2 else torch.int32),
                           ref.view(torch.int16 if dtype.itemsize == 2 else torch.int32))


def test_to_moves_the_bytes_and_switches_to_the_dequant_path():
    layer = QuantizedLinear(ggml_weight(T.Q8_0, N_IN, N_OUT), torch.float32)
    assert layer.matrix is not None
    layer.to(torch.bfloat16)                      # a dtype leaves the bytes as they are
    assert layer.raw.dtype == torch.uint8 and layer.raw.device.type == "cpu" and layer.matrix is not None
    layer.to("meta")                              # stands in for cuda: the bytes go along
    assert layer.raw.device.type == "meta" and layer.raw.dtype == torch.uint8
    assert layer.matrix is None and layer.invariant_rows == 0
    emb = QuantizedEmbedding(ggml_weight(T.Q8_0, 256, 40)).to("meta")
    assert emb.rows.device.type == "meta"


def test_check_runs_once_before_the_first_product_and_embedding_reports_bad_rows():
    layer = QuantizedLinear(ggml_weight(T.Q8_0, N_IN, N_OUT))
    calls = []
    layer.check = lambda: calls.append(1)
    with torch.no_grad():
        layer(torch.randn(2, N_IN))
        layer(torch.randn(1, N_IN))
    assert calls == [1] and layer.check is None

    def fail():
        raise RuntimeError("corrupt")
    layer.check = fail
    for _ in range(2):                            # a failed check stays: every call raises
        with pytest.raises(RuntimeError, match="corrupt"):
            layer(torch.randn(1, N_IN))

    wt = ggml_weight(T.Q8_0, 256, 40)
    raw = wt.raw.clone()
    row_bytes = raw.numel() // 40
    at = 7 * row_bytes + 34                       # row 7's second block: its f16 d set to NaN
    raw[at:at + 2] = torch.tensor([0x00, 0x7E], dtype=torch.uint8)
    emb = QuantizedEmbedding(GGMLWeight(raw, T.Q8_0, (256, 40)))
    bad = []
    emb.corrupt_row = bad.append
    emb(torch.tensor([1, 2]))
    assert bad == []
    emb(torch.tensor([3, 7, 7]))
    assert bad == [7]


@pytest.mark.skipif(not qmatmul.native_available(), reason="the native kernels were not built")
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K])
def test_fused_products_have_each_layers_bits(qtype):
    """Several layers over one input in one native call: each output the bits of the layer's own
    product; None where the call does not apply (before a layer's first product, a gradient, a
    bias, float arithmetic, another shape)."""
    layers = [QuantizedLinear(ggml_weight(qtype, N_IN, N_OUT, seed=s), torch.float32, arith="ggml")
              for s in range(4)]
    x = torch.randn(2, 3, N_IN)
    with torch.no_grad():
        layers[0].check = lambda: None                  # a loaded layer's pending first-product check
        assert fused_products(layers, x) is None
        want = [m(x) for m in layers]                   # runs (and clears) it
        got = fused_products(layers, x)
        assert got is not None and got.shape == (4, 6, N_OUT)
        assert all(torch.equal(got[j].view(2, 3, N_OUT), want[j]) for j in range(4))
        other = QuantizedLinear(ggml_weight(qtype, N_IN, 2 * N_OUT), torch.float32, arith="ggml")
        other(x)
        assert fused_products([*layers, other], x) is None
        flt = QuantizedLinear(ggml_weight(qtype, N_IN, N_OUT), torch.float32, arith="float")
        flt(x)
        assert fused_products([layers[0], flt], x) is None
    assert fused_products(layers, x) is None            # a gradient may be wanted
