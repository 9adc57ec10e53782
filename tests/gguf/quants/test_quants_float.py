"""F32 / F16 / BF16 codecs: hand-derived bit patterns, exhaustive round trips, NaN rules."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from k3kit.gguf import quants
from k3kit.gguf.quants.float import (
    bf16_bits_to_fp32,
    fp16_bits_to_fp32,
    fp32_to_bf16_bits,
    fp32_to_fp16_bits,
)


def f32(bits: int) -> np.float32:
    return np.array([bits], dtype=np.uint32).view(np.float32)[0]


def test_fp16_known_patterns():
    cases = {
        1.0: 0x3C00,
        -2.0: 0xC000,
        65504.0: 0x7BFF,
        65519.99: 0x7BFF,
        65520.0: 0x7C00,
        1e10: 0x7C00,
        -0.0: 0x8000,
        2.0**-24: 0x0001,
        2.0**-25: 0x0000,  # tie -> even (0)
        3 * 2.0**-25: 0x0002,  # tie -> even (2)
        1.0 + 2.0**-11: 0x3C00,  # tie -> even
        1.0 + 3 * 2.0**-11: 0x3C02,
        2.0**-14: 0x0400,
        float("inf"): 0x7C00,
    }
    x = np.array(list(cases), dtype=np.float32)
    assert [int(h) for h in fp32_to_fp16_bits(x)] == list(cases.values())


def test_fp16_nan_is_canonical_quiet_with_sign():
    x = np.array([f32(0x7F800001), f32(0xFFC12345), f32(0x7FFFFFFF)])
    assert [int(h) for h in fp32_to_fp16_bits(x)] == [0x7E00, 0xFE00, 0x7E00]


def test_fp16_every_half_round_trips():
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    f = fp16_bits_to_fp32(h)
    back = fp32_to_fp16_bits(f)
    nan = np.isnan(f)
    assert np.array_equal(back[~nan], h[~nan])
    assert np.all((back[nan] & 0x7FFF) == 0x7E00)
    # NaNs come out quiet (bit 22 set), as ggml's multiply-based conversion leaves them
    assert np.all(f[nan].view(np.uint32) & 0x00400000)


def test_bf16_known_patterns():
    cases = {
        0x3F800000: 0x3F80,  # 1.0
        0x3F808000: 0x3F80,  # 1 + 2^-8: tie -> even
        0x3F818000: 0x3F82,  # 1 + 3*2^-8: tie -> even (up)
        0x3F808001: 0x3F81,  # just above the tie
        0x7F7FFFFF: 0x7F80,  # FLT_MAX rounds to inf
        0x00000001: 0x0000,  # subnormals are rounded, not flushed: tiny -> 0
        0x00018000: 0x0002,  # subnormal tie -> even
        0x7F800001: 0x7FC0,  # signalling NaN -> quiet, payload truncated
        0xFF812345: 0xFFC1,
        0x7F800000: 0x7F80,
    }
    x = np.array(list(cases), dtype=np.uint32).view(np.float32)
    assert [int(h) for h in fp32_to_bf16_bits(x)] == list(cases.values())


def test_bf16_every_pattern_round_trips():
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    f = bf16_bits_to_fp32(h)
    assert np.array_equal(f.view(np.uint32), h.astype(np.uint32) << 16)
    back = fp32_to_bf16_bits(f)
    nan = np.isnan(f)
    assert np.array_equal(back[~nan], h[~nan])
    assert np.array_equal(back[nan], h[nan] | 64)


def test_float_types_through_dispatch():
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    raw = quants.quantize(x, T.F32)
    assert raw.dtype == np.uint8 and raw.shape == (3, 256)
    assert np.array_equal(quants.dequantize(raw, T.F32, x.size), x.reshape(-1))
    for t, dt in ((T.F16, np.float16), (T.BF16, None)):
        raw = quants.quantize(x, t)
        assert raw.shape == (3, 128)
        y = quants.dequantize(raw, t, x.size)
        if dt is not None:
            assert np.array_equal(y, x.reshape(-1).astype(dt).astype(np.float32))
        assert np.max(np.abs(y - x.reshape(-1))) <= np.max(np.abs(x)) * 2.0**-8
