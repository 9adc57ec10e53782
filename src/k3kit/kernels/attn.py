"""MLA attention over a prompt chunk, natively with AVX-512 (`_attn`): its two float32 products
and its causal softmax.

k3kit.models.kimi_k3.mla.attend multiplies a group of rows' queries by the cached latent keys
(scores = Q Kᵀ, scaled) and the probabilities by the latents (P V). torch runs both through MKL,
which on AMD processors takes its AVX2 code; `_attn` (built from `_attn.c` at install) runs them
with AVX-512 where the CPU has it, and each output's sum in a fixed order that depends on its row
and column alone (the same bits whatever rows share the call, at any thread count). The softmax
(Cephes' exp, within 2 ulp) takes the causal mask with it: torch's masked_fill and softmax
were a fifth of a cached turn's attention on the mini. Each function
returns False where it does not run (no extension, no AVX-512F, a gradient wanted, not float32 on
the CPU, rows not unit-stride), and the caller runs torch's product.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from k3kit.kernels import threads as kthreads

try:
    from k3kit.kernels import _attn
except ImportError:  # built without a C compiler: torch's products
    _attn = None  # type: ignore[assignment]

_AVAILABLE = bool(_attn is not None and _attn.available())


def available() -> bool:
    """Whether the native products run on this machine (the extension is built, AVX-512F)."""
    return _AVAILABLE


_scratch = threading.local()
WORKSPACE_KEEP = 16 << 20    # floats (64 MiB) a slot keeps between calls; bigger ones are fresh each time


def workspace(numel: int, slot: str = "scores") -> Tensor:
    """A float32 CPU buffer of at least `numel` elements, this thread's, kept between calls: a
    group's scores (4 MB) taken fresh each time come from new pages, whose first touch cost more
    than the product filling them (3 ms against 1.3 for the mini's groups at 4.8k positions).
    One buffer per `slot`; the caller owns it until its next call for that slot on the same
    thread; its contents are garbage."""
    bufs: dict[str, Tensor] = _scratch.__dict__.setdefault("bufs", {})
    buf = bufs.get(slot)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=torch.float32)
        if numel <= WORKSPACE_KEEP:
            bufs[slot] = buf
    return buf[:numel]


def _ok(*ts: Tensor) -> bool:
    if not _AVAILABLE or torch.is_grad_enabled():
        return False
    return all(t.dtype is torch.float32 and t.is_cpu and t.dim() == 2 and t.stride(1) == 1 for t in ts)


def keys(k: Tensor, slot: str = "keys") -> Tensor | None:
    """The keys k [n, K] laid out for `scores` (panels of 32 keys), once per attention call: a
    prompt chunk's row groups all multiply the same keys. In this thread's `workspace(slot)`: valid
    until the next call with that slot. None: not run (use torch)."""
    n, kk = k.shape
    if not _ok(k) or n < 1 or kk < 1:
        return None
    packed = workspace(-(-n // 32) * 32 * kk, slot)
    _attn.pack_keys(k.data_ptr(), k.stride(0), n, kk, packed.data_ptr(), kthreads.native())
    return packed


def scores(q: Tensor, packed: Tensor, n: int, out: Tensor, scale: float) -> bool:
    """out [m, n] = scale * (q [m, K] @ k [n, K]ᵀ), k as `keys` packed it; False: not run (use torch)."""
    m, kk = q.shape
    if not _ok(q, out) or kk < 1 or n < 1 or packed.numel() != -(-n // 32) * 32 * kk or out.shape != (m, n):
        return False
    _attn.scores_nt(q.data_ptr(), q.stride(0), packed.data_ptr(), out.data_ptr(), out.stride(0),
                    m, n, kk, float(scale), kthreads.native())
    return True


def values(p: Tensor, v: Tensor, out: Tensor) -> bool:
    """out [m, n] = p [m, K] @ v [K, n]; False: not run (use torch)."""
    m, kk = p.shape
    n = v.shape[1]
    if not _ok(p, v, out) or n < 1 or v.shape[0] != kk or out.shape != (m, n):
        return False
    _attn.probs_v(p.data_ptr(), p.stride(0), v.data_ptr(), v.stride(0), out.data_ptr(), out.stride(0),
                  m, n, kk, kthreads.native())
    return True


def softmax(x: Tensor, heads: int, first: int) -> bool:
    """In place, the causal softmax of a group's scores x [t * heads, n] (the rows of query i,
    head h at i * heads + h): row i sees its first `first + i` columns (all of them where that is
    n or more), the rest become 0. False: not run (use torch)."""
    rows, n = x.shape
    if not _ok(x) or n < 1 or heads < 1 or first < 1 or rows % heads:
        return False
    _attn.softmax(x.data_ptr(), x.stride(0), rows, n, heads, first, kthreads.native())
    return True
