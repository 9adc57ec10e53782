"""ggml blocks -> torch float tensors, vectorised over blocks (no per-block Python loop).

Each kernel reproduces ggml's scalar `dequantize_row_*` (ggml-quants.c) in float32,
operation for operation: the same products in the same order, each rounded to float32, no
fused multiply-add. That makes the result bitwise equal to ggml's reference on a build
without FP contraction (x86-64 baseline, where ggml-base is compiled without FMA), NaN
payloads included (tests/interop/test_dequant_torch_ggml.py checks this against libggml).
Other compute dtypes are produced by rounding the float32 result once at the end (MXFP4
looks values up in a table of float32 results already rounded once to the output dtype).

Block layouts (ggml-common.h), bytes per block:
  Q8_0   34  = f16 d, int8 qs[32]
  MXFP4  17  = e8m0 e, qs[16] (element j: low nibble of byte j, element j+16: high nibble)
  Q4_K   144 = f16 d, f16 dmin, scales[12] (6-bit sc/m pairs), qs[128]
  Q5_K   176 = f16 d, f16 dmin, scales[12], qh[32], qs[128]
  Q6_K   210 = ql[128], qh[64], int8 scales[16], f16 d
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType

SUPPORTED: frozenset[GGMLQuantizationType] = frozenset(
    {T.F32, T.F16, T.BF16, T.Q8_0, T.MXFP4, T.Q4_K, T.Q5_K, T.Q6_K}
)


def block_size(qtype: int) -> tuple[int, int]:
    """(elements, bytes) of one block of `qtype`."""
    return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]


def nbytes_for(qtype: int, n_elements: int) -> int:
    """Bytes that `n_elements` values of `qtype` occupy; n_elements must be whole blocks."""
    elems, nbytes = block_size(qtype)
    if n_elements % elems:
        raise ValueError(f"{n_elements} elements is not a whole number of {T(qtype).name} blocks of {elems}")
    return n_elements // elems * nbytes


def _as_uint8(raw: torch.Tensor | np.ndarray | bytes | bytearray | memoryview) -> torch.Tensor:
    if isinstance(raw, torch.Tensor):
        if raw.dtype != torch.uint8:
            raise ValueError(f"raw bytes must be uint8, got {raw.dtype}")
        return raw.reshape(-1)
    if isinstance(raw, np.ndarray):
        arr = raw.reshape(-1)
        if arr.dtype != np.uint8:
            raise ValueError(f"raw bytes must be uint8, got {arr.dtype}")
        if not arr.flags.writeable:  # torch wants writable memory; dequant never writes into it
            arr = arr.copy()
        return torch.from_numpy(arr)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[nb, 2] little-endian f16 bytes -> float32 [nb, 1] (exact conversion)."""
    return b.contiguous().view(torch.float16).to(torch.float32)


# Kernels fill `out` (float32 [nb, block_elems]) from `blocks` (uint8 [nb, block_bytes]).
# They run on chunks of CHUNK_ELEMS values, so no tensor-sized scratch is allocated
# (a fresh large allocation costs a page fault per 4 KiB: ~30 ms per 44 MB measured here).


def _q8_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(blocks[:, 2:].view(torch.int8)).mul_(_f16(blocks[:, 0:2]))


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """ggml_e8m0_to_fp32_half for int32 `e`: 2^(e-128) as float32 bits, with the two
    subnormal patterns for e < 2."""
    subnormal = torch.bitwise_left_shift(torch.full_like(e, 0x00200000), e.clamp(max=1))
    return torch.where(e < 2, subnormal, (e - 1) << 23).view(torch.float32)


# kvalues_mxfp4: e2m1 doubled (ggml pairs it with the halved e8m0 scale).
_KV = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]
# The pair of values a byte decodes to is determined by (e, byte): 65536 pairs. A table of
# all of them turns the kernel into one gather per byte with no int->float conversion and
# no scale multiply; the pair is stored as one integer twice the output width so a single
# index_select moves both values (table: 256 KiB in bf16, 512 KiB in float32; it stays in L2).
_WIDE = {2: torch.int32, 4: torch.int64}
_NARROW = {2: torch.int16, 4: torch.int32}
_MXFP4_TABLES: dict[torch.dtype, torch.Tensor] = {}


