"""MXFP4 rounding: bit-exact with ggml's reference (through gguf-py's port), idempotent,
on-grid, straight-through, and the compressed-tensors packing the converter repacks."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from k3kit.models.kimi_k3.mxfp4 import (
    E2M1_VALUES,
    mxfp4_dequantize,
    mxfp4_fake_quant,
    mxfp4_quantize,
    pack_codes,
    unpack_codes,
)


def _awkward_rows() -> torch.Tensor:
    """Random rows plus blocks that stress the exponent and tie rules."""
    g = torch.Generator().manual_seed(7)
    rows = [torch.randn(8, 128, generator=g) * s for s in (1e-3, 0.05, 1.0, 300.0)]
    special = torch.zeros(7, 128)
    special[0, :32] = 0.0                                             # all-zero block
    special[1, :32] = torch.tensor([4.0, 2.0, -8.0, 1.0] * 8)          # exact powers of two
    special[2, :32] = torch.arange(32) * 0.25                          # exact midpoints between codes
    special[3, :32] = -torch.arange(32) * 0.25
    special[4, :32] = torch.nextafter(torch.tensor(8.0), torch.tensor(0.0))  # just under 2^3
    special[5, :32] = torch.tensor(1e-30)                              # tiny (denormal scales)
    special[6, :32] = torch.tensor(-1e-38)    # amax < 2^-125: ggml's uint8 cast wraps the exponent to 255
    special[:, 32:] = torch.randn(7, 96, generator=g)
    return torch.cat(rows + [special]).float()


def _ggml_blocks(codes: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """ggml block_mxfp4 bytes: scale byte, then byte j = code j | code j+16 << 4."""
    c = codes.reshape(-1, 32).numpy()
    qs = c[:, :16] | (c[:, 16:] << 4)
    return np.concatenate([scales.reshape(-1, 1).numpy(), qs], axis=1).astype(np.uint8)


def test_rounding_matches_ggml_reference():
    w = _awkward_rows()
    codes, scales = mxfp4_quantize(w)
    with np.errstate(over="ignore"):     # gguf-py's search overflows on the wrapped-scale block
        ref = quants.quantize(w.numpy(), GGMLQuantizationType.MXFP4)
    assert np.array_equal(_ggml_blocks(codes, scales).reshape(ref.shape), ref)
    back = quants.dequantize(ref, GGMLQuantizationType.MXFP4)
    assert np.array_equal(mxfp4_dequantize(codes, scales).numpy(), back)


def test_fake_quant_is_idempotent_and_on_grid():
    w = _awkward_rows()
    q = mxfp4_fake_quant(w)
    assert torch.equal(mxfp4_fake_quant(q), q)
    codes, scales = mxfp4_quantize(q)
    grid = torch.tensor(sorted(set(E2M1_VALUES) | {-v for v in E2M1_VALUES}), dtype=torch.float64)
    per_block = q.double().reshape(-1, 32) / torch.ldexp(torch.ones(1, dtype=torch.float64),
                                                         scales.reshape(-1, 1).double() - 127)
    assert torch.isin(per_block, grid).all()
    assert not torch.equal(q, w)
    # the largest magnitude of each non-zero block lands on 4 or 6 times 2^(e-127)
    top = per_block.abs().amax(dim=1)
    assert torch.isin(top[top > 0], torch.tensor([4.0, 6.0], dtype=torch.float64)).all()


def test_straight_through_gradient():
    w = torch.randn(4, 64, requires_grad=True)
    g = torch.randn(4, 64)
    (mxfp4_fake_quant(w) * g).sum().backward()
    assert torch.equal(w.grad, g)


def test_compressed_tensors_packing():
    w = _awkward_rows()
    codes, scales = mxfp4_quantize(w)
    packed = pack_codes(codes)
    assert packed.shape == (w.shape[0], w.shape[1] // 2) and packed.dtype == torch.uint8
    assert torch.equal(unpack_codes(packed), codes)
    # element 2i in the low nibble, 2i+1 in the high one
    assert torch.equal(packed[:, 0] & 0x0F, codes[:, 0]) and torch.equal(packed[:, 0] >> 4, codes[:, 1])
    # the converter's repack (compressed-tensors -> ggml blocks) reproduces ggml's own quantization
    lo, hi = packed & 0x0F, packed >> 4
    vals = torch.stack((lo, hi), dim=-1).reshape(w.shape[0], -1, 32)
    qs = vals[:, :, :16] | (vals[:, :, 16:] << 4)
    blocks = torch.cat((scales.unsqueeze(-1), qs), dim=-1).reshape(w.shape[0], -1).numpy()
    with np.errstate(over="ignore"):
        assert np.array_equal(blocks, quants.quantize(w.numpy(), GGMLQuantizationType.MXFP4))


def test_rejects_bad_width():
    try:
        mxfp4_quantize(torch.zeros(2, 48))
    except ValueError as e:
        assert "multiple of 32" in str(e)
    else:
        raise AssertionError("a 48-wide row must be rejected")


def test_q8_0_input_rounding_matches_ggml_q8_0():
    from k3kit.models.kimi_k3.mxfp4 import q8_0_round

    # away from exact ties the x86 runtime rounding and the reference quantizer agree
    x = _awkward_rows()[:-2]       # the tiny rows underflow float16 scales in both; skip them
    ref = quants.dequantize(quants.quantize(x.numpy(), GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
    assert np.array_equal(q8_0_round(x).numpy(), ref.reshape(x.shape))
    # on ties it rounds half to even, as _mm256_round_ps does (the reference rounds away)
    tie = torch.zeros(1, 32)
    tie[0, :4] = torch.tensor([127.0, 0.5, 1.5, 2.5])
    assert q8_0_round(tie)[0, :4].tolist() == [127.0, 0.0, 2.0, 2.0]
