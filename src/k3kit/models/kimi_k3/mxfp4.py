"""MXFP4 for the routed experts, in torch: ggml's rounding, fake quant, compressed-tensors packing.

K3's routed experts were trained quantization-aware in MXFP4, so the 4-bit values ARE the
weights. The forward pass therefore runs the experts through `mxfp4_fake_quant`, which
rounds exactly as ggml's `quantize_row_mxfp4_ref` does (ggml/src/ggml-quants.c): per block
of 32 consecutive inputs, an E8M0 exponent e = floor(log2(amax)) - 2 + 127 and, per element,
the nearest of the 16 e2m1 codes times 2^(e-127) (first code wins a tie). Saving those
weights as MXFP4 is then lossless.

Codes are the 4-bit e2m1 patterns in ggml's `kvalues_mxfp4` order (bit 3 = sign), which is
also the compressed-tensors order, so no code remapping is ever needed.
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK = 32

# ggml stores e2m1 doubled (kvalues) and halves the scale; the products are the same.
_KVALUES_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
E2M1_VALUES = tuple(v / 2 for v in _KVALUES_DOUBLED)

# rows of blocks handled at once by the rounding search (16 float32 errors per weight)
_CHUNK_BLOCKS = 1 << 16


def _check(w: Tensor) -> None:
    if w.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 needs the input dim to be a multiple of {BLOCK}, got {w.shape[-1]}")


def _half_scale(e: Tensor) -> Tensor:
    """ggml_e8m0_to_fp32_half: 2^(e-128) as float32 (exact, denormals included)."""
    return torch.ldexp(torch.ones_like(e, dtype=torch.float64), e.to(torch.float64) - 128).float()


def mxfp4_quantize(w: Tensor) -> tuple[Tensor, Tensor]:
    """Round `w` [..., K] (K % 32 == 0) to MXFP4 along its last dim.

    Returns (codes uint8 [..., K] with values 0..15, scales uint8 [..., K/32] E8M0 biased
    exponents), bit-identical to ggml's quantize_row_mxfp4_ref on the same float32 rows.
    """
    _check(w)
    shape = w.shape
    x = w.detach().to(torch.float32).reshape(-1, BLOCK)
    kv = torch.tensor(_KVALUES_DOUBLED, dtype=torch.float32, device=x.device)
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty(x.shape[0], dtype=torch.uint8, device=x.device)
    for s in range(0, x.shape[0], _CHUNK_BLOCKS):
        xb = x[s:s + _CHUNK_BLOCKS]
        amax = xb.abs().amax(dim=-1)
        # log2f of a float32, correctly rounded to float32, then floor (as the C code does).
        # Computing in float64 and rounding once keeps values just under a power of two exact.
        lg = torch.log2(amax.to(torch.float64)).to(torch.float32).to(torch.float64)
        e = torch.where(amax > 0, torch.floor(lg) - 2 + 127, torch.zeros_like(lg))
        # C's (uint8_t) of an out-of-range float: x86 truncates to int32 and keeps the low byte,
        # so amax < 2^-125 wraps to 255 (an all-zero block); non-finite -> INT_MIN -> 0
        e = torch.where(torch.isfinite(e), e, torch.zeros_like(e))
        e = (e.to(torch.int64) & 0xFF).to(torch.uint8)
        d = _half_scale(e)
        err = (kv * d[:, None, None] - xb[:, :, None]).abs()       # float32, as fabsf(kv*d - x)
        codes[s:s + _CHUNK_BLOCKS] = torch.argmin(err, dim=-1).to(torch.uint8)  # first minimum
        scales[s:s + _CHUNK_BLOCKS] = e
    return codes.reshape(shape), scales.reshape(*shape[:-1], shape[-1] // BLOCK)


def mxfp4_dequantize(codes: Tensor, scales: Tensor) -> Tensor:
    """float32 values of MXFP4 `codes` [..., K] with E8M0 `scales` [..., K/32]."""
    if codes.shape[-1] != scales.shape[-1] * BLOCK or codes.shape[:-1] != scales.shape[:-1]:
        raise ValueError(f"MXFP4 codes {tuple(codes.shape)} do not match scales {tuple(scales.shape)}")
    kv = torch.tensor(_KVALUES_DOUBLED, dtype=torch.float32, device=codes.device)
    vals = kv[codes.long()]
    d = _half_scale(scales)
    return (vals.reshape(*scales.shape, BLOCK) * d[..., None]).reshape(codes.shape)


class _FakeQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: Tensor) -> Tensor:
        codes, scales = mxfp4_quantize(w)
        return mxfp4_dequantize(codes, scales).to(w.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad      # straight-through: QAT trains the latent float weights


def mxfp4_fake_quant(w: Tensor) -> Tensor:
    """Round `w` to the MXFP4 grid along its last dim; the gradient passes straight through."""
    _check(w)
    return _FakeQuant.apply(w)


def mxfp4_round(w: Tensor) -> Tensor:
    """`w` rounded to ggml's MXFP4 grid along its last dim (blocks of 32), as float32: the
    training-speed twin of `mxfp4_quantize` + `mxfp4_dequantize`.

    It rounds |x|/d (exact: d is a power of two) arithmetically on the three spacings of the
    e2m1 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6} instead of scanning 16 error columns, and
    returns what `mxfp4_fake_quant` returns: the two grid values bracketing |x| are within a
    factor 2 of x, so ggml's float32 errors |kv*d - x| are exact (Sterbenz) and its "first code
    wins a tie" means "the smaller magnitude wins", which the ceil(. - 1/2) rounding does.
    tests/mini/test_train_fast_paths.py checks equality, ties included.
    """
    _check(w)
    x = w.detach().to(torch.float32).reshape(-1, BLOCK)
    amax = x.abs().amax(dim=-1, keepdim=True)
    lg = torch.log2(amax.to(torch.float64)).to(torch.float32).to(torch.float64)
    e = torch.where(amax > 0, torch.floor(lg) - 2 + 127, torch.zeros_like(lg)).clamp(0, 255)
    d = torch.ldexp(torch.ones_like(e), e - 127).to(torch.float32)      # 2^(e-127), exact
    y = x.abs() / d                                                      # in [0, 8), exact
    # nearest grid value, ties to the smaller: steps of 0.5 below 2, 1 below 4, then {4, 6}
    mag = torch.where(y < 2, torch.ceil(2 * y - 0.5) * 0.5,
                      torch.where(y < 4, torch.ceil(y - 0.5),
                                  torch.clamp(torch.ceil(0.5 * y - 0.5) * 2, max=6.0))) * d
    return torch.where(x < 0, -mag, mag).reshape(w.shape)


class _FakeQuantFast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: Tensor) -> Tensor:
        return mxfp4_round(w).to(w.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad      # straight-through estimator


def mxfp4_fake_quant_fast(w: Tensor) -> Tensor:
    """`mxfp4_fake_quant` through `mxfp4_round` (training: whole expert stacks at once)."""
    return _FakeQuantFast.apply(w)


def pack_codes(codes: Tensor) -> Tensor:
    """compressed-tensors packing: uint8 [..., K/2], element 2i low nibble, 2i+1 high nibble."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_codes(packed: Tensor) -> Tensor:
    """Inverse of pack_codes: uint8 [..., K/2] -> codes uint8 [..., K]."""
    p = packed.to(torch.uint8)
    lo = p & 0x0F
    hi = (p >> 4) & 0x0F
    return torch.stack((lo, hi), dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


def q8_0_round(x: Tensor) -> Tensor:
    """Round activations as ggml's x86 CPU backend does before an MXFP4 dot product.

    ggml multiplies MXFP4 weights with Q8_0-quantized inputs (vec_dot_type), so matching
    llama.cpp's numbers closely needs this rounding. Its AVX path (ggml-cpu/arch/x86
    quantize_row_q8_0) uses, per 32 values, q = round-half-even(x * (127/amax)) and the
    scale d = amax/127 stored as float16 (the scalar reference divides by d and rounds half
    away from zero; the two differ only on ties). Not part of the model: an emulation switch.
    """
    _check(x)
    xb = x.reshape(-1, BLOCK).to(torch.float32)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    d = amax / 127.0
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv)            # half to even, as _mm256_round_ps(_MM_ROUND_NEAREST)
    return (q * d.half().float()).reshape(x.shape).to(x.dtype)


