"""k3kit.models.kimi_k3.mxfp4 (the torch fake-quant the K3 forward pass uses) against libggml's
MXFP4 reference quantizer and dequantizer: byte-exact on ~37k blocks of awkward data
(magnitudes 1e-45..1e38, amax just under powers of two, code midpoints, amax < 2^-125 where
ggml's uint8 cast wraps the exponent, inf)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from k3kit.models.kimi_k3.mxfp4 import mxfp4_dequantize, mxfp4_quantize

pytest.importorskip("llama_cpp")
ggml_oracle = pytest.importorskip("ggml_oracle")

pytestmark = pytest.mark.interop


def _data() -> np.ndarray:
    rng = np.random.default_rng(0)
    scale = np.float32(10.0) ** rng.integers(-45, 38, (2000, 1)).astype(np.float32)
    wide = rng.standard_normal((2000, 256)).astype(np.float32) * scale
    p2 = np.float32(2.0) ** rng.integers(-120, 120, (2000, 1)).astype(np.float32)
    grid = (rng.integers(-16, 17, (2000, 256)).astype(np.float32) / 4 * p2 / 8).astype(np.float32)
    signs = np.sign(rng.standard_normal((2000, 8))).astype(np.float32)
    grid[:, ::32] = np.nextafter(p2, np.float32(0)) * signs          # amax just under a power of two
    tiny = (rng.standard_normal((600, 256)) * 1e-38).astype(np.float32)
    x = np.concatenate([wide, grid, tiny])
    x[0, :32] = np.inf
    return x


def test_torch_mxfp4_is_byte_exact_with_ggml():
    g = ggml_oracle.load()
    assert g is not None, "libggml-base from llama_cpp not found"
    x = _data()
    ref = g.quantize(x, int(T.MXFP4)).reshape(-1, 17)
    codes, scales = mxfp4_quantize(torch.from_numpy(x))
    c = codes.reshape(-1, 32).numpy()
    ours = np.concatenate([scales.reshape(-1, 1).numpy(), c[:, :16] | (c[:, 16:] << 4)], axis=1)
    bad = np.flatnonzero((ours.astype(np.uint8) != ref).any(axis=1))
    assert bad.size == 0, f"{bad.size} of {len(ref)} blocks differ, first {bad[0]}"
    finite = np.isfinite(x).all(axis=1)
    want = g.dequantize(ref.reshape(x.shape[0], -1)[finite], int(T.MXFP4), int(x[finite].size))
    got = mxfp4_dequantize(codes[finite], scales[finite]).numpy().ravel()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
