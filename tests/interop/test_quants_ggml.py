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

Every other quantized type gguf 0.19 lists (issue 12: Q4_0 ... Q1_0) is dequantized from ~1 M
values of random *valid* blocks (finite scales; `quants.random_blocks`) and compared bit for
bit; the test first asserts that those blocks hold every grid index, sign pattern / sign
index, sub-scale and delta value of the type, every fp16 scale exponent with both signs (every
MXFP4 exponent that cannot overflow, every NVFP4 scale code). Random bytes, NaN/inf scales
included, must match too, except the sign bit of NaNs from IQ2_*/IQ3_* blocks whose scale is
NaN: ggml's compiled loop applies the grid sign by flipping the sign bit, gguf-py multiplies by
-1 (which leaves a NaN's sign alone). Such blocks are corrupt and `quants.check_finite`
rejects them.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from k3kit.gguf import quants
from k3kit.gguf.quants import q4_k, scales

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


# ---- every type gguf 0.19 lists -----------------------------------------------------------

ISSUE_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
               T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_NL, T.IQ4_XS,
               T.TQ1_0, T.TQ2_0, T.MXFP4, T.NVFP4, T.Q1_0]
NAN_SIGN_FREE = frozenset({T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S})
VALUES = 1 << 20  # per type


def test_every_gguf_type_with_a_ggml_dequantizer_is_covered(ggml):
    for t in T:
        tr = ggml.traits(t)
        if tr.to_float:  # (gguf-py's Q8_1 size is stale, 40 vs ggml's 36; ggml cannot decode it)
            assert (tr.blck_size, tr.type_size) == GGML_QUANT_SIZES[t], t.name
            assert t in quants.DEQUANTIZE_TYPES, t.name
    assert set(ISSUE_TYPES) <= quants.DEQUANTIZE_TYPES


def _u16(raw: np.ndarray, off: int, n: int) -> np.ndarray:
    return raw[:, off : off + 2 * n].copy().view("<u2").astype(np.int64)


def _nib(b: np.ndarray) -> np.ndarray:
    return np.concatenate([b & 0xF, b >> 4], axis=1)


def _sign7(a: np.ndarray) -> np.ndarray:
    """[n, k, 4] bytes of uint32s -> their four 7-bit sign indices."""
    u = a.astype(np.int64)
    w = u[..., 0] | (u[..., 1] << 8) | (u[..., 2] << 16) | (u[..., 3] << 24)
    return np.stack([(w >> s) & 127 for s in (0, 7, 14, 21)], axis=-1)


