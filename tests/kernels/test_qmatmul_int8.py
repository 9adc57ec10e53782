"""The int8-activation products (ggml's own arithmetic, `matmul_q8`) and their row quantizers.

Contract (see "int8 activations" in native/qm_i8.h): rows of x are rounded to ggml's Q8_0 / Q8_K
blocks bit for bit as ggml does (the reference quantizers and the x86 CPU backend's), and
x @ W.T is then an integer dot product per scale's run of values; the result agrees with the
float64 product of the dequantized W and the dequantized activation blocks to the float32
rounding bound, and a row's bits depend on nothing else: not the SIMD level, not the path
(direct or panels), not the number of rows in the call, not the thread count.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from test_qmatmul_types import check_bound, random_blocks, weights

from k3kit.kernels import qmatmul
from k3kit.kernels.qmatmul import ACT_TYPE, QuantizedMatrix

pytestmark = pytest.mark.skipif(not qmatmul.native_available(), reason="native kernel not built")

TYPES = [T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4, T.Q2_K, T.Q3_K, T.IQ2_XXS, T.IQ2_XS, T.IQ3_XXS,
         T.IQ1_S, T.IQ1_M]
SIMD = [0, 1, 2]      # scalar, AVX2, AVX512-VNNI: capped at what the CPU runs
Q8_K_BYTES = 292


def blocks(qtype: T, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    if qtype == T.MXFP4:   # random bytes with exponents around 1 (random_blocks has no MXFP4 entry)
        b = rng.integers(0, 256, size=(n_blocks, 17), dtype=np.uint8)
        b[:, 0] = rng.integers(110, 140, size=n_blocks)
        return b.reshape(-1)
    return random_blocks(qtype, n_blocks, rng)


def activations(rng: np.random.Generator, m: int, k: int) -> np.ndarray:
    """Rows of mixed magnitude, with a zero row and a zero 256-value stretch (zero blocks)."""
    x = rng.standard_normal((m, k)) * rng.choice([1e-4, 1.0, 300.0], size=(m, 1))
    x = x.astype(np.float32)
    if m > 2:
        x[1] = 0.0
        x[2, :256] = 0.0
    return x


def q8(x: np.ndarray, act: T, variant: int = 1) -> np.ndarray:
    m, k = x.shape
    qk, nbytes = (256, Q8_K_BYTES) if act == T.Q8_K else (32, 34)
    out = np.empty((m, k // qk * nbytes), np.uint8)
    qmatmul._qmatmul.quantize_q8(np.ascontiguousarray(x), out, int(act), m, k, variant)
    return out


def dequantize_q8(raw: np.ndarray, act: T, m: int, k: int) -> np.ndarray:
    """The activation blocks' values, d * q, in float64."""
    if act == T.Q8_K:
        b = raw.reshape(m, k // 256, Q8_K_BYTES)
        d = b[:, :, :4].copy().view(np.float32).astype(np.float64)
        q = b[:, :, 4:260].view(np.int8).astype(np.float64)
    else:
        b = raw.reshape(m, k // 32, 34)
        d = b[:, :, :2].copy().view(np.float16).astype(np.float64)
        q = b[:, :, 2:].view(np.int8).astype(np.float64)
    return (q * d).reshape(m, k)


def product(qtype: T, raw: np.ndarray, x: np.ndarray, n_out: int, simd: int = -1, threads: int = 1,
            path: int = -1) -> np.ndarray:
    m, k = x.shape
    y = np.full((m, n_out), np.nan, dtype=np.float32)
    qmatmul._qmatmul.matmul_q8(int(qtype), raw, np.ascontiguousarray(x), y, n_out, k, m, simd, threads, 1,
                               path)
    return y


def setup(qtype: T, n_out: int, k: int, seed: int) -> tuple[np.random.Generator, np.ndarray]:
    rng = np.random.default_rng(seed + int(qtype))
    return rng, blocks(qtype, n_out * k // GGML_QUANT_SIZES[qtype][0], rng)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("whole", [True, False], ids=["whole", "partial"])
def test_matches_float64_product_on_every_path(qtype: T, whole: bool) -> None:
    """Whole groups of lanes (k = 2560: 5 groups of 512 values, 10 of 256) or a partial last one
    (k = 2304 / 2592); rows around the tile heights and the 512-bit direct path's passes (8, 4,
    then 1-3 rows). Paths: 0 the 256-bit direct path, 1 panels, 2 the folding 512-bit direct path,
    4 the transposed 512-bit direct path (its chunks of groups and of W rows: 15 rows > one pass)."""
    qk = GGML_QUANT_SIZES[qtype][0]
    if not whole and qk == 256 and qtype in (T.Q6_K, T.Q2_K, T.Q3_K, T.IQ2_XS, T.IQ1_M):
        pytest.skip("16-value lanes: a group is one 256-value block, never partial")
    k = 2560 if whole else 2304 if qk == 256 else 2592
    n_out = 13
    rng, raw = setup(qtype, n_out, k, 0)
    w = weights(qtype, raw, n_out, k)
    for m in (1, 2, 3, 5, 8, 15):
        x = activations(rng, m, k)
        xd = dequantize_q8(q8(x, ACT_TYPE[qtype]), ACT_TYPE[qtype], m, k).astype(np.float32)
        ys = [product(qtype, raw, x, n_out, simd, path=path) for simd in SIMD for path in (0, 1, 2, 4)]
        check_bound(ys[0], xd, w)
        for y in ys[1:]:
            np.testing.assert_array_equal(y, ys[0])


@pytest.mark.parametrize("qtype", [T.Q8_0, T.MXFP4], ids=lambda t: t.name)
@pytest.mark.parametrize("k", [64, 96, 128, 256])
def test_short_rows_match_on_every_path(qtype: T, k: int) -> None:
    """Rows shorter than one group (a small model's every product: 2, 4 or 8 blocks take copies
    of the folding path compiled for those counts): every path and SIMD level, the same bits as
    the 256-bit direct path, within the float64 product's bound."""
    n_out = 21
    rng, raw = setup(qtype, n_out, k, k)
    w = weights(qtype, raw, n_out, k)
    for m in (1, 2, 3, 5, 8):
        x = activations(rng, m, k)
        xd = dequantize_q8(q8(x, ACT_TYPE[qtype]), ACT_TYPE[qtype], m, k).astype(np.float32)
        ys = [product(qtype, raw, x, n_out, simd, path=path) for simd in SIMD for path in (0, 1, 2, 4, -1)]
        check_bound(ys[0], xd, w)
        for y in ys[1:]:
            np.testing.assert_array_equal(y, ys[0])


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q6_K, T.MXFP4, T.IQ1_M], ids=lambda t: t.name)
def test_row_independent_of_row_count(qtype: T) -> None:
    """A decode row, the same row inside a verify pass (2-16 rows) and inside a prefill chunk
    (past the 64-row block) are bit-identical, on the direct and the panel path alike."""
    k = 512 if GGML_QUANT_SIZES[qtype][0] == 256 else 544
    n_out, m = 37, 70
    rng, raw = setup(qtype, n_out, k, 10)
    x = activations(rng, m, k)
    many = product(qtype, raw, x, n_out)
    for r in (0, 1, 5, 33, 69):
        np.testing.assert_array_equal(product(qtype, raw, x[r:r + 1], n_out)[0], many[r])
    for a, b in ((3, 6), (10, 26), (60, 70)):
        np.testing.assert_array_equal(product(qtype, raw, x[a:b], n_out), many[a:b])


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4, T.IQ1_S], ids=lambda t: t.name)
def test_threads_give_the_same_bits(qtype: T) -> None:
    n_out, k = 390, 4096           # >= 2^19 weights per thread for 3 threads: the call really splits
    rng, raw = setup(qtype, n_out, k, 20)
    for m in (1, 7):
        x = activations(rng, m, k)
        one = product(qtype, raw, x, n_out, threads=1)
        for threads in (2, 3, 64):
            for path in (-1, 2, 4):
                np.testing.assert_array_equal(product(qtype, raw, x, n_out, threads=threads, path=path), one)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.MXFP4, T.IQ1_S], ids=lambda t: t.name)