def _mxfp4_table(dtype: torch.dtype) -> torch.Tensor:
    table = _MXFP4_TABLES.get(dtype)
    if table is None:
        d = _e8m0_half(torch.arange(256, dtype=torch.int32)).view(256, 1)
        kv = torch.tensor(_KV, dtype=torch.float32)
        byte = torch.arange(256)
        # ggml's `kvalue * d` in float32, then the one rounding to the output dtype.
        lo, hi = (kv[byte & 0xF] * d).to(dtype), (kv[byte >> 4] * d).to(dtype)
        table = torch.stack([lo, hi], dim=2).contiguous().view(_WIDE[dtype.itemsize]).reshape(65536)
        _MXFP4_TABLES[dtype] = table
    return table


def _mxfp4(blocks: torch.Tensor, out: torch.Tensor, index: torch.Tensor | None = None,
           pairs: torch.Tensor | None = None) -> None:
    """Any 2- or 4-byte float `out` (each value is ggml's float32 value rounded once).

    index (int32 [>= nb, 16]) and pairs (the table's dtype, >= nb * 16) are optional work
    buffers that a caller reuses across chunks: a fresh 4 MiB buffer per chunk is above
    glibc's mmap threshold and comes back page-faulted every time (float32 output measured
    40 ms per 11M values with per-chunk buffers, 22 ms with reused ones).
    """
    nb = blocks.shape[0]
    index = torch.empty(nb, 16, dtype=torch.int32) if index is None else index[:nb]
    index.copy_(blocks[:, 1:]).add_(blocks[:, 0:1].to(torch.int32) << 8)  # e*256 + byte
    table = _mxfp4_table(out.dtype)
    pairs = torch.index_select(table, 0, index.view(-1), out=None if pairs is None else pairs[: nb * 16])
    # [nb, 16 bytes, (lo, hi)] -> [nb, (lo, hi), 16]: element j is byte j's low nibble, j+16 its
    # high one. numpy's strided copy is about twice as fast as torch's for this shape.
    narrow = _NARROW[out.dtype.itemsize]
    np.copyto(out.view(narrow).numpy().reshape(nb, 2, 16),
              pairs.view(narrow).numpy().reshape(nb, 16, 2).transpose(0, 2, 1))


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes -> 8 six-bit scales and 8 six-bit mins (get_scale_min_k4), as float32."""
    s = scales.to(torch.int32)
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], dim=1)
    m = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=1)
    return sc.to(torch.float32), m.to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[nb, 128] -> [nb, 8, 32]: for each 32-byte chunk, low nibbles then high nibbles."""
    q = qs.reshape(-1, 4, 1, 32)
    return torch.cat([q & 0xF, q >> 4], dim=2).reshape(-1, 8, 32)


def _scale_min(q: torch.Tensor, blocks: torch.Tensor, out: torch.Tensor) -> None:
    """ggml's `d1 * q - m1` per 32-element sub-block: a product, then a difference (no FMA)."""
    sc, m = _k_scales(blocks[:, 4:16])
    d1 = (_f16(blocks[:, 0:2]) * sc).unsqueeze(2)
    m1 = (_f16(blocks[:, 2:4]) * m).unsqueeze(2)
    y = out.view(-1, 8, 32).copy_(q).mul_(d1)
    nan_rows = torch.isnan(m1).flatten(1).any(1).nonzero().flatten()
    if nan_rows.numel() == 0:
        y.sub_(m1)
        return
    # A NaN dmin: torch subtracts as fma(m1, -1, y), which keeps m1's NaN payload when both
    # sides are NaN; C's `y - m1` keeps y's. Redo those blocks the C way.
    keep = y.index_select(0, nan_rows)
    y.sub_(m1)
    both = torch.isnan(keep) & torch.isnan(m1.index_select(0, nan_rows))
    y.index_copy_(0, nan_rows, torch.where(both, keep, y.index_select(0, nan_rows)))


def _q4_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _scale_min(_nibbles(blocks[:, 16:144]), blocks, out)


_BIT_MASKS = (1 << torch.arange(8, dtype=torch.int32)).to(torch.uint8).view(1, 8, 1)


def _q5_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    qh = blocks[:, 16:48].unsqueeze(1)  # sub-block s takes bit s of qh[l] as its fifth bit
    high = torch.bitwise_and(qh, _BIT_MASKS).ne_(0).bitwise_left_shift_(4)  # tensor-by-tensor shifts are slow
    q = _nibbles(blocks[:, 48:176]).bitwise_or_(high)
    _scale_min(q, blocks, out)