def _fields(qtype: T, raw: np.ndarray) -> dict[str, tuple[np.ndarray, int]]:
    """Each coded field of the blocks with the number of values it can take."""
    n = raw.shape[0]
    f: dict[str, tuple[np.ndarray, int]] = {}
    if qtype in scales.F16_SCALES or qtype == T.IQ1_M:
        if qtype == T.IQ1_M:
            words = [scales.iq1_m_scale_bits(raw).astype(np.int64)]
        else:
            words = [_u16(raw, off, 1)[:, 0] for off in scales.F16_SCALES[qtype]]
        for k, w in enumerate(words):
            f[f"scale{k} sign+exponent"] = (w >> 10, 62)  # 31 finite exponents x 2 signs
    if qtype in (T.Q4_0, T.Q4_1, T.IQ4_NL):
        f["nibble"] = (_nib(raw[:, -16:]), 16)
    if qtype in (T.Q5_0, T.Q5_1):
        qh = np.unpackbits(raw[:, -20:-16], axis=1, bitorder="little")
        f["q5"] = (_nib(raw[:, -16:]) | (qh << 4), 32)
    if qtype == T.Q8_0:
        f["q8"] = (raw[:, 2:], 256)
    if qtype == T.Q1_0:
        f["bits"] = (np.unpackbits(raw[:, 2:], axis=1), 2)
    if qtype == T.Q2_K:
        f["scale"], f["min"] = (raw[:, 0:16] & 0xF, 16), (raw[:, 0:16] >> 4, 16)
        f["q2"] = (np.stack([(raw[:, 16:80] >> s) & 3 for s in (0, 2, 4, 6)]), 4)
    if qtype == T.Q3_K:
        s = raw[:, 96:108].astype(np.int64)
        hi = np.concatenate([(s[:, 8:12] >> (2 * k)) & 3 for k in range(4)], axis=1)
        f["scale"] = (_nib(s[:, 0:8]) | (hi << 4), 64)
        f["q2"] = (np.stack([(raw[:, 32:96] >> s) & 3 for s in (0, 2, 4, 6)]), 4)
        f["hmask"] = (np.unpackbits(raw[:, 0:32]), 2)
    if qtype in (T.Q4_K, T.Q5_K):
        sc, mn = q4_k.scales_mins(raw[:, 4:16])
        f["scale"], f["min"] = (sc, 64), (mn, 64)
    if qtype == T.Q6_K:
        f["scale"] = (raw[:, 192:208], 256)
        f["ql"], f["qh"] = (raw[:, 0:128], 256), (raw[:, 128:192], 256)
    if qtype == T.TQ1_0:
        f["trit byte"] = (raw[:, 0:52], 256)
    if qtype == T.TQ2_0:
        f["crumb"] = (np.stack([(raw[:, 0:64] >> s) & 3 for s in (0, 2, 4, 6)]), 4)
    if qtype == T.IQ2_XXS:
        q = raw[:, 2:66].reshape(n, 8, 8)
        f["grid"], f["signs"] = (q[:, :, 0:4], 256), (_sign7(q[:, :, 4:8]), 128)
        f["scale"] = (q[:, :, 7] >> 4, 16)
    if qtype == T.IQ2_XS:
        w = _u16(raw, 2, 32)
        f["grid"], f["signs"], f["scale"] = (w & 511, 512), (w >> 9, 128), (_nib(raw[:, 66:74]), 16)
    if qtype == T.IQ2_S:
        qh = raw[:, 66:74].astype(np.int64)
        hi = np.stack([(qh >> (2 * k)) & 3 for k in range(4)], axis=2)
        f["grid"] = (raw[:, 2:34].reshape(n, 8, 4) | (hi << 8), 1024)
        f["signs"], f["scale"] = (raw[:, 34:66], 256), (_nib(raw[:, 74:82]), 16)
    if qtype == T.IQ3_XXS:
        a = raw[:, 66:98].reshape(n, 8, 4)
        f["grid"], f["signs"], f["scale"] = (raw[:, 2:66], 256), (_sign7(a), 128), (a[:, :, 3] >> 4, 16)
    if qtype == T.IQ3_S:
        hi = np.unpackbits(raw[:, 66:74], axis=1, bitorder="little").astype(np.int64).reshape(n, 8, 8)
        f["grid"] = (raw[:, 2:66].reshape(n, 8, 8) | (hi << 8), 512)
        f["signs"], f["scale"] = (raw[:, 74:106], 256), (_nib(raw[:, 106:110]), 16)
    if qtype == T.IQ1_S:
        qh = _u16(raw, 34, 8)
        hi = np.stack([(qh >> (3 * k)) & 7 for k in range(4)], axis=2)
        f["grid"] = (raw[:, 2:34].reshape(n, 8, 4) | (hi << 8), 2048)
        f["scale"], f["delta"] = ((qh >> 12) & 7, 8), (qh >> 15, 2)
    if qtype == T.IQ1_M:
        nib = np.stack([raw[:, 32:48] & 0xF, raw[:, 32:48] >> 4], axis=2).reshape(n, 32).astype(np.int64)
        f["grid"] = (raw[:, 0:32] | ((nib & 7) << 8), 2048)
        f["delta"] = (nib >> 3, 2)
        sc = _u16(raw, 48, 4)
        f["scale"] = (np.stack([(sc >> (3 * k)) & 7 for k in range(4)]), 8)
    if qtype == T.IQ4_XS:
        sh = _u16(raw, 2, 1)
        hi = np.concatenate([(sh >> (2 * i)) & 3 for i in range(8)], axis=1)
        lo = np.stack([raw[:, 4:8] & 0xF, raw[:, 4:8] >> 4], axis=2).reshape(n, 8)
        f["scale"], f["nibble"] = (lo | (hi << 4), 64), (_nib(raw[:, 8:136]), 16)
    if qtype == T.MXFP4:
        f["exponent"], f["nibble"] = (raw[:, 0], 253), (_nib(raw[:, 1:]), 16)
    if qtype == T.NVFP4:
        f["scale code"], f["nibble"] = (raw[:, 0:4], 128), (_nib(raw[:, 4:]), 16)
    return f


@pytest.mark.parametrize("qtype", ISSUE_TYPES, ids=lambda t: t.name)
def test_valid_blocks_cover_every_field_and_are_bit_exact(ggml, qtype):
    elems, _ = quants.type_size(qtype)
    n = VALUES // elems
    raw = quants.random_blocks(qtype, n, np.random.default_rng(700 + int(qtype)))
    fields = _fields(qtype, raw)
    assert len(fields) >= 2, f"{qtype.name}: no coverage fields"
    for name, (values, size) in fields.items():
        seen = np.unique(values).size
        assert seen == size, f"{qtype.name} {name}: {seen} of {size} values present"
    ours = quants.dequantize(raw, qtype, n * elems)
    theirs = ggml.dequantize(raw, qtype, n * elems)
    assert np.isfinite(theirs).all()
    i = _first_bad(ours.reshape(n, elems).view(np.uint32), theirs.reshape(n, elems).view(np.uint32))
    assert i is None, f"{qtype.name}: block {i} differs: {raw[i].tolist()}"


def _nan_sign_cleared(y: np.ndarray) -> np.ndarray:
    bits = y.view(np.uint32)
    return np.where(np.isnan(y), bits & 0x7FFFFFFF, bits)


@pytest.mark.parametrize("qtype", ISSUE_TYPES, ids=lambda t: t.name)
def test_random_bytes_match_ggml(ggml, qtype):
    """Raw bytes, NaN/inf scales and all: bit-exact, NaN payloads included (see the module
    docstring for the NaN sign of IQ2/IQ3 blocks)."""
    elems, nbytes = quants.type_size(qtype)
    n = (VALUES // 4) // elems
    raw = np.random.default_rng(800 + int(qtype)).integers(0, 256, (n, nbytes), dtype=np.uint8)
    ours = quants.dequantize(raw, qtype, n * elems)
    theirs = ggml.dequantize(raw, qtype, n * elems)
    if qtype in NAN_SIGN_FREE:
        ours, theirs = _nan_sign_cleared(ours), _nan_sign_cleared(theirs)
    i = _first_bad(ours.reshape(n, elems).view(np.uint32), theirs.reshape(n, elems).view(np.uint32))
    assert i is None, f"{qtype.name}: block {i} differs: {raw[i].tolist()}"
