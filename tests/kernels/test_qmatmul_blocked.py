"""The native kernels' many-row driver (panels) and QuantizedMatrix's chunked dequantize + GEMM.

Few rows of x run per-row tiles that decode each block for every tile of rows; many rows decode
each block once into a float32 panel that every row reuses. Both give each (row of x, row of W)
pair the same operations in the same order, so a row's result is the same bits whatever the row
count, the path and the thread count (issue 12), and agrees with the float64 product of the
dequantized matrix to the float32 rounding bound. The shapes here cross every edge of the
driver: rows of W past a panel and not a multiple of the tile height, values spanning a partial
panel, rows of x past the row block and not a multiple of the tile height.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from test_qmatmul import mxfp4_bytes
from test_qmatmul_types import TYPES, check_bound, f16_scales, random_blocks, weights

from k3kit.kernels import qmatmul
from k3kit.kernels.dequant import dequantize
from k3kit.kernels.qmatmul import (
    NATIVE_MAX_ROWS,
    NATIVE_MAX_ROWS_F32,
    NATIVE_TYPES,
    QuantizedMatrix,
    native_max_rows,
)

pytestmark = pytest.mark.skipif(not qmatmul.native_available(), reason="native kernel not built")

ALL = [*TYPES, T.MXFP4]
SIMD = [0, 1, 2]      # scalar, AVX2, AVX-512 (capped at what the CPU has)
PANELS, TILES, AUTO = 1, 0, -1


def geometry(qtype: T) -> dict[str, int]:
    return qmatmul._qmatmul.tiling(int(qtype)) if qmatmul.native_available() else {}


def blocks(qtype: T, n_out: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Valid random blocks of any type here (Q4_0, no kernel: an f16 d, then nibbles)."""
    if qtype == T.MXFP4:
        return mxfp4_bytes(rng, n_out, k, 100, 160)
    n_blocks = n_out * k // GGML_QUANT_SIZES[qtype][0]
    if qtype == T.Q4_0:
        b = rng.integers(0, 256, size=(n_blocks, 18), dtype=np.uint8)
        b[:, 0:2] = f16_scales(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
        return b.reshape(-1)
    return random_blocks(qtype, n_blocks, rng)


def run(qtype: T, raw: np.ndarray, x: np.ndarray, n_out: int, simd: int = -1, threads: int = 1,
        path: int = AUTO) -> np.ndarray:
    """The extension's y = x @ W.T (y starts as NaN: every output must be written)."""
    m, k = x.shape
    y = np.full((m, n_out), np.nan, dtype=np.float32)
    qmatmul._qmatmul.matmul(int(qtype), raw, np.ascontiguousarray(x, dtype=np.float32), y, n_out, k, m, simd,
                            threads, path)
    return y


def edge_shape(qtype: T) -> tuple[int, int, int]:
    """(n_out, k, m) crossing each edge: a panel and a half plus 3 rows of W, one panel of values
    plus one 256-value block, a row block plus 7 rows of x."""
    g = geometry(qtype)
    return g["panel_rows"] * 3 // 2 + 3, g["panel_values"] + 256, g["row_block"] + 7


def test_tiling_is_consistent() -> None:
    for qtype in ALL:
        g = geometry(qtype)
        assert g["panel_values"] % 256 == 0 and g["panel_rows"] % 4 == 0 and g["row_block"] % 4 == 0
        assert 1 <= g["blocked_from"] <= g["row_block"]
        assert g["factored"] == (qtype in (T.MXFP4, T.IQ2_XXS, T.IQ3_XXS, T.IQ1_S))


@pytest.mark.parametrize("simd", SIMD)
@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_panels_match_float64_product(qtype: T, simd: int) -> None:
    """Forced onto panels, at row counts below, at and past the tile height and the row block."""
    rng = np.random.default_rng(500 + int(qtype))
    n_out, k, m_max = edge_shape(qtype)
    raw = blocks(qtype, n_out, k, rng)
    w = weights(qtype, raw, n_out, k)
    for m in (1, 2, 5, 13, m_max):
        x = rng.standard_normal((m, k)).astype(np.float32)
        check_bound(run(qtype, raw, x, n_out, simd, path=PANELS), x, w)


@pytest.mark.parametrize("simd", SIMD)
@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_row_is_the_same_bits_for_any_row_count_and_path(qtype: T, simd: int) -> None:
    """Row r of an m-row call (panels) == the one-row call on row r (tiles), bit for bit; and
    any slice of rows, either path, gives the same rows."""
    rng = np.random.default_rng(600 + int(qtype))
    n_out, k, m = edge_shape(qtype)
    raw = blocks(qtype, n_out, k, rng)
    x = rng.standard_normal((m, k)).astype(np.float32)
    many = run(qtype, raw, x, n_out, simd)                    # m > blocked_from: panels
    np.testing.assert_array_equal(run(qtype, raw, x, n_out, simd, path=TILES), many)
    np.testing.assert_array_equal(run(qtype, raw, x, n_out, simd, path=PANELS), many)
    for r in range(m):
        np.testing.assert_array_equal(run(qtype, raw, x[r:r + 1], n_out, simd)[0], many[r])
    for lo, hi in ((3, 16), (0, 5), (m - 11, m)):
        for path in (AUTO, TILES, PANELS):
            np.testing.assert_array_equal(run(qtype, raw, x[lo:hi], n_out, simd, path=path), many[lo:hi])


@pytest.mark.parametrize("simd", SIMD)
@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_panel_threads_give_the_same_bits(qtype: T, simd: int) -> None:
    """Output columns split over threads at boundaries that are not panel edges; sized so the
    kernel really splits (>= 2^19 weights per thread for 3 threads)."""
    rng = np.random.default_rng(700 + int(qtype))
    n_out, k, m = 390, 4096, 9
    raw = blocks(qtype, n_out, k, rng)
    x = rng.standard_normal((m, k)).astype(np.float32)
    one = run(qtype, raw, x, n_out, simd, threads=1, path=PANELS)
    for threads in (2, 3, 64):
        np.testing.assert_array_equal(run(qtype, raw, x, n_out, simd, threads=threads, path=PANELS), one)
    check_bound(one, x, weights(qtype, raw, n_out, k))


@pytest.mark.parametrize("simd", SIMD)
@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_panels_read_back_ggmls_weights(qtype: T, simd: int) -> None:
    """One-hot rows of x through panels read every weight back bit for bit (MXFP4: every e8m0
    scale, the subnormal and infinite ones included, against every byte)."""
    if qtype == T.MXFP4:
        b = np.zeros((256, 16, 17), dtype=np.uint8)
        b[:, :, 0] = np.arange(256, dtype=np.uint8)[:, None]
        b[:, :, 1:] = np.arange(256, dtype=np.uint8).reshape(16, 16)[None]
        raw, n_out = b.reshape(-1), 256 * 16
    else:
        n_out = 512
        raw = random_blocks(qtype, n_out, np.random.default_rng(800 + int(qtype)))
    qk = GGML_QUANT_SIZES[qtype][0]
    y = run(qtype, raw, np.eye(qk, dtype=np.float32), n_out, simd, path=PANELS)
    np.testing.assert_array_equal(y.T, weights(qtype, raw, n_out, qk))


@pytest.mark.parametrize("simd", SIMD)
@pytest.mark.parametrize("bf16", [0, 1])
@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_dequantize_is_the_torch_dequantizers(qtype: T, bf16: int, simd: int) -> None:
    """The extension's dequantize: bit-identical to k3kit's torch dequantizers (ggml's values;
    bfloat16 one round-to-nearest-even of those), rows split over threads."""
    rng = np.random.default_rng(900 + int(qtype))
    n_out, k = 77, 768
    raw = blocks(qtype, n_out, k, rng)
    if qtype == T.MXFP4:   # every e8m0 byte, subnormal and infinite scales included
        raw.reshape(-1, 17)[:, 0] = np.arange(raw.size // 17) % 256
    dtype = torch.bfloat16 if bf16 else torch.float32
    out = torch.full((n_out, k), float("nan"), dtype=dtype)
    buf = (out.view(torch.int16) if bf16 else out).numpy()
    qmatmul._qmatmul.dequantize(int(qtype), raw, buf, n_out, k, bf16, simd, 3)
    want = dequantize(raw, qtype, (k, n_out), dtype)
    assert torch.equal(out.view(torch.int16) if bf16 else out.view(torch.int32),
                       want.view(torch.int16) if bf16 else want.view(torch.int32))


def test_dequantize_rejects_wrong_sizes() -> None:
    raw = random_blocks(T.Q4_K, 4, np.random.default_rng(1))       # 4 rows of one block
    out = np.zeros((4, 256), np.float32)
    deq = qmatmul._qmatmul.dequantize
    deq(int(T.Q4_K), raw, out, 4, 256)
    with pytest.raises(ValueError, match="weight buffer"):
        deq(int(T.Q4_K), raw[:-1], out, 4, 256)
    with pytest.raises(ValueError, match="wrong size"):
        deq(int(T.Q4_K), raw, out, 4, 256, 1)                       # bf16 wants half the bytes
    with pytest.raises(ValueError, match="multiple of 256"):
        deq(int(T.Q4_K), raw, out, 8, 128)
    with pytest.raises(ValueError, match="no native kernel"):
        deq(int(T.IQ4_XS), raw, out, 4, 256)


def test_native_max_rows() -> None:
    """Every native type has a 16-bit limit; float32 has one only for the types that scale
    partial sums; types without a kernel never run natively."""
    assert set(NATIVE_MAX_ROWS) == set(NATIVE_TYPES)
    for qtype in NATIVE_TYPES:
        limit = NATIVE_MAX_ROWS[qtype]
        assert native_max_rows(qtype, torch.bfloat16) == native_max_rows(qtype, torch.float16) == limit
        f32 = native_max_rows(qtype, torch.float32)
        assert f32 == NATIVE_MAX_ROWS_F32.get(qtype, sys.maxsize) and f32 >= limit
        assert (qtype in NATIVE_MAX_ROWS_F32) == geometry(qtype)["factored"]
    assert native_max_rows(T.IQ4_XS, torch.float32) == native_max_rows(T.Q4_0, torch.bfloat16) == 0


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.MXFP4, T.Q4_0], ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemm_path_dequantizes_in_bounded_chunks(qtype: T, dtype: torch.dtype,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Past native_max_rows, W is dequantized a chunk of rows at a time into a buffer of at most
    GEMM_CHUNK_BYTES (natively where the type has a kernel), each chunk multiplied by torch: the
    product is the one of the whole dequantized matrix in the compute dtype. One row goes through
    the same chunks (matrix-vector)."""
    rng = np.random.default_rng(1000 + int(qtype))
    qk = GGML_QUANT_SIZES[qtype][0]
    n_out, k = 43, 2 * max(qk, 128)
    raw = blocks(qtype, n_out, k, rng)
    monkeypatch.setattr(qmatmul, "GEMM_CHUNK_BYTES", 5 * k * dtype.itemsize)       # chunks of 5 rows
    q = QuantizedMatrix(torch.from_numpy(raw.copy()), qtype, (k, n_out), dtype)
    chunks: list[int] = []
    rows_of = QuantizedMatrix._dequantize_rows

    def spy(self: QuantizedMatrix, r0: int, r1: int, out: torch.Tensor | None = None) -> torch.Tensor:
        chunks.append(r1 - r0)
        return rows_of(self, r0, r1, out)

    monkeypatch.setattr(QuantizedMatrix, "_dequantize_rows", spy)
    w = dequantize(raw, qtype, (k, n_out), dtype)
    for m in (1, 7):
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(dtype)
        chunks.clear()
        with torch.no_grad():
            y = q._gemm(x)
        assert y.dtype == dtype and y.shape == (m, n_out)
        assert chunks == [5] * 8 + [3]
        exact = x.double() @ w.double().t()
        rounding = (k + 8) * 2.0**-24 + (2.0**-8 if dtype != torch.float32 else 0.0)   # + the bf16 output
        bound = (x.double().abs() @ w.double().abs().t()) * rounding + 1e-30
        assert bool(((y.double() - exact).abs() <= bound).all())
    # matmul takes that path exactly past native_max_rows
    limit = native_max_rows(qtype, dtype)
    for m in (max(limit, 1), limit + 1) if limit < 100 else ():
        chunks.clear()
        q.matmul(torch.zeros(m, k, dtype=dtype))
        assert bool(chunks) == (m > limit)
