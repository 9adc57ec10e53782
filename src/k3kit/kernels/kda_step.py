"""The KDA recurrence's steps in one pass over each head's state (the `_kda` extension).

torch runs a gated delta-rule step (models/kimi_k3/kda.py `delta_step`) as ~7 elementwise and
einsum passes over the state, 6.3 MB per K3 sequence; with 8 sequences decoding that is most of a
serving pass's time outside the matrix products. `_kda.kda_rows` (built from `_kda.c` at install)
reads and writes each head's state once for all of a call's rows, with the same elementwise
roundings as torch and a fixed order for the two column sums (see `_kda.c`): the same bits on
every SIMD level, for any thread count and whichever other sequences share the call, and within
float32 rounding of the torch steps. Without the extension (no C compiler at install) `usable`
is False and the torch steps run.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from k3kit.kernels import threads as kthreads
from k3kit.kernels.qmatmul import buf

try:
    from k3kit.kernels import _kda
except ImportError:  # built without a C compiler: the torch steps
    _kda = None  # type: ignore[assignment]


def available() -> str:
    """The path the extension runs ('avx512', 'avx2', 'scalar'), or 'none' when it is not built."""
    return _kda.simd() if _kda is not None else "none"


def usable(*tensors: Tensor) -> bool:
    """Whether `rows` can run on these tensors: the extension is built, they are float32 on the
    CPU, and none needs a gradient (training keeps torch's differentiable steps)."""
    if _kda is None:
        return False
    grad = torch.is_grad_enabled()
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and not (grad and t.requires_grad)
               for t in tensors)


def rows(S: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, q: Tensor | None = None,
         inplace: bool = False, simd: int = -1, threads: int | None = None) -> tuple[Tensor | None, Tensor]:
    """T steps of the recurrence: S [B,H,dk,dv], k/g (and q) [B,T,H,dk], v [B,T,H,dv], beta [B,T,H].

    Returns (o [B,T,H,dv] = S_t^T q_t / sqrt(dv) after each step, or None without q; the final S).
    `inplace`: the final S is written into S (which must be contiguous); else S is left as it was.
    simd: -1 the best path, 0 scalar, 1 AVX2, 2 AVX-512 (the same bits); threads: torch's count.
    """
    assert _kda is not None, "kda_step.rows needs the _kda extension (check usable())"
    B, T, H, dk = k.shape
    dv = v.shape[-1]
    if inplace and not S.is_contiguous():
        raise ValueError("kda_step.rows: an in-place state must be contiguous")
    src = _plain(S)
    out = src if inplace else torch.empty_like(src)
    e = torch.exp(_plain(g))                    # torch's exp: S * e rounds as delta_step's S * decay
    o = torch.empty(B, T, H, dv, dtype=torch.float32) if q is not None else None
    n_threads = kthreads.native() if threads is None else threads
    k, v, beta = _plain(k), _plain(v), _plain(beta)
    qc = None if q is None else _plain(q)

    _kda.kda_rows(buf(src), buf(out), _buf(qc), buf(k), buf(v), buf(e), buf(beta), _buf(o),
                  B, T, H, dk, dv, 1.0 / math.sqrt(dv), simd, n_threads)
    return o, out


def _plain(t: Tensor) -> Tensor:
    """t without autograd history, contiguous; no op when it already is (detach is an op)."""
    if t.requires_grad:
        t = t.detach()
    return t if t.is_contiguous() else t.contiguous()


def _buf(t: Tensor | None) -> object:
    return None if t is None else buf(t)
