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

import os

import torch
import triton
import triton.language as tl

from k3kit.kernels.gpu.decode import GROUPS, TILE_K, grid_table, tile

GEMV_MAX_ROWS = 16
# Output rows per GEMV program by type, 4 warps: the best of 4-32 x 4-8 warps at 1 row of
# 7168 x 18432 on an H200 (benchmarks/bench_gpu_qmatmul.py --sweep): Q8_0 8 (1.10 TB/s),
# Q4_K 16 (0.59 TB/s), MXFP4 16 (0.33 TB/s). Not swept: the other types (16 as Q4_K; F16 and BF16
# 8 as Q8_0).
GEMV_BN = {qt: 8 if qt in (8, 1, 30) else 16 for qt in GROUPS}
GEMV_WARPS = 4
# Which GEMV kernel `gemv` runs: `_gemv_rows` (True: each weight tile decoded once for all rows)
# or `_gemv` (False: one program per row of x, the tile decoded again for each row).
GEMV_ONE_PROGRAM = False
GEMM_BM, GEMM_BN, GEMM_WARPS, GEMM_STAGES = 64, 64, 8, 2
DEQUANT_BN = 8
_DOT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _row_dot(row, xrow, nmask, K, tab, QT: tl.constexpr, BN: tl.constexpr, G: tl.constexpr,
             S: tl.constexpr):
    """One row of x (at `xrow`) times BN weight rows (at `row`): elementwise products over the
    whole row in a [BN, G, S] float32 accumulator, reduced once at the end: one program's GEMV."""
    acc = tl.zeros([BN, G, S], dtype=tl.float32)
    for t in range(0, tl.cdiv(K, G * S)):
        w, k = tile(QT, row, t, nmask, K, G, S, tab)
        xv = tl.load(xrow + k, mask=k < K, other=0.0)
        acc += w * xv
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit(do_not_specialize=["M"])
def _gemv(x_ptr, w_ptr, tab, y_ptr, M, N, K, row_bytes,
          QT: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, S: tl.constexpr):
    pid = tl.program_id(0)
    m = pid % M
    n = (pid // M) * BN + tl.arange(0, BN)
    nmask = (n < N)[:, None, None]
    row = w_ptr + n.to(tl.int64)[:, None, None] * row_bytes
    y = _row_dot(row, x_ptr + m.to(tl.int64) * K, nmask, K, tab, QT, BN, G, S)
    tl.store(y_ptr + m.to(tl.int64) * N + n, y, mask=n < N)


@triton.jit(do_not_specialize=["P"])
def _gemv_grouped(x_ptr, w_ptr, offs_ptr, xrows_ptr, tab, y_ptr, P, N, K, row_bytes,
                  QT: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, S: tl.constexpr):
    """`_gemv` over (row, matrix) pairs of one launch: pair p multiplies x row xrows[p] by the
    matrix whose bytes start offs[p] bytes past w_ptr (a MoE layer's routed experts, each kept
    where its cache put it). Per pair the same program as `_gemv`'s for one row: the same bits."""
    pid = tl.program_id(0)
    p = pid % P
    n = (pid // P) * BN + tl.arange(0, BN)
    nmask = (n < N)[:, None, None]
    row = w_ptr + tl.load(offs_ptr + p) + n.to(tl.int64)[:, None, None] * row_bytes
    y = _row_dot(row, x_ptr + tl.load(xrows_ptr + p) * K, nmask, K, tab, QT, BN, G, S)
    tl.store(y_ptr + p.to(tl.int64) * N + n, y, mask=n < N)


@triton.jit(do_not_specialize=["M"])
def _gemv_rows(x_ptr, w_ptr, tab, y_ptr, M, N, K, row_bytes,
               QT: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, S: tl.constexpr, RMAX: tl.constexpr):
    """All M (<= RMAX) rows of x in one program per BN output rows: each weight tile decoded once,
    then for each row a [BN, G] partial sum of the tile added to that row's slot of the
    accumulator (a select, so other slots are untouched): row r's sums are the same sequence
    whatever M is."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nmask = (n < N)[:, None, None]
    row = w_ptr + n.to(tl.int64)[:, None, None] * row_bytes
    slot = tl.arange(0, RMAX)[:, None, None]
    acc = tl.zeros([RMAX, BN, G], dtype=tl.float32)
    for t in range(0, tl.cdiv(K, G * S)):
        w, k = tile(QT, row, t, nmask, K, G, S, tab)
        for r in range(0, M):
            xv = tl.load(x_ptr + r * K + k, mask=k < K, other=0.0)
            part = tl.sum(w * xv, axis=2)
            acc = tl.where(slot == r, acc + part[None, :, :], acc)
    y = tl.sum(acc, axis=2)
    r2 = tl.arange(0, RMAX)[:, None]
    tl.store(y_ptr + r2.to(tl.int64) * N + n[None, :], y, mask=(r2 < M) & (n[None, :] < N))


@triton.jit
def _gemm(x_ptr, w_ptr, tab, y_ptr, M, N, K, row_bytes,
          QT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, S: tl.constexpr,
          DOT: tl.constexpr):
    om = tl.program_id(1) * BM + tl.arange(0, BM)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nmask = (n < N)[:, None, None]
    row = w_ptr + n.to(tl.int64)[:, None, None] * row_bytes
    xrows = x_ptr + om.to(tl.int64)[:, None] * K
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for t in range(0, tl.cdiv(K, G * S)):
        w, k = tile(QT, row, t, nmask, K, G, S, tab)
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
def _dequant(w_ptr, tab, out_ptr, N, K, row_bytes,
             QT: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, S: tl.constexpr):
    t = tl.program_id(1)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nmask = (n < N)[:, None, None]
    row = w_ptr + n.to(tl.int64)[:, None, None] * row_bytes
    w, k = tile(QT, row, t, nmask, K, G, S, tab)
    tl.store(out_ptr + n.to(tl.int64)[:, None, None] * K + k, w, mask=nmask & (k < K))


_GRIDS: dict[torch.device, torch.Tensor] = {}


def _grids(device: torch.device) -> torch.Tensor:
    """The IQ grid table (decode.GRIDS) on `device`, made once per device."""
    t = _GRIDS.get(device)
    if t is None:
        t = _GRIDS[device] = torch.tensor(grid_table(), dtype=torch.float32, device=device)
    return t


def gemv(x: torch.Tensor, w: torch.Tensor, qtype: int, n_in: int, n_out: int,
         rows_kernel: bool | None = None, bn: int = 0) -> torch.Tensor:
    """x float32 [M, n_in] (contiguous, M <= GEMV_MAX_ROWS) @ W.T -> float32 [M, n_out].
    rows_kernel: `_gemv_rows` (one program for all rows) or `_gemv` (one per row); default
    GEMV_ONE_PROGRAM. bn: output rows per program (default GEMV_BN's)."""
    m = x.shape[0]
    y = torch.empty(m, n_out, dtype=torch.float32, device=x.device)
    if m == 0:
        return y
    g, s = GROUPS[qtype]
    bn = bn or GEMV_BN[qtype]
    if GEMV_ONE_PROGRAM if rows_kernel is None else rows_kernel:
        _gemv_rows[(triton.cdiv(n_out, bn),)](x, w, _grids(w.device), y, m, n_out, n_in, w.numel() // n_out,
                                              QT=qtype, BN=bn, G=g, S=s, RMAX=GEMV_MAX_ROWS,
                                              num_warps=GEMV_WARPS)
        return y
    grid = (triton.cdiv(n_out, bn) * m,)
    _gemv[grid](x, w, _grids(w.device), y, m, n_out, n_in, w.numel() // n_out,
                QT=qtype, BN=bn, G=g, S=s, num_warps=GEMV_WARPS)
    return y


def grouped_gemv(x: torch.Tensor, mats: list[torch.Tensor], pair_mat: list[int], pair_row: list[int],
                 qtype: int, n_in: int, n_out: int) -> torch.Tensor:
    """y[p] = x[pair_row[p]] @ W_{pair_mat[p]}.T for every pair p, in one launch: x float32 [M, n_in]
    (contiguous), `mats` uint8 tensors of ggml [n_in, n_out] matrices of `qtype` on x's device.
    float32 [len(pairs), n_out]; each row bitwise `gemv`'s (`_gemv`) for that row and matrix."""
    p = len(pair_mat)
    y = torch.empty(p, n_out, dtype=torch.float32, device=x.device)
    if p == 0:
        return y
    base = min(mats, key=lambda m: m.data_ptr())
    at = base.data_ptr()
    offs = torch.tensor([mats[i].data_ptr() - at for i in pair_mat], dtype=torch.int64, device=x.device)
    rows = torch.tensor(pair_row, dtype=torch.int64, device=x.device)
    g, s = GROUPS[qtype]
    bn = GEMV_BN[qtype]
    _gemv_grouped[(triton.cdiv(n_out, bn) * p,)](x, base, offs, rows, _grids(x.device), y, p, n_out, n_in,
                                                 mats[0].numel() // n_out, QT=qtype, BN=bn, G=g, S=s,
                                                 num_warps=GEMV_WARPS)
    return y


def gemm(x: torch.Tensor, w: torch.Tensor, qtype: int, n_in: int, n_out: int) -> torch.Tensor:
    """x [M, n_in] (float32, bfloat16 or float16; the dot's input dtype) @ W.T -> float32 [M, n_out]."""
    m = x.shape[0]
    xf = x.float().contiguous()
    y = torch.empty(m, n_out, dtype=torch.float32, device=x.device)
    g, s = GROUPS[qtype]
    grid = (triton.cdiv(n_out, GEMM_BN), triton.cdiv(m, GEMM_BM))
    _gemm[grid](xf, w, _grids(w.device), y, m, n_out, n_in, w.numel() // n_out,
                QT=qtype, BM=GEMM_BM, BN=GEMM_BN, G=g, S=s, DOT=_DOT[x.dtype], num_warps=GEMM_WARPS,
                num_stages=GEMM_STAGES)
    return y


def dequantize(w: torch.Tensor, qtype: int, n_in: int, n_out: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W as [n_out, n_in] in `dtype`, bitwise the CPU dequantizer's (finite scales): float32 values
    rounded once (on a GPU by the kernel's store; the interpreter's bfloat16 store truncates, so
    there the float32 result is rounded by torch)."""
    on_gpu = w.device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
    direct = dtype == torch.float32 or (on_gpu and dtype in (torch.bfloat16, torch.float16))
    if not direct:
        return dequantize(w, qtype, n_in, n_out).to(dtype)
    out = torch.empty(n_out, n_in, dtype=dtype, device=w.device)
    if n_out == 0:
        return out
    g, s = GROUPS[qtype]
    grid = (triton.cdiv(n_out, DEQUANT_BN), triton.cdiv(n_in, TILE_K))
    _dequant[grid](w, _grids(w.device), out, n_out, n_in, w.numel() // n_out,
                   QT=qtype, BN=DEQUANT_BN, G=g, S=s, enable_fp_fusion=False)
    return out
