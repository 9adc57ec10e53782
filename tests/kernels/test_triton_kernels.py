"""Triton kernels (k3kit.kernels.gpu) vs the CPU dequantizer, on random blocks.

Run on a GPU when there is one, else on the CPU through Triton's interpreter
(TRITON_INTERPRET=1, set here before the kernels are first imported): the same kernel source,
executed by numpy. Contract checked for every type:
* the dequantizer gives the CPU dequantizer's bits (finite scales of every size, subnormals too);
* the GEMV (few rows) and the GEMM (more rows) against one-hot rows of x give W's values bit for
  bit, and against random x the product to float32 summation accuracy;
* a GEMV row is bitwise the same alone, in a batch, and in another order (row invariance).
Sizes are small: the interpreter runs every program in Python.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from triton_device import device  # noqa: E402  (sets TRITON_INTERPRET before triton loads)

DEV = device()

from k3kit.gguf import quants  # noqa: E402
from k3kit.kernels import gpu  # noqa: E402
from k3kit.kernels.dequant import dequantize  # noqa: E402

TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K, T.MXFP4,
         T.IQ4_NL, T.IQ4_XS, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M,
         T.TQ1_0, T.TQ2_0, T.F16, T.BF16]
assert set(TYPES) == set(gpu.SUPPORTED)


def _raw(qtype: T, n_in: int, n_out: int, seed: int, scale_range=(1e-3, 1e-2)) -> torch.Tensor:
    """uint8 bytes of a random ggml [n_in, n_out] tensor (quants.random_blocks: finite scales)."""
    n_blocks = n_in * n_out // GGML_QUANT_SIZES[qtype][0]
    blocks = quants.random_blocks(qtype, n_blocks, np.random.default_rng(seed), scale_range)
    return torch.from_numpy(blocks.reshape(-1).copy())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _n_in(qtype: T) -> int:
    """Two tiles, or 1.5 for the 32-value types (a partial last tile, masked)."""
    return 512 if GGML_QUANT_SIZES[qtype][0] == 256 else 384


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_is_bitwise_the_cpu_dequantizer(qtype):
    n_in, n_out = _n_in(qtype), 11                         # 11: a partial tile of output rows
    raw = _raw(qtype, n_in, n_out, seed=1, scale_range=None)   # every finite scale, subnormals too
    ref = dequantize(raw, qtype, (n_in, n_out), torch.float32)
    got = gpu.dequantize(raw.to(DEV), qtype, (n_in, n_out)).cpu()
    assert got.shape == (n_out, n_in)
    assert torch.equal(_bits(got), _bits(ref))
    half = gpu.dequantize(raw.to(DEV), qtype, (n_in, n_out), torch.bfloat16).cpu()
    assert torch.equal(_bits(half), _bits(dequantize(raw, qtype, (n_in, n_out), torch.bfloat16)))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_products_match_the_dequantized_weights(qtype):
    """One-hot rows of x pick W's columns exactly (GEMV and both prefill ways); random rows are
    within the float32 bound of a k-term dot product; with a 16-bit compute dtype the tl.dot
    kernel is within that bound of the product of the rounded operands, and the dequant way is
    bitwise torch's GEMM on the CPU dequantizer's weights."""
    n_in, n_out = _n_in(qtype), 19
    raw = _raw(qtype, n_in, n_out, seed=2)
    w = dequantize(raw, qtype, (n_in, n_out), torch.float32)           # [n_out, n_in]
    wd = raw.to(DEV)
    cols = torch.tensor([0, 5, n_in // 2 + 3, n_in - 1])
    big = gpu.GEMV_MAX_ROWS + 4
    for m, how in ((len(cols), ""), (big, "dot"), (big, "dequant")):
        x = torch.zeros(m, n_in)
        x[torch.arange(m), cols.repeat(m // len(cols) + 1)[:m]] = 1.0
        y = gpu.matmul(x.to(DEV), wd, qtype, n_in, n_out, prefill=how).cpu()
        # equal values (a -0.0 weight comes out +0.0: the sum starts at +0.0)
        assert torch.equal(y, w[:, cols.repeat(m // len(cols) + 1)[:m]].t()), (m, how)
    g = torch.Generator().manual_seed(3)
    for m, how in ((3, ""), (big, "dot"), (big, "dequant")):
        x = torch.randn(m, n_in, generator=g)
        y = gpu.matmul(x.to(DEV), wd, qtype, n_in, n_out, prefill=how).cpu().double()
        ref = x.double() @ w.double().t()
        bound = (x.double().abs() @ w.double().abs().t()) * (n_in + 8) * 2.0**-24
        assert bool(((y - ref).abs() <= bound).all()), (m, how)
    # The interpreter's bfloat16 is not usable (its casts truncate and its tl.dot reads the raw
    # bits), so bfloat16 is checked on a GPU only.
    x = torch.randn(big, n_in, generator=g)
    for dt in (torch.float16, torch.bfloat16) if DEV.type == "cuda" else (torch.float16,):
        y = gpu.matmul(x.to(DEV, dt), wd, qtype, n_in, n_out, dt, prefill="dot").cpu().double()
        ref = x.to(dt).double() @ w.to(dt).double().t()
        bound = (x.double().abs() @ w.double().abs().t()) * (n_in + 8) * 2.0**-24
        assert bool(((y - ref).abs() <= bound).all()), dt
        y = gpu.matmul(x.to(DEV, dt), wd, qtype, n_in, n_out, dt, prefill="dequant")
        wt = dequantize(raw, qtype, (n_in, n_out), dt).to(DEV)
        assert y.dtype == dt and torch.equal(y, x.to(DEV, dt) @ wt.t()), dt


@pytest.mark.parametrize("one_program", [False, True], ids=["per-row", "one-program"])
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.MXFP4], ids=lambda t: t.name)
def test_gemv_rows_do_not_depend_on_the_batch(qtype, one_program):
    from k3kit.kernels.gpu import kernels

    n_in, n_out = 256, 10
    wd = _raw(qtype, n_in, n_out, seed=4).to(DEV)
    x = torch.randn(gpu.GEMV_MAX_ROWS, n_in, generator=torch.Generator().manual_seed(5)).to(DEV)

    def mm(rows):
        return kernels.gemv(rows.contiguous(), wd, int(qtype), n_in, n_out, rows_kernel=one_program)

    alone = torch.cat([mm(x[i:i + 1]) for i in range(x.shape[0])])
    for m in (3, gpu.GEMV_MAX_ROWS):
        assert torch.equal(mm(x[:m]), alone[:m]), m
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(6)).to(DEV)
    assert torch.equal(mm(x[perm]), alone[perm])
    w = dequantize(wd.cpu(), qtype, (n_in, n_out), torch.float32)
    ref = x.cpu().double() @ w.double().t()
    bound = (x.cpu().double().abs() @ w.double().abs().t()) * (n_in + 8) * 2.0**-24
    assert bool(((alone.cpu().double() - ref).abs() <= bound).all())


def test_bad_bytes_are_one_line_errors():
    raw = _raw(T.Q8_0, 64, 2, seed=0).to(DEV)
    with pytest.raises(ValueError, match="needs 136 bytes"):
        gpu.matmul(torch.ones(1, 64, device=DEV), raw[:-1].contiguous(), T.Q8_0, 64, 2)
    with pytest.raises(ValueError, match="no Triton kernel for ggml type NVFP4"):
        gpu.dequantize(raw, T.NVFP4, (64, 2))
