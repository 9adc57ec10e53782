"""Types of the native extension built from _kda.c (optional: it may not be built)."""

from typing import Any

def kda_rows(s_in: Any, s_out: Any, q: Any, k: Any, v: Any, e: Any, beta: Any, o: Any, B: int, T: int,
             H: int, dk: int, dv: int, scale: float, simd: int = -1, threads: int = 1, /) -> None:
    """T steps of the KDA recurrence for B sequences x H heads (contiguous float32 buffers:
    s_in/s_out [B,H,dk,dv], the same buffer for in place; q/k/e [B,T,H,dk] with e = exp(g);
    v/o [B,T,H,dv]; beta [B,T,H]; q and o may be None). simd: -1 best, 0 scalar, 1 AVX2,
    2 AVX-512: the same bits on each, and for any thread count."""

def simd() -> str:
    """The best path this CPU runs: 'avx512', 'avx2' or 'scalar'."""