def _q6_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    nb = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(nb, 2, 2, 32)  # [half, first/second 32 bytes, l]
    qh = blocks[:, 128:192].reshape(nb, 2, 1, 32)
    sc = blocks[:, 192:208].view(torch.int8).to(torch.float32).reshape(nb, 2, 4, 2, 1)
    d = _f16(blocks[:, 208:210]).reshape(nb, 1, 1, 1, 1)
    low = torch.cat([ql & 0xF, ql >> 4], dim=2)  # quarter g of each half: 0,1 low nibbles; 2,3 high
    high = torch.cat([qh & 3, (qh >> 2) & 3, (qh >> 4) & 3, qh >> 6], dim=2)
    q = low.bitwise_or_(high.bitwise_left_shift_(4)).view(torch.int8).sub_(32)
    # ggml: d * sc[is] * q, evaluated left to right; scale index = 8*half + 2*g + l//16.
    out.view(nb, 2, 4, 2, 16).copy_(q.view(nb, 2, 4, 2, 16)).mul_(d * sc)


def _float(src: torch.dtype):
    def kernel(blocks: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(blocks.view(src))

    return kernel


_KERNELS = {
    T.Q8_0: _q8_0, T.MXFP4: _mxfp4, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
    T.F32: _float(torch.float32), T.F16: _float(torch.float16), T.BF16: _float(torch.bfloat16),
}
# Kernels that write any 2- or 4-byte float dtype directly, each value one rounding of ggml's
# float32 value; the others fill float32 and are rounded through a float32 scratch chunk
# (for Q8_0 and the K-quants a mixed-dtype torch.mul into a bf16 `out` measured slower than
# the scratch: its casting loop is not vectorised).
_ANY_DTYPE = frozenset({T.MXFP4})
# Per kernel call: 4 MiB of float32 output, large enough for torch's intra-op threads to pay
# off. Scratch and work buffers are allocated once per dequantize call and reused by its chunks.
CHUNK_ELEMS = 1 << 20


def dequantize(
    raw: torch.Tensor | np.ndarray | bytes | bytearray | memoryview,
    qtype: int,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantize the bytes of one tensor of ggml-order `shape` to a tensor of shape reversed(shape).

    The reversed shape is the row-major view of ggml's layout: a ggml [n_in, n_out] matrix
    comes back as [n_out, n_in], i.e. the weight of `x @ w.T`.
    """
    qtype = GGMLQuantizationType(qtype)
    if qtype not in SUPPORTED:
        raise ValueError(f"no torch dequant kernel for ggml type {qtype.name}")
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    elems, bb = block_size(qtype)
    if shape and shape[0] % elems:
        raise ValueError(f"row length {shape[0]} is not a multiple of the {qtype.name} block size")
    data = _as_uint8(raw)
    expected = nbytes_for(qtype, n)
    if data.numel() != expected:
        raise ValueError(f"{qtype.name} tensor of shape {shape} needs {expected} bytes, got {data.numel()}")
    if data.storage_offset() % 4 or not data.is_contiguous():
        data = data.clone()  # float dtype views need an aligned start
    blocks = data.view(-1, bb)
    out = torch.empty(blocks.shape[0], elems, dtype=dtype)
    direct = dtype == torch.float32 or (
        qtype in _ANY_DTYPE and dtype.is_floating_point and dtype.itemsize in _WIDE)
    step = max(1, CHUNK_ELEMS // elems)
    scratch = None if direct else torch.empty(step, elems)
    kernel = _KERNELS[qtype]
    if qtype == T.MXFP4:
        wide = _WIDE[(dtype if direct else torch.float32).itemsize]
        kernel = partial(_mxfp4, index=torch.empty(step, 16, dtype=torch.int32),
                         pairs=torch.empty(step * 16, dtype=wide))
    for i in range(0, blocks.shape[0], step):
        chunk = blocks[i : i + step]
        if scratch is None:
            kernel(chunk, out[i : i + step])
        else:  # one rounding from float32 to the compute dtype
            kernel(chunk, scratch[: chunk.shape[0]])
            out[i : i + step].copy_(scratch[: chunk.shape[0]])
    return out.view(tuple(reversed(shape)))
