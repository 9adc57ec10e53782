"""Gradients of the torch KDA steps (`delta_step`, `delta_rule_torch`): what training the mini
differentiates through for short sequences. gradcheck compares autograd's backward with finite
differences in float64, over every differentiable input, k included (its backward reads the
decayed state, which an in-place update would change under it). The forward floats are those of
the in-place update (no gradient), whichever inputs need a gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3kit.models.kimi_k3.kda import delta_rule_torch, delta_step

B, T, H, DK, DV = 2, 3, 2, 3, 4


def _inputs(seed: int = 0, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"S": torch.randn(B, H, DK, DV, generator=gen, dtype=dtype) * 0.5,
            "q": F.normalize(torch.randn(B, T, H, DK, generator=gen, dtype=dtype), dim=-1),
            "k": F.normalize(torch.randn(B, T, H, DK, generator=gen, dtype=dtype), dim=-1),
            "v": torch.randn(B, T, H, DV, generator=gen, dtype=dtype),
            "g": -torch.rand(B, T, H, DK, generator=gen, dtype=dtype),
            "beta": torch.rand(B, T, H, generator=gen, dtype=dtype)}


STEP_INPUTS = ["S", "k", "v", "g", "beta"]


@pytest.mark.parametrize("wrt", [STEP_INPUTS, ["k"], ["S", "v", "g", "beta"]])
def test_delta_step_gradients(wrt):
    x = _inputs()
    args = {"S": x["S"], "k": x["k"][:, 0], "v": x["v"][:, 0], "g": x["g"][:, 0], "beta": x["beta"][:, 0]}
    leaves = [args[n].clone().requires_grad_() for n in wrt]

    def step(*ts: torch.Tensor) -> torch.Tensor:
        return delta_step(**(args | dict(zip(wrt, ts, strict=True))))
    assert torch.autograd.gradcheck(step, leaves)


def test_delta_rule_torch_gradients_over_several_steps():
    x = _inputs(seed=1)
    names = ["S", "q", "k", "v", "g", "beta"]
    leaves = [x[n].clone().requires_grad_() for n in names]

    def run(*ts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return delta_rule_torch(*ts)
    assert torch.autograd.gradcheck(run, leaves)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("grad", [[], ["k"], STEP_INPUTS])
def test_delta_step_forward_floats_do_not_depend_on_gradients(dtype, grad):
    x = _inputs(seed=2, dtype=dtype)
    args = {"S": x["S"], "k": x["k"][:, 0], "v": x["v"][:, 0], "g": x["g"][:, 0], "beta": x["beta"][:, 0]}
    with torch.no_grad():
        want = delta_step(**{n: t.clone() for n, t in args.items()}, inplace=True)
    got = delta_step(**{n: t.clone().requires_grad_(n in grad) for n, t in args.items()})
    assert torch.equal(got.detach(), want)
    assert torch.equal(args["S"], x["S"])          # not inplace: the caller's S is as it was