def test_batched_rows_match_one_row_at_a_time(qtype: T) -> None:
    """Batch invariance for a server: a row's output is the same bits whether it is multiplied
    alone or among 2-16 others (the default path switches between the folding and the transposed
    direct path by row count), on 1 or 2 threads (a K3 expert's shape: the call really splits)."""
    n_out, k = 160, 7168           # >= 2^19 weights per thread for 2 threads
    rng, raw = setup(qtype, n_out, k, 60)
    x = activations(rng, 16, k)
    alone = np.concatenate([product(qtype, raw, x[r:r + 1], n_out) for r in range(16)])
    for m in (2, 3, 4, 5, 8, 9, 16):
        for threads in (1, 2):
            np.testing.assert_array_equal(product(qtype, raw, x[:m], n_out, threads=threads), alone[:m])


def test_rejects_bad_calls() -> None:
    ext = qmatmul._qmatmul
    raw = blocks(T.Q4_K, 4, np.random.default_rng(1))
    x, y = np.zeros((2, 256), np.float32), np.zeros((2, 4), np.float32)
    ext.matmul_q8(int(T.Q4_K), raw, x, y, 4, 256, 2)
    with pytest.raises(ValueError, match="weight buffer"):
        ext.matmul_q8(int(T.Q4_K), raw[:-1], x, y, 4, 256, 2)
    with pytest.raises(ValueError, match="multiple of 256"):
        ext.matmul_q8(int(T.Q4_K), raw, np.zeros((2, 272), np.float32), y, 4, 272, 2)
    with pytest.raises(ValueError, match="wrong size"):
        ext.matmul_q8(int(T.Q4_K), raw, x, np.zeros((2, 3), np.float32), 4, 256, 2)
    with pytest.raises(ValueError, match="no native kernel"):
        ext.matmul_q8(int(T.IQ4_XS), raw, x, y, 4, 256, 2)
    with pytest.raises(ValueError, match="neither Q8_0"):
        ext.quantize_q8(x, np.zeros(584, np.uint8), int(T.Q4_K), 2, 256)
    with pytest.raises(ValueError, match="wrong size"):
        ext.quantize_q8(x, np.zeros(583, np.uint8), int(T.Q8_K), 2, 256)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.MXFP4], ids=lambda t: t.name)
