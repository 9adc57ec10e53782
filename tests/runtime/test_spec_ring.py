import pytest
import torch
from toy_target import one_thread  # noqa: F401  (autouse fixture)

from k3kit.runtime.speculative.feature_ring import FeatureRing, q8_decode, q8_encode


def _rows(n, w, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, w, generator=g) * torch.logspace(-2, 2, n)[:, None]
    return x


def test_round_trip_error_bounds():
    x = _rows(40, 64)
    for storage in ("f32", "f16", "bf16", "q8"):
        ring = FeatureRing(64, capacity=64, storage=storage)
        ring.append(x[:13])
        ring.append(x[13:])
        y = ring.get(0, 40)
        err = (y - x).abs()
        if storage == "f32":
            assert torch.equal(y, x)
        elif storage == "f16":
            assert (err <= x.abs() * 2.0**-11 + 2.0**-25).all()
        elif storage == "bf16":
            assert (err <= x.abs() * 2.0**-8).all()
        else:
            bound = x.abs().amax(dim=1, keepdim=True) / 254 * (1 + 1e-6)
            assert (err <= bound).all()
            assert err.max() > 0            # it really is lossy
    # f16 is the tightest lossy option, q8 the smallest
    sizes = {s: FeatureRing(64, 64, s).nbytes for s in ("f32", "f16", "bf16", "q8")}
    assert sizes["q8"] < sizes["f16"] == sizes["bf16"] < sizes["f32"]


def test_q8_zero_row_and_extremes():
    x = torch.zeros(2, 8)
    x[1, 3] = -5.0
    q, d = q8_encode(x)
    assert torch.equal(q8_decode(q, d), x)
    assert q[1, 3] == -127


def test_window_and_truncate():
    x = _rows(20, 4)
    ring = FeatureRing(4, capacity=8, storage="f32")
    ring.append(x[:5])
    ring.append(x[5:12])
    assert (ring.start, ring.length) == (4, 12)
    assert torch.equal(ring.get(4, 12), x[4:12])
    with pytest.raises(IndexError):
        ring.get(3, 5)
    v = ring.version
    ring.truncate(9)
    assert ring.version == v + 1 and ring.length == 9
    assert torch.equal(ring.get(4, 9), x[4:9])
    ring.append(x[12:15] * 10)               # new content at positions 9..11
    assert torch.equal(ring.get(9, 12), x[12:15] * 10)
    assert torch.equal(ring.get(4, 9), x[4:9])
    ring.append(x[:20])                      # longer than the window: only the tail survives
    assert ring.length == 32 and ring.start == 24
    assert torch.equal(ring.get(24, 32), x[12:20])
    with pytest.raises(ValueError):
        ring.append(torch.zeros(2, 5))