# ggml weight type -> how ggml-cpu converts a matmul's activation operand (its vec_dot_type):
# the quants below pair with Q8_0 (Q8_1 rounds the values the same way), F16/BF16 weights
# take F16/BF16 activations, F32 takes them as they are. K-quants (Q8_K, blocks of 256) are
# not emulated: `input_kind` returns None for them as for F32.
_Q8_0_PAIRED = frozenset({"Q1_0", "Q2_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q8_1",
                          "MXFP4", "NVFP4", "IQ4_NL"})


def input_kind(weight_type: str) -> str | None:
    """The activation rounding ("q8_0", "f16", "bf16" or None) ggml-cpu applies for a weight type."""
    if weight_type in _Q8_0_PAIRED:
        return "q8_0"
    return {"F16": "f16", "BF16": "bf16"}.get(weight_type)


def ggml_input_round(x: Tensor, kind: str | None) -> Tensor:
    """Round a matmul's activation operand along its last dim as ggml-cpu does for `kind`."""
    if kind is None:
        return x
    if kind == "q8_0":
        return q8_0_round(x)
    if kind == "f16":
        return x.to(torch.float16).to(x.dtype)
    if kind == "bf16":
        return x.to(torch.bfloat16).to(x.dtype)
    raise ValueError(f"unknown ggml input kind {kind!r}")
