"""k3kit's numpy codecs against libggml (llama-cpp-python 0.3.36): byte- and bit-exact.

Quantizers are compared with `ggml_quantize_chunk` (no imatrix, i.e. `quantize_row_*_ref`),
dequantizers with each type's `to_float` (`dequantize_row_*`), floats compared as bit patterns.

Blocks quantized and compared, all seeded, spread evenly over the data kinds in `KINDS`
(gaussian at several scales, uniform, positive-only, negative-only, heavy-tailed, constant,
all-zero, tiny 1e-30, subnormal, huge 1e30, near FLT_MAX, one outlier per block, exact rounding ties,
amax just below a power of two, random finite bit patterns, sparse, powers of two, and a few
inf/NaN elements):

    Q8_0   500_000 blocks (16.0 M values)
    MXFP4  400_000 blocks (12.8 M values)
    Q4_K   120_000 blocks (30.7 M values)
    total 1_020_000 blocks (each count rounded up to a whole number of blocks per kind)

plus F16 and BF16 on 2^24 float32 patterns (every sign/exponent/top-15-mantissa-bit combination
with a random low byte) and the dequantizers of F16/BF16 on all 65536 patterns and of
Q8_0/Q4_K/Q5_K/Q6_K/MXFP4 on random bytes.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from k3kit.gguf import quants

pytest.importorskip("llama_cpp")
import ggml_oracle  # noqa: E402

pytestmark = pytest.mark.interop

F = np.float32
COUNTS = {T.Q8_0: 500_000, T.MXFP4: 400_000, T.Q4_K: 120_000}


@pytest.fixture(scope="module")
def ggml() -> ggml_oracle.Ggml:
    lib = ggml_oracle.load()
    assert lib is not None, "llama_cpp is installed but libggml-base was not found in its lib dir"
    return lib


def _ties(rng, n, b):
    # half-integers with an exact 127 in every block: Q8_0's x/d lands on .5, MXFP4 and Q4_K
    # grids meet midpoints; scaled by a power of two so the ties survive
    q = rng.integers(-254, 255, (n, b)) / 2.0
    q[:, 0] = 127.0
    return q * 2.0 ** rng.integers(-6, 6, (n, 1))


def _below_pow2(rng, n, b):
    x = rng.uniform(-1, 1, (n, b))
    x[:, rng.integers(b)] = 1.0
    x *= 2.0 ** rng.integers(-20, 20, (n, 1))
    x = x.astype(F)
    x[:, :1] = np.nextafter(np.abs(x[:, :1]), F(0))  # amax just below 2^k
    return x


def _outlier(rng, n, b):
    x = rng.standard_normal((n, b)) * 0.01
    x[np.arange(n), rng.integers(0, b, n)] = rng.choice([-50.0, 50.0], n)
    return x


def _finite_bits(rng, n, b):
    x = rng.integers(0, 2**32, (n, b), dtype=np.uint64).astype(np.uint32).view(F)
    return np.where(np.isfinite(x), x, F(1.0))


def _nonfinite(rng, n, b):
    x = rng.standard_normal((n, b))
    m = rng.random((n, b))
    x[m < 0.01] = np.inf
    x[(m >= 0.01) & (m < 0.02)] = -np.inf
    x[(m >= 0.02) & (m < 0.03)] = np.nan
    return x


KINDS = {
    "gauss": lambda r, n, b: r.standard_normal((n, b)),
    "gauss_1e-3": lambda r, n, b: r.standard_normal((n, b)) * 1e-3,
    "gauss_1e3": lambda r, n, b: r.standard_normal((n, b)) * 1e3,
    "gauss_logscale": lambda r, n, b: r.standard_normal((n, b)) * 10.0 ** r.uniform(-8, 8, (n, 1)),
    "uniform": lambda r, n, b: r.uniform(-1, 1, (n, b)),
    "positive": lambda r, n, b: r.uniform(0, 3, (n, b)),
    "negative": lambda r, n, b: -np.abs(r.standard_normal((n, b))),
    "student_t2": lambda r, n, b: r.standard_t(2, (n, b)),
    "cauchy": lambda r, n, b: r.standard_cauchy((n, b)),
    "constant": lambda r, n, b: np.repeat(r.standard_normal((n, 1)), b, axis=1),
    "constant_32": lambda r, n, b: np.repeat(r.standard_normal((n, b // 32)), 32, axis=1),
    "zero": lambda r, n, b: np.where(r.random((n, b)) < 0.5, 0.0, -0.0),
    "tiny": lambda r, n, b: r.standard_normal((n, b)) * 1e-30,
    "subnormal": lambda r, n, b: r.standard_normal((n, b)) * 10.0 ** r.uniform(-45, -38, (n, 1)),
    "huge": lambda r, n, b: r.standard_normal((n, b)) * 1e30,
    "near_flt_max": lambda r, n, b: r.uniform(-1, 1, (n, b)) * 3.4028234e38,
    "outlier": _outlier,
    "ties": _ties,
    "below_pow2": _below_pow2,
    "finite_bits": _finite_bits,
    "sparse": lambda r, n, b: r.standard_normal((n, b)) * (r.random((n, b)) < 0.05),
    "pow2": lambda r, n, b: r.choice([-1.0, 1.0], (n, b)) * 2.0 ** r.integers(-12, 12, (n, b)),
    "nonfinite": _nonfinite,
}


def _data(qtype, seed):
    blk = quants.type_size(qtype)[0]
    per_kind = -(-COUNTS[qtype] // len(KINDS))
    for i, (name, make) in enumerate(KINDS.items()):
        rng = np.random.default_rng([seed, i])
        with np.errstate(all="ignore"):
            x = np.asarray(make(rng, per_kind, blk)).astype(F)
        yield name, x


def _first_bad(a: np.ndarray, b: np.ndarray) -> int | None:
    bad = np.flatnonzero(np.any(a != b, axis=-1))
    return int(bad[0]) if bad.size else None


@pytest.mark.parametrize("qtype", [T.Q8_0, T.MXFP4, T.Q4_K], ids=lambda t: t.name)
def test_quantize_and_dequantize_bit_exact(ggml, qtype):
    blk, nbytes = quants.type_size(qtype)
    total = 0
    for name, x in _data(qtype, seed=int(qtype)):
        ours = quants.quantize(x, qtype)
        theirs = ggml.quantize(x, qtype)
        i = _first_bad(ours, theirs)
        assert i is None, (
            f"{qtype.name} {name}: block {i} differs\n"
            f"x={x[i].tolist()}\nours={ours[i].tolist()}\nggml={theirs[i].tolist()}"
        )
        y_ours = quants.dequantize(theirs, qtype, x.size).view(np.uint32)
        y_theirs = ggml.dequantize(theirs, qtype, x.size).view(np.uint32)
        assert np.array_equal(y_ours, y_theirs), f"{qtype.name} {name}: dequantized values differ"
        total += x.shape[0]
    assert total >= COUNTS[qtype]


@pytest.mark.parametrize("qtype", [T.F16, T.BF16], ids=lambda t: t.name)
def test_float_conversions_bit_exact(ggml, qtype):
    rng = np.random.default_rng(int(qtype))
    hi = np.arange(1 << 24, dtype=np.uint32) << 8
    x = (hi | rng.integers(0, 256, hi.size, dtype=np.uint32)).view(F).reshape(4096, 4096)
    ours = quants.quantize(x, qtype)
    theirs = ggml.quantize(x, qtype)
    i = _first_bad(ours.reshape(-1, 2), theirs.reshape(-1, 2))
    assert i is None, f"{qtype.name}: float32 bits {x.reshape(-1)[i].view(np.uint32):#x} differ"
    every = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.uint8)
    y_ours = quants.dequantize(every, qtype, 65536).view(np.uint32)
    y_theirs = ggml.dequantize(every, qtype, 65536).view(np.uint32)
    assert np.array_equal(y_ours, y_theirs)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4], ids=lambda t: t.name)
def test_dequantize_random_bytes_bit_exact(ggml, qtype):
    """Fully random blocks reach every nibble, high bit, 6-bit scale and exponent byte, and
    fp16 scales that are subnormal, inf or NaN (NaN payloads must travel the same way)."""
    blk, nbytes = quants.type_size(qtype)
    n = 20_000
    rng = np.random.default_rng(100 + int(qtype))
    raw = rng.integers(0, 256, (n, nbytes), dtype=np.uint8)
    ours = quants.dequantize(raw, qtype, n * blk).view(np.uint32)
    theirs = ggml.dequantize(raw, qtype, n * blk).view(np.uint32)
    i = _first_bad(ours.reshape(n, blk), theirs.reshape(n, blk))
    assert i is None, f"{qtype.name}: block {i} differs: {raw[i].tolist()}"
