"""RowLinear: one bf16/f16 row as torch.mv, everything else exactly nn.Linear."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from k3kit.runtime.row_linear import RowLinear, use_row_linear


def _model(dtype: torch.dtype, bias: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(96, 64, bias=bias), nn.ReLU(), nn.Linear(64, 40, bias=bias)).to(dtype)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_single_row_matches_linear(dtype: torch.dtype, bias: bool) -> None:
    plain = _model(dtype, bias)
    fast = _model(dtype, bias)
    assert use_row_linear(fast) == 2
    assert all(type(m) is RowLinear for m in (fast[0], fast[2]))
    for shape in ((1, 96), (1, 1, 96), (96,)):
        x = torch.randn(shape).to(dtype)
        with torch.no_grad():
            want, got = plain(x), fast(x)
        assert got.shape == want.shape and got.dtype == dtype
        # both accumulate in float32 and round once; only the summation order may differ
        assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    with torch.no_grad():                       # several rows: nn.Linear's own path, bit for bit
        x = torch.randn(3, 96).to(dtype)
        assert torch.equal(fast(x), plain(x))


def test_float32_and_grad_paths_are_nn_linear() -> None:
    plain, fast = _model(torch.float32, True), _model(torch.float32, True)
    use_row_linear(fast)
    x = torch.randn(1, 96)
    with torch.no_grad():
        assert torch.equal(fast(x), plain(x))   # float32 is left to nn.Linear
    bf = _model(torch.bfloat16, False)
    use_row_linear(bf)
    xb = torch.randn(1, 96).bfloat16()
    with torch.enable_grad():                   # grad enabled: nn.Linear, so backward works
        out = bf(xb)
        out.float().sum().backward()
    assert bf[0].weight.grad is not None