def test_quantized_matrix_ggml_arith(qtype: T) -> None:
    """arith="ggml" runs matmul_q8 for every row count (so a decode row equals the same row in a
    verify pass), out in x's dtype; arith="float" keeps the float32-activation kernels."""
    k, n_out = 512, 24
    rng, raw = setup(qtype, n_out, k, 30)
    q = QuantizedMatrix(torch.from_numpy(raw.copy()), qtype, (k, n_out), arith="ggml")
    assert q.arith == "ggml" and q.invariant_rows > 1 << 30
    x = torch.from_numpy(activations(rng, 100, k))
    y = q.matmul(x)
    np.testing.assert_array_equal(y.numpy(), product(qtype, raw, x.numpy(), n_out))
    np.testing.assert_array_equal(q.matmul(x[4:5]).numpy(), y[4:5].numpy())
    assert q.matmul(x.to(torch.bfloat16)).dtype == torch.bfloat16
    f = QuantizedMatrix(torch.from_numpy(raw.copy()), qtype, (k, n_out))
    assert f.arith == "float" and f.invariant_rows == qmatmul.native_max_rows(qtype, torch.float32)
    check_bound(f.matmul(x[:3]).numpy(), x[:3].numpy(), weights(qtype, raw, n_out, k))
    with pytest.raises(ValueError, match="arith"):
        QuantizedMatrix(torch.from_numpy(raw.copy()), qtype, (k, n_out), arith="int4")


# ---- against libggml (llama-cpp-python's build) ----------------------------------------------

@pytest.fixture(scope="module")
def cpu():  # type: ignore[no-untyped-def]
    pytest.importorskip("llama_cpp")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "interop"))
    import ggml_oracle
    lib = ggml_oracle.load_cpu()
    assert lib is not None, "llama_cpp is installed but libggml-cpu was not found in its lib dir"
    return lib


