"""The native kernels of every type but MXFP4 (tests/kernels/test_qmatmul.py has MXFP4's).

The contract (issue 12): on random valid blocks (finite scales), x @ W.T from the blocks agrees
with the float64 product of the dequantized matrix to the float32 rounding bound of a k-term
dot product, at every SIMD level this CPU has, with bit-identical output for any thread count.
The kernels also make each weight exactly as ggml dequantizes it (one-hot rows of x read the
weights back bit for bit), and a row's result does not depend on how many rows a call has.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from k3kit.kernels import qmatmul
from k3kit.kernels.dequant import dequantize
from k3kit.kernels.qmatmul import NATIVE_MAX_ROWS, NATIVE_TYPES, QuantizedMatrix, native_max_rows

pytestmark = pytest.mark.skipif(not qmatmul.native_available(), reason="native kernel not built")

TYPES = [T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K, T.IQ2_XXS, T.IQ2_XS, T.IQ3_XXS, T.IQ1_S, T.IQ1_M]
# 0 scalar, 1 AVX2, 2 AVX-512: the kernel caps a level the CPU lacks at the best it has
SIMD = [0, 1, 2]
# Byte offsets of each type's f16 scales in its block (IQ1_M scatters d over its scale words).
F16_AT = {T.Q8_0: (0,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q2_K: (80, 82), T.Q3_K: (108,),
          T.IQ2_XXS: (0,), T.IQ2_XS: (0,), T.IQ3_XXS: (0,), T.IQ1_S: (0,)}


def f16_scales(rng: np.random.Generator, n: int) -> np.ndarray:
    """n finite f16 scales as uint16: mostly normal of both signs, some subnormal, zero and large."""
    d = (rng.standard_normal(n) * 0.01).astype(np.float16).view(np.uint16)
    kind = rng.integers(0, 16, size=n)
    subnormal = rng.integers(0, 0x400, size=n) | (rng.integers(0, 2, size=n) << 15)
    d = np.where(kind == 0, subnormal, d)
    d = np.where(kind == 1, 0, d)
    d = np.where(kind == 2, np.float16(300.0).view(np.uint16), d)
    return d.astype(np.uint16)


def random_blocks(qtype: T, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes with every f16 scale replaced by a finite one: valid blocks of `qtype`."""
    qk, nbytes = GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(n_blocks, nbytes), dtype=np.uint8)
    if qtype == T.IQ1_M:   # d's four nibbles are the top nibbles of the four scale words
        d = f16_scales(rng, n_blocks).astype(np.uint16)
        sc = b[:, 48:56].copy().view(np.uint16) & 0x0FFF
        for i in range(4):
            sc[:, i] |= ((d >> (4 * i)) & 0xF) << 12
        b[:, 48:56] = sc.view(np.uint8)
    else:
        for off in F16_AT[qtype]:
            b[:, off:off + 2] = f16_scales(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    return b.reshape(-1)


def kernel(qtype: T, raw: np.ndarray, x: np.ndarray, n_out: int, simd: int = -1,
           threads: int = 1) -> np.ndarray:
    """The extension's y = x @ W.T (y starts as NaN: every output must be written)."""
    m, k = x.shape
    y = np.full((m, n_out), np.nan, dtype=np.float32)
    xc = np.ascontiguousarray(x, dtype=np.float32)
    qmatmul._qmatmul.matmul(int(qtype), raw, xc, y, n_out, k, m, simd, threads)
    return y


def weights(qtype: T, raw: np.ndarray, n_out: int, k: int) -> np.ndarray:
    """The dequantized matrix [n_out, k] (k3kit's torch dequantizers, bit-identical to ggml's)."""
    return dequantize(raw, qtype, (k, n_out), torch.float32).numpy()


def check_bound(y: np.ndarray, x: np.ndarray, w: np.ndarray) -> None:
    """|y - x @ W.T| <= (k + 8) 2^-24 (|x| @ |W|.T): float32 summation error of a k-term dot product."""
    k = x.shape[1]
    xd, wd = x.astype(np.float64), w.astype(np.float64)
    exact = xd @ wd.T
    bound = (np.abs(xd) @ np.abs(wd).T) * (k + 8) * 2.0**-24 + 1e-300
    err = np.abs(y.astype(np.float64) - exact)
    assert np.isfinite(y).all()
    assert (err <= bound).all(), f"max err/bound {(err / bound).max():.3g}"


def test_native_types_are_the_extensions() -> None:
    assert set(TYPES) | {T.MXFP4} == NATIVE_TYPES
    assert sorted(qmatmul._qmatmul.types()) == sorted(int(t) for t in NATIVE_TYPES)
    assert qmatmul.native_simd() in ("avx512", "avx2", "scalar")


@pytest.mark.parametrize("simd", SIMD)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_weights_are_ggmls(qtype: T, simd: int) -> None:
    """One-hot rows of x read each weight back: bit-identical to the dequantized matrix, element
    order included, over enough random blocks that every IQ grid entry and sign pattern occurs."""
    qk = GGML_QUANT_SIZES[qtype][0]
    n_out = 1024 if qk == 256 else 4096          # one block per row of W
    raw = random_blocks(qtype, n_out, np.random.default_rng(int(qtype)))
    y = kernel(qtype, raw, np.eye(qk, dtype=np.float32), n_out, simd)    # y[j, n] = W[n, j]
    np.testing.assert_array_equal(y.T, weights(qtype, raw, n_out, qk))


@pytest.mark.parametrize("simd", SIMD)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matches_float64_product(qtype: T, simd: int) -> None:
    """Row counts around every tile height (4, 2, 1 rows of x; 4 and 1 rows of W)."""
    rng = np.random.default_rng(100 + int(qtype))
    qk = GGML_QUANT_SIZES[qtype][0]
    n_out, k = 13, 3 * qk if qk == 256 else 9 * qk
    raw = random_blocks(qtype, n_out * k // qk, rng)
    w = weights(qtype, raw, n_out, k)
    for m in (1, 2, 3, 4, 5, 7, 8, 11):
        x = rng.standard_normal((m, k)).astype(np.float32)
        check_bound(kernel(qtype, raw, x, n_out, simd), x, w)


@pytest.mark.parametrize("simd", SIMD)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_row_independent_of_row_count(qtype: T, simd: int) -> None:
    """A decode step (1 row) and a verify pass (many rows) give bit-identical rows."""
    rng = np.random.default_rng(200 + int(qtype))
    qk = GGML_QUANT_SIZES[qtype][0]
    n_out, k, m = 9, 2 * max(qk, 128), 11
    raw = random_blocks(qtype, n_out * k // qk, rng)
    x = rng.standard_normal((m, k)).astype(np.float32)
    many = kernel(qtype, raw, x, n_out, simd)
    for r in range(m):
        np.testing.assert_array_equal(kernel(qtype, raw, x[r:r + 1], n_out, simd)[0], many[r])
    np.testing.assert_array_equal(kernel(qtype, raw, x[3:6], n_out, simd), many[3:6])


@pytest.mark.parametrize("simd", SIMD)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_threads_give_the_same_bits(qtype: T, simd: int) -> None:
    """Output columns split over threads; sized so the kernel really splits (>= 2^19 weights
    per thread for 3 threads)."""
    rng = np.random.default_rng(300 + int(qtype))
    qk = GGML_QUANT_SIZES[qtype][0]
    n_out, k, m = 390, 4096, 3
    raw = random_blocks(qtype, n_out * k // qk, rng)
    x = rng.standard_normal((m, k)).astype(np.float32)
    one = kernel(qtype, raw, x, n_out, simd, threads=1)
    for threads in (2, 3, 64):
        np.testing.assert_array_equal(kernel(qtype, raw, x, n_out, simd, threads=threads), one)
    check_bound(one, x, weights(qtype, raw, n_out, k))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rejects_wrong_sizes(qtype: T) -> None:
    qk, nbytes = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, 4, np.random.default_rng(1))       # 4 rows of one block
    x, y = np.zeros((2, qk), np.float32), np.zeros((2, 4), np.float32)
    mm = qmatmul._qmatmul.matmul
    mm(int(qtype), raw, x, y, 4, qk, 2)
    with pytest.raises(ValueError, match="weight buffer"):
        mm(int(qtype), raw[:-1], x, y, 4, qk, 2)
    with pytest.raises(ValueError, match="weight buffer"):
        mm(int(qtype), np.concatenate([raw, raw[:nbytes]]), x, y, 4, qk, 2)
    with pytest.raises(ValueError, match=f"multiple of {qk}"):
        mm(int(qtype), raw, np.zeros((2, qk + 16), np.float32), y, 4, qk + 16, 2)
    with pytest.raises(ValueError, match="wrong size"):
        mm(int(qtype), raw, x, np.zeros((2, 3), np.float32), 4, qk, 2)
    with pytest.raises(ValueError, match="wrong size"):
        mm(int(qtype), raw, np.zeros((3, qk), np.float32), y, 4, qk, 2)
    with pytest.raises(ValueError, match="bad dimensions"):
        mm(int(qtype), raw, x, y, -4, qk, 2)


def test_rejects_types_without_a_kernel() -> None:
    x, y = np.zeros((1, 256), np.float32), np.zeros((1, 1), np.float32)
    for qtype in (T.IQ2_S, T.IQ4_XS, T.F32):
        with pytest.raises(ValueError, match="no native kernel"):
            qmatmul._qmatmul.matmul(int(qtype), np.zeros(1024, np.uint8), x, y, 1, 256, 1)


def test_init_tables_checks_before_replacing() -> None:
    """Bad tables are refused whole: the loaded ones stay in use."""
    ext = qmatmul._qmatmul
    raw = random_blocks(T.IQ2_XXS, 64, np.random.default_rng(5))
    x = np.random.default_rng(6).standard_normal((2, 256)).astype(np.float32)
    before = kernel(T.IQ2_XXS, raw, x, 64)
    good = [qmatmul._grid_bytes(T.IQ2_XXS, np.uint8), qmatmul._grid_bytes(T.IQ2_XS, np.uint8),
            qmatmul._grid_bytes(T.IQ3_XXS, np.uint8), qmatmul._grid_bytes(T.IQ1_S, np.int8),
            np.ascontiguousarray(qmatmul.gguf_py.KSIGNS)]
    zeros = np.zeros(256 * 8, np.uint8)                     # right size, but grid values must be >= 1
    with pytest.raises(ValueError, match="iq2xxs entry 0"):
        ext.init_tables(zeros, *good[1:])
    with pytest.raises(ValueError, match="iq1s has"):
        ext.init_tables(*good[:3], good[3][:-1], good[4])
    twos = np.full(2048 * 8, 2, np.uint8)                   # iq1s values must be -1, 0 or 1
    with pytest.raises(ValueError, match="outside"):
        ext.init_tables(*good[:3], twos, good[4])
    with pytest.raises(ValueError, match="ksigns"):
        ext.init_tables(*good[:4], good[4][:100])
    for i, name, width in ((0, "iq2xxs", 8), (2, "iq3xxs", 4)):   # magnitudes above 62 would overflow
        big = good[i].copy()                                           # the AVX2 kernel's 16-bit sums
        big.reshape(-1, width)[7, 2] = 63
        with pytest.raises(ValueError, match=f"{name} entry 7 has value 63"):
            ext.init_tables(*good[:i], big, *good[i + 1:])
    np.testing.assert_array_equal(kernel(T.IQ2_XXS, raw, x, 64), before)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_quantized_matrix_uses_the_kernel(qtype: T) -> None:
    """QuantizedMatrix multiplies natively up to native_max_rows rows (with a float32 compute dtype,
    past NATIVE_MAX_ROWS too) and by dequantizing beyond; both agree with the float64 product."""
    rng = np.random.default_rng(400 + int(qtype))
    qk = GGML_QUANT_SIZES[qtype][0]
    n_out, k = 24, 2 * max(qk, 128)
    raw = random_blocks(qtype, n_out * k // qk, rng)
    q = QuantizedMatrix(torch.from_numpy(raw.copy()), qtype, (k, n_out))
    assert q.native
    w = weights(qtype, raw, n_out, k)
    for m in (1, 3, NATIVE_MAX_ROWS[qtype] + 3):
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
        y = q.matmul(x)
        assert y.dtype == torch.float32 and y.shape == (m, n_out)
        if m <= native_max_rows(qtype, torch.float32):
            np.testing.assert_array_equal(y.numpy(), kernel(qtype, raw, x.numpy(), n_out))
        check_bound(y.numpy(), x.numpy(), w)


def test_quantized_matrix_needs_whole_block_rows() -> None:
    """ggml rows are whole blocks; a shape whose total is whole blocks but its rows are not is refused."""
    with pytest.raises(ValueError, match="not whole blocks"):
        QuantizedMatrix(torch.zeros(2 * 144, dtype=torch.uint8), T.Q4_K, (128, 4))
