"""Triton kernels on ggml bytes: a dequantizer, a GEMV-like product for few rows, a tiled GEMM.

All three read a weight row as the file stores it (`w` is the tensor's uint8 bytes, ggml
[n_in, n_out]: output row n is bytes n*row_bytes .. (n+1)*row_bytes) and decode it a 256-value
tile at a time in registers (decode.tile); nothing the size of W is ever written.

* `_gemv` (decode, verify: up to GEMV_MAX_ROWS rows): one program = one row of x and BN output
  rows; it reads each weight byte of its BN rows once, keeps a [BN, G, S] float32 accumulator of
  elementwise products over the whole row and reduces it once at the end. The programs of one
  weight tile and different rows of x are adjacent in the grid, so a weight tile comes from
  HBM once and from L2 for the other rows.
* `_gemm` (prefill): BM x BN output tiles, the weight tile decoded to float32, cast to the
  compute dtype and multiplied with tl.dot (float32 x: "ieee" precision, not TF32).
* `_dequant`: the decoded tile stored as float32, launched without FP contraction so every
  value is the CPU dequantizer's bits.

Row invariance (what batched serving needs): a `_gemv` program computes one row of x with
compile-time tile sizes that do not depend on M (and M is not specialized on), from that row's
values only: the products, their order of accumulation and the final reduction tree are the
same whatever the other rows of the call, so an output row is bitwise the same at M = 1 and
M = GEMV_MAX_ROWS. Above GEMV_MAX_ROWS `_gemm` sums in another order (still one fixed order
per tile size, which does not depend on M either, but not the `_gemv` one).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3kit.kernels.gpu.decode import GROUPS, TILE_K, tile

GEMV_BN = 8          # output rows per GEMV program
GEMV_WARPS = 4
GEMM_BM, GEMM_BN, GEMM_WARPS = 64, 64, 8
DEQUANT_BN = 8
_DOT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit(do_not_specialize=["M"])
def _gemv(x_ptr, w_ptr, y_ptr, M, N, K, row_bytes,
          QT: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, S: tl.constexpr):
    pid = tl.program_id(0)
    m = pid % M
    n = (pid // M) * BN + tl.arange(0, BN)
    nmask = (n < N)[:, None, None]
    row = w_ptr + n.to(tl.int64)[:, None, None] * row_bytes
    xrow = x_ptr + m.to(tl.int64) * K
    acc = tl.zeros([BN, G, S], dtype=tl.float32)
    for t in range(0, tl.cdiv(K, G * S)):
        w, k = tile(QT, row, t, nmask, K, G, S)
        xv = tl.load(xrow + k, mask=k < K, other=0.0)
        acc += w * xv
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    tl.store(y_ptr + m.to(tl.int64) * N + n, y, mask=n < N)


@triton.jit
def _gemm(x_ptr, w_ptr, y_ptr, M, N, K, row_bytes,
          QT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, S: tl.constexpr,
          DOT: tl.constexpr):
    om = tl.program_id(1) * BM + tl.arange(0, BM)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nmask = (n < N)[:, None, None]
    row = w_ptr + n.to(tl.int64)[:, None, None] * row_bytes
    xrows = x_ptr + om.to(tl.int64)[:, None] * K
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for t in range(0, tl.cdiv(K, G * S)):
        w, k = tile(QT, row, t, nmask, K, G, S)
        w2 = tl.reshape(w, [BN, G * S])
        k2 = tl.reshape(k, [G * S])[None, :]
        xt = tl.load(xrows + k2, mask=(om[:, None] < M) & (k2 < K), other=0.0)
        if DOT == 0:
            acc = tl.dot(xt, tl.trans(w2), acc, input_precision="ieee")
        elif DOT == 1:
            acc = tl.dot(xt.to(tl.bfloat16), tl.trans(w2.to(tl.bfloat16)), acc)
        else:
            acc = tl.dot(xt.to(tl.float16), tl.trans(w2.to(tl.float16)), acc)
    tl.store(y_ptr + om.to(tl.int64)[:, None] * N + n[None, :], acc,
             mask=(om[:, None] < M) & (n[None, :] < N))


@triton.jit
def _dequant(w_ptr, out_ptr, N, K, row_bytes,
             QT: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, S: tl.constexpr):
    t = tl.program_id(1)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nmask = (n < N)[:, None, None]
    row = w_ptr + n.to(tl.int64)[:, None, None] * row_bytes
    w, k = tile(QT, row, t, nmask, K, G, S)
    tl.store(out_ptr + n.to(tl.int64)[:, None, None] * K + k, w, mask=nmask & (k < K))


def gemv(x: torch.Tensor, w: torch.Tensor, qtype: int, n_in: int, n_out: int) -> torch.Tensor:
    """x float32 [M, n_in] (contiguous; few rows) @ W.T -> float32 [M, n_out]."""
    m = x.shape[0]
    y = torch.empty(m, n_out, dtype=torch.float32, device=x.device)
    if m == 0:
        return y
    g, s = GROUPS[qtype]
    grid = (triton.cdiv(n_out, GEMV_BN) * m,)
    _gemv[grid](x, w, y, m, n_out, n_in, w.numel() // n_out,
                QT=qtype, BN=GEMV_BN, G=g, S=s, num_warps=GEMV_WARPS)
    return y


def gemm(x: torch.Tensor, w: torch.Tensor, qtype: int, n_in: int, n_out: int) -> torch.Tensor:
    """x [M, n_in] (float32, bfloat16 or float16; the dot's input dtype) @ W.T -> float32 [M, n_out]."""
    m = x.shape[0]
    xf = x.float().contiguous()
    y = torch.empty(m, n_out, dtype=torch.float32, device=x.device)
    g, s = GROUPS[qtype]
    grid = (triton.cdiv(n_out, GEMM_BN), triton.cdiv(m, GEMM_BM))
    _gemm[grid](xf, w, y, m, n_out, n_in, w.numel() // n_out,
                QT=qtype, BM=GEMM_BM, BN=GEMM_BN, G=g, S=s, DOT=_DOT[x.dtype], num_warps=GEMM_WARPS)
    return y


def dequantize(w: torch.Tensor, qtype: int, n_in: int, n_out: int) -> torch.Tensor:
    """W as float32 [n_out, n_in], bitwise the CPU dequantizer's (finite scales)."""
    out = torch.empty(n_out, n_in, dtype=torch.float32, device=w.device)
    if n_out == 0:
        return out
    g, s = GROUPS[qtype]
    grid = (triton.cdiv(n_out, DEQUANT_BN), triton.cdiv(n_in, TILE_K))
    _dequant[grid](w, out, n_out, n_in, w.numel() // n_out,
                   QT=qtype, BN=DEQUANT_BN, G=g, S=s, enable_fp_fusion=False)
    return out
