"""The runtime's torch dequant kernels against libggml's own dequantize_row_* (to_float).

Random bytes (every nibble, high bit, 6-bit scale and exponent byte; fp16 scales that are
subnormal, inf or NaN) and blocks ggml quantized from gaussian data, compared as float32 bit
patterns, NaN payloads included.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from k3kit.runtime.dequant import block_size, dequantize

pytest.importorskip("llama_cpp")
import ggml_oracle  # noqa: E402

pytestmark = pytest.mark.interop

TYPES = [T.MXFP4, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.F16, T.BF16, T.F32]


@pytest.fixture(scope="module")
def ggml() -> ggml_oracle.Ggml:
    lib = ggml_oracle.load()
    assert lib is not None, "llama_cpp is installed but libggml-base was not found in its lib dir"
    return lib


def _first_diff(ours: np.ndarray, theirs: np.ndarray) -> int | None:
    """Index of the first element whose bit pattern differs, or None."""
    bad = np.flatnonzero(ours.view(np.uint32) != theirs.view(np.uint32))
    return int(bad[0]) if bad.size else None


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
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
    i = _first_diff(ours, theirs)
    assert i is None, f"{qtype.name}: element {i}: {ours[i]!r} vs ggml {theirs[i]!r}"


@pytest.mark.parametrize("qtype", [T.MXFP4, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_quantized_real_values_bit_exact(ggml, qtype):
    """Blocks that ggml's own quantizer made from gaussian data: the values a model holds."""
    elems, _ = block_size(qtype)
    rng = np.random.default_rng(400 + int(qtype))
    x = (rng.standard_normal((64, 4096)) * rng.uniform(0.01, 3, (64, 1))).astype(np.float32)
    raw = ggml.quantize(x, qtype)
    theirs = ggml.dequantize(raw, qtype, x.size)
    ours = dequantize(raw, qtype, (4096, 64)).numpy().reshape(-1)
    i = _first_diff(ours, theirs)
    assert i is None, f"{qtype.name}: element {i}: {ours[i]!r} vs ggml {theirs[i]!r}"