def tricky_rows(rng: np.random.Generator, k: int) -> np.ndarray:
    """Rows with ties (x * 127 / amax at n + 1/2), tiny (f16-subnormal scales), huge and zero blocks."""
    x = activations(rng, 24, k)
    x[3, :32] = np.arange(32) - 15.5
    x[3, 0] = 127.0                                             # amax 127: id = 1, every value a tie
    x[4, :256] = (np.arange(256) % 17 - 8.5) * (127.0 / 8.5)    # Q8_K ties
    x[5] *= np.float32(1e-9)
    x[6, :64] = np.float32(3e6)
    return x


@pytest.mark.interop
def test_q8_0_quantizers_are_ggmls(cpu) -> None:  # type: ignore[no-untyped-def]
    import ggml_oracle
    x = tricky_rows(np.random.default_rng(40), 1024)
    ref = ggml_oracle.quantize_row_ref(cpu.base, x, "q8_0", 1024 // 32 * 34)
    np.testing.assert_array_equal(q8(x, T.Q8_0, variant=0), ref)
    np.testing.assert_array_equal(q8(x, T.Q8_0, variant=1), cpu.from_float(x, int(T.Q8_0)))
    assert not np.array_equal(ref, cpu.from_float(x, int(T.Q8_0)))   # the ties tell the two apart


@pytest.mark.interop
def test_q8_k_quantizer_is_ggmls(cpu) -> None:  # type: ignore[no-untyped-def]
    import ggml_oracle
    x = tricky_rows(np.random.default_rng(41), 1024)
    ours = q8(x, T.Q8_K)
    np.testing.assert_array_equal(ours, ggml_oracle.quantize_row_ref(cpu.base, x, "q8_K", 4 * Q8_K_BYTES))
    np.testing.assert_array_equal(ours, cpu.from_float(x, int(T.Q8_K)))


@pytest.mark.interop
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_same_activation_type_and_dot_as_ggml(cpu, qtype: T) -> None:  # type: ignore[no-untyped-def]
    """ggml's vec_dot_type is ours, and ggml-cpu's own dot product of each W row with the same
    activation blocks agrees with ours to float32 rounding (the integer sums are the same)."""
    assert cpu.vec_dot_type(int(qtype)) == int(ACT_TYPE[qtype])
    k = 1024
    n_out = 16
    rng, raw = setup(qtype, n_out, k, 50)
    x = activations(rng, 3, k)
    xq = q8(x, ACT_TYPE[qtype])
    ours = product(qtype, raw, x, n_out).astype(np.float64)
    w = weights(qtype, raw, n_out, k).astype(np.float64)
    xd = dequantize_q8(xq, ACT_TYPE[qtype], 3, k)
    bound = (np.abs(xd) @ np.abs(w).T) * (k + 8) * 2.0**-24 + 1e-30
    row = raw.size // n_out
    theirs = np.array([[cpu.vec_dot(raw[n * row:(n + 1) * row], xq[r], int(qtype), k) for n in range(n_out)]
                       for r in range(3)])
    ratio = np.abs(ours - theirs) / bound
    assert (ratio <= 2).all(), f"max |diff| / bound {ratio.max():.3g}"


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.MXFP4, T.IQ3_XXS], ids=lambda t: t.name)
def test_long_decode_row_same_on_every_path(qtype: T) -> None:
    """A decode row as long as K3's ffn_down input (18432 values: its bytes and lane scales outgrow
    L1) on the default path (the 512-bit direct one, which lays out x without the panels' copy),
    forced onto the 256-bit direct path, the panels and the transposed path, at 1 and 2 threads:
    the same bits, within the float64 product's rounding bound."""
    n_out, k = 40, 18432           # 737280 weights: >= 2^19 per thread only below 2 threads
    rng, raw = setup(qtype, n_out, k, 70)
    w = weights(qtype, raw, n_out, k)
    x = activations(rng, 1, k)
    xd = dequantize_q8(q8(x, ACT_TYPE[qtype]), ACT_TYPE[qtype], 1, k).astype(np.float32)
    one = product(qtype, raw, x, n_out)
    check_bound(one, xd, w)
    for path in (0, 1, 2, 4):
        for threads in (1, 2):
            np.testing.assert_array_equal(product(qtype, raw, x, n_out, threads=threads, path=path), one)
