"""Types of the native extension built from native/*.c (optional: it may not be built)."""

from collections.abc import Sequence
from typing import Any

def matmul(qtype: int, w: Any, x: Any, y: Any, n_out: int, k: int, m: int, simd: int = -1,
           threads: int = 1, path: int = -1, /) -> None:
    """y[m, n_out] = x[m, k] @ W.T for a ggml matrix W of type `qtype` held as its bytes in `w`
    (x, y contiguous float32 buffers). simd: -1 best, 0 scalar, 1 AVX2, 2 AVX-512. path: -1 by the
    row count (tiling(qtype)['blocked_from']), 0 per-row tiles, 1 panels (same results)."""

def dequantize(qtype: int, w: Any, out: Any, n_rows: int, k: int, bf16: int = 0, simd: int = -1,
               threads: int = 1, /) -> None:
    """out[n_rows, k] = W dequantized (ggml's float32 values, or with bf16=1 their bfloat16 bits as
    2-byte items), bit-identical to k3kit's torch dequantizers."""

def matmul_q8(qtype: int, w: Any, x: Any, y: Any, n_out: int, k: int, m: int, simd: int = -1,
              threads: int = 1, variant: int = 1, path: int = -1, /) -> None:
    """y[m, n_out] = x @ W.T in ggml's arithmetic: each row of x rounded to ggml's activation blocks
    for the type (Q8_0 for Q8_0/MXFP4 weights, with `variant` as quantize_q8; Q8_K for the rest),
    then integer dot products per scale's run of values. simd: -1 best, 0 scalar, 1 AVX2,
    2 AVX512-VNNI; path: -1 by row count, 0 direct, 1 panels. Every level and path gives the same
    bits, for any row count and thread count. x and y: buffers, or int addresses of float32
    arrays of [m, k] and [m, n_out] that the caller vouches for."""

def quantize_q8(x: Any, out: Any, act_type: int, m: int, k: int, variant: int = 1, /) -> None:
    """Rows of float32 x [m, k] as ggml blocks of act_type (8 = Q8_0, 15 = Q8_K), bit-identical to
    ggml: Q8_0 variant 0 = quantize_row_q8_0_ref, 1 = ggml-cpu's x86 quantize_row_q8_0 (what
    llama.cpp runs on AVX CPUs); Q8_K = quantize_row_q8_K_ref (ggml-cpu's x86 build runs it too)."""

def init_tables(iq2xxs: Any, iq2xs: Any, iq3xxs: Any, iq1s: Any, ksigns: Any, /) -> None:
    """Load the IQ grids and ksigns_iq2xs (byte buffers of gguf-py's data)."""

def simd() -> str:
    """The best path this CPU runs: 'avx512', 'avx2' or 'scalar'."""

def simd_i8() -> str:
    """The best int8 path this CPU runs: 'avx512vnni', 'avx2' or 'scalar'."""

def tiling(qtype: int, /) -> dict[str, int]:
    """The many-row driver's geometry for `qtype`: blocked_from, panel_rows, panel_values,
    row_block, factored."""

def types() -> tuple[int, ...]:
    """The ggml type ids with a native kernel."""

def matmul_heads(qtype: int, w: Any, x: Any, y: Any, heads: int, n_out: int, k: int, m: int, w_stride: int,
                 i8: int = 1, simd: int = -1, threads: int = 1, /) -> None:
    """y[h] = x[h] @ W_h.T for `heads` ggml matrices [n_out, k] at a byte stride of w_stride: each
    head bit for bit matmul_q8 (i8 = 1) or matmul (i8 = 0) on that head alone."""

def experts_q8(qtype: int, ws: Sequence[Any], x: Any, y: Any, counts: Sequence[int], n_out: int, k: int,
               per: int, threads: int = 1, rows: Sequence[int] | None = None, /) -> None:
    """x float32 [P, k] in segments of counts[s] rows; ws[s * per + j] the ggml matrix [n_out, k]
    that multiplies segment s into y[j] (float32 [per, P, n_out]): each segment bit for bit
    matmul_q8 on it alone, every product in one parallel region. `rows`: x is [X, k] and the
    segments' row i is x's row rows[i] (read in place, no gathered copy)."""
