"""The runtime's torch dequant kernels against libggml's own dequantize_row_* (to_float).

Random bytes (every nibble, high bit, 6-bit scale and exponent byte; fp16 scales that are
subnormal, inf or NaN), random valid blocks of every type (finite scales over the whole fp16
range; `quants.random_blocks`) and blocks ggml quantized from gaussian data, compared as
float32 bit patterns, NaN payloads included. One exception, as for the numpy codecs
(tests/interop/test_quants_ggml.py): the sign bit of NaNs from IQ2_*/IQ3_* blocks whose scale
is NaN (ggml flips the sign bit, the kernels multiply by -1); such blocks are corrupt.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from k3kit.gguf import quants
from k3kit.kernels.dequant import SUPPORTED, block_size, dequantize

pytest.importorskip("llama_cpp")
import ggml_oracle  # noqa: E402

pytestmark = pytest.mark.interop

TYPES = [T.MXFP4, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.F16, T.BF16, T.F32]
NEW_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q1_0, T.Q2_K, T.Q3_K, T.TQ1_0, T.TQ2_0,
             T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_NL, T.IQ4_XS,
             T.NVFP4]
NAN_SIGN_FREE = frozenset({T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S})


@pytest.fixture(scope="module")
def ggml() -> ggml_oracle.Ggml:
    lib = ggml_oracle.load()
    assert lib is not None, "llama_cpp is installed but libggml-base was not found in its lib dir"
    return lib


def _first_diff(ours: np.ndarray, theirs: np.ndarray, nan_sign: bool = True) -> int | None:
    """Index of the first element whose bit pattern differs, or None."""
    a, b = ours.view(np.uint32), theirs.view(np.uint32)
    if not nan_sign:
        a = np.where(np.isnan(ours), a & 0x7FFFFFFF, a)
        b = np.where(np.isnan(theirs), b & 0x7FFFFFFF, b)
    bad = np.flatnonzero(a != b)
    return int(bad[0]) if bad.size else None


def test_every_kernel_is_tested():
    assert set(TYPES) | set(NEW_TYPES) == set(SUPPORTED)


@pytest.mark.parametrize("qtype", TYPES + NEW_TYPES, ids=lambda t: t.name)
def test_random_bytes_bit_exact(ggml, qtype):
    elems, nbytes = block_size(qtype)
    n = 40_000 * 32 // elems
    rng = np.random.default_rng(300 + int(qtype))
    raw = rng.integers(0, 256, (n, nbytes), dtype=np.uint8)
    if qtype == T.F32:  # ggml has no to_float for F32: its rows are used as stored
        theirs = raw.view(np.float32).reshape(-1)
    else:
        theirs = ggml.dequantize(raw, qtype, n * elems)
    ours = dequantize(torch.from_numpy(raw), qtype, (n * elems,)).numpy()
    i = _first_diff(ours, theirs, nan_sign=qtype not in NAN_SIGN_FREE)
    assert i is None, f"{qtype.name}: element {i}: {ours[i]!r} vs ggml {theirs[i]!r}"


@pytest.mark.parametrize("qtype", NEW_TYPES, ids=lambda t: t.name)
def test_valid_blocks_bit_exact(ggml, qtype):
    """~1 M values of valid blocks per type (every grid index and sign pattern occurs, see
    test_quants_ggml.py), as a [n_out, 4096] matrix, in float32 and rounded once to bf16."""
    elems, _ = block_size(qtype)
    n = (1 << 20) // elems
    raw = quants.random_blocks(qtype, n, np.random.default_rng(900 + int(qtype)))
    theirs = ggml.dequantize(raw, qtype, n * elems)
    ours = dequantize(raw.reshape(-1), qtype, (4096, n * elems // 4096))
    assert ours.shape == (n * elems // 4096, 4096)
    i = _first_diff(ours.numpy().reshape(-1), theirs)
    assert i is None, f"{qtype.name}: element {i}: {ours.reshape(-1)[i]!r} vs ggml {theirs[i]!r}"
    bf = dequantize(raw.reshape(-1), qtype, (4096, n * elems // 4096), dtype=torch.bfloat16)
    want = torch.from_numpy(theirs).to(torch.bfloat16)
    assert torch.equal(bf.reshape(-1).view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("qtype", [T.MXFP4, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, *NEW_TYPES], ids=lambda t: t.name)
def test_quantized_real_values_bit_exact(ggml, qtype):
    """Blocks that ggml's own quantizer made from gaussian data: the values a model holds."""
    elems, _ = block_size(qtype)
    rng = np.random.default_rng(400 + int(qtype))
    rows = 8 if qtype.name.startswith("IQ") else 64  # ggml's IQ quantizers search grids: slow
    x = (rng.standard_normal((rows, 4096)) * rng.uniform(0.01, 3, (rows, 1))).astype(np.float32)
    imatrix = rng.uniform(0.5, 2.0, 4096).astype(np.float32) if ggml.requires_imatrix(qtype) else None
    raw = ggml.quantize(x, qtype, imatrix)
    theirs = ggml.dequantize(raw, qtype, x.size)
    assert np.isfinite(theirs).all()
    ours = dequantize(raw, qtype, (4096, rows)).numpy().reshape(-1)
    i = _first_diff(ours, theirs)
    assert i is None, f"{qtype.name}: element {i}: {ours[i]!r} vs ggml {theirs[i]!r}"
    numpy_path = quants.dequantize(raw, qtype, x.size)
    np.testing.assert_array_equal(numpy_path.view(np.uint32), theirs.view(np.uint32))
