"""One row of x (a decode step) on the default int8 path, which has kernels of its own for it.

Contract (native/qm_i8.h, "int8 activations"): the default path's one-row result is bit for bit
the result of every other path (the folding and transposed 512-bit direct paths, the 256-bit
one, the panels), on every SIMD level and thread count, and within the float32 rounding bound
of the float64 product. The one-row kernels of MXFP4 (AVX512-VBMI) and Q4_K (AVX512-VNNI)
arrange a group's bytes their own way and copy x to match, and Q4_K unpacks its 6-bit scales
and mins with byte shuffles; these cases hit whole groups, a partial last group, no whole group,
every MXFP4 exponent byte (0 and 1 take the subnormal scales, 255 the largest), every Q4_K
scale byte, and rows split over 2 threads.

On AVX2 (and with simd=1 on any x86 CPU) Q4_K, Q8_0 and MXFP4 have direct kernels of their own
for 1-32 rows, Q6_K for 1-11 and IQ1_S for one (unsigned maddubs operands, 16-bit folds, MXFP4's
values biased by 12, Q6_K's by 32, IQ1_S's by 9, their sums corrected from X; from 2 rows a
transpose per block): their rows
equal the generic 256-bit direct path's, the panels' and the scalar path's bit for bit, alone
and in calls of 2-9 rows.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from test_qmatmul_int8 import SIMD, activations, blocks, dequantize_q8, product, q8
from test_qmatmul_types import check_bound, weights

from k3kit.kernels import qmatmul
from k3kit.kernels.qmatmul import ACT_TYPE

pytestmark = pytest.mark.skipif(not qmatmul.native_available(), reason="native kernel not built")

# (k, n_out); 64, 128 and 256 values: no whole group, the partial group's counts compiled as constants
SHAPES = [(3584, 96), (3072, 41), (512, 7), (544, 9), (32, 3), (2592, 33), (64, 13), (128, 9), (256, 6)]
Q4K_SHAPES = [(7168, 40), (2304, 17), (256, 5), (512, 3)]


def mxfp4_all_exponents(n_out: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random MXFP4 blocks whose exponent bytes run through 0..255 (then repeat)."""
    raw = blocks(T.MXFP4, n_out * k // 32, rng).reshape(-1, 17)
    raw[:, 0] = np.arange(raw.shape[0]) % 256
    return raw.reshape(-1)


@pytest.mark.parametrize("k,n_out", SHAPES, ids=lambda v: str(v))
def test_mxfp4_row_same_bits_on_every_path(k: int, n_out: int) -> None:
    rng = np.random.default_rng(k + n_out)
    raw = blocks(T.MXFP4, n_out * k // 32, rng)
    x = activations(rng, 1, k)
    one = product(T.MXFP4, raw, x, n_out)
    xd = dequantize_q8(q8(x, ACT_TYPE[T.MXFP4]), ACT_TYPE[T.MXFP4], 1, k).astype(np.float32)
    check_bound(one, xd, weights(T.MXFP4, raw, n_out, k))
    for simd in SIMD:
        for path in (-1, 0, 1, 2, 4):
            for threads in (1, 2):
                y = product(T.MXFP4, raw, x, n_out, simd, threads=threads, path=path)
                np.testing.assert_array_equal(y, one, err_msg=f"simd {simd} path {path} threads {threads}")


def test_mxfp4_row_every_exponent() -> None:
    """Every E8M0 byte, with x rows large and tiny: the one-row kernel's scales are the folding
    path's (checked bit for bit; the bound only where the product is finite)."""
    k, n_out = 1024, 80      # 2560 blocks: each exponent byte 10 times
    rng = np.random.default_rng(7)
    raw = mxfp4_all_exponents(n_out, k, rng)
    for scale in (1e-6, 1.0, 50.0):
        x = (rng.standard_normal((1, k)) * scale).astype(np.float32)
        one = product(T.MXFP4, raw, x, n_out)
        for path in (0, 2, 4):
            np.testing.assert_array_equal(one, product(T.MXFP4, raw, x, n_out, path=path))
        assert np.isfinite(one).any()


def test_mxfp4_row_in_a_call_of_many_rows() -> None:
    """The decode row alone equals the same row inside calls of 2-9 rows (other kernels)."""
    k, n_out = 3584, 64
    rng = np.random.default_rng(3)
    raw = blocks(T.MXFP4, n_out * k // 32, rng)
    x = activations(rng, 9, k)
    alone = np.concatenate([product(T.MXFP4, raw, x[i:i + 1], n_out, threads=2) for i in range(9)])
    for m in (2, 5, 9):
        np.testing.assert_array_equal(product(T.MXFP4, raw, x[:m], n_out), alone[:m])


@pytest.mark.parametrize("k,n_out", Q4K_SHAPES, ids=lambda v: str(v))
def test_q4_k_row_same_bits_on_every_path(k: int, n_out: int) -> None:
    rng = np.random.default_rng(k + 3 * n_out)
    raw = blocks(T.Q4_K, n_out * k // 256, rng).reshape(-1, 144)
    raw[:, 4:16] = rng.integers(0, 256, size=(raw.shape[0], 12), dtype=np.uint8)   # every scale/min bit
    raw = raw.reshape(-1)
    x = activations(rng, 1, k)
    one = product(T.Q4_K, raw, x, n_out)
    xd = dequantize_q8(q8(x, ACT_TYPE[T.Q4_K]), ACT_TYPE[T.Q4_K], 1, k).astype(np.float32)
    check_bound(one, xd, weights(T.Q4_K, raw, n_out, k))
    for simd in SIMD:
        for path in (-1, 0, 1, 2, 4):
            for threads in (1, 2):
                y = product(T.Q4_K, raw, x, n_out, simd, threads=threads, path=path)
                np.testing.assert_array_equal(y, one, err_msg=f"simd {simd} path {path} threads {threads}")


# whole groups, partial last groups, none whole (256 values: 8 sub-blocks, a count compiled as a constant)
AVX2_SHAPES = [(7168, 19), (2304, 9), (256, 5), (768, 3)]


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0, T.MXFP4, T.Q6_K, T.Q2_K, T.Q3_K, T.Q5_K, T.IQ1_S,
                                   T.IQ1_M, T.IQ2_XXS, T.IQ3_XXS],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("k,n_out", AVX2_SHAPES, ids=lambda v: str(v))
def test_avx2_own_kernels_same_bits_for_few_rows(qtype: T, k: int, n_out: int) -> None:
    rng = np.random.default_rng(k + 5 * n_out + int(qtype))
    raw = blocks(qtype, n_out * k // GGML_QUANT_SIZES[qtype][0], rng)
    if qtype == T.Q4_K:
        raw = raw.reshape(-1, 144)
        raw[:, 4:16] = rng.integers(0, 256, size=(raw.shape[0], 12), dtype=np.uint8)
        raw = raw.reshape(-1)
    if qtype == T.Q8_0:   # -128 (outside ggml's quantizer, possible in a file) and 127
        raw = raw.reshape(-1, 34)
        raw[::7, 2:6] = np.array([0x80, 0x7F, 0x80, 0x80], np.uint8)
        raw = raw.reshape(-1)
    x = activations(rng, 9, k)
    x[0] *= 1e-3
    alone = np.concatenate([product(qtype, raw, x[i:i + 1], n_out, 1) for i in range(9)])
    xd = dequantize_q8(q8(x, ACT_TYPE[qtype]), ACT_TYPE[qtype], 9, k).astype(np.float32)
    w = weights(qtype, raw, n_out, k)
    check_bound(alone, xd, w)
    scalar = product(qtype, raw, x, n_out, 0)
    np.testing.assert_array_equal(alone, scalar)
    for m in (2, 3, 5, 8, 9):
        for path in (-1, 0, 1):
            y = product(qtype, raw, x[:m], n_out, 1, threads=1 + m % 2, path=path)
            np.testing.assert_array_equal(y, alone[:m], err_msg=f"{m} rows, path {path}")
