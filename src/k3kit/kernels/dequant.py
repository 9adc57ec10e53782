"""ggml blocks -> torch float tensors, vectorised over blocks (no per-block Python loop).

Every block type gguf 0.19 lists that ggml can dequantize has a kernel here. Each reproduces
ggml's scalar `dequantize_row_*` (ggml-quants.c) in float32, operation for operation: the
same products in the same order, each rounded to float32, no fused multiply-add. That makes
the result bitwise equal to ggml's reference on a build without FP contraction (x86-64
baseline, where ggml-base is compiled without FMA), NaN payloads included, and bitwise equal
to k3kit.gguf.quants (numpy). tests/interop/test_dequant_torch_ggml.py checks this against
libggml. (One exception, only for corrupt blocks: the IQ2/IQ3 kernels apply a grid sign as a
product with -1, ggml's compiled loop flips the sign bit, so a NaN from a NaN block scale
keeps its sign here; `k3kit.gguf.quants.check_finite` finds such blocks.)
The IQ grids, the ksigns table and the kvalues come from gguf-py (k3kit.gguf.quants.gguf_py).
Other compute dtypes are produced by rounding the float32 result once at the end (MXFP4
looks values up in a table of float32 results already rounded once to the output dtype).

Block layouts (ggml-common.h), bytes per block (values per block):
  Q4_0    18 (32)  = f16 d, qs[16] (element j: low nibble of byte j, j+16: high nibble)
  Q4_1    20 (32)  = f16 d, f16 m, qs[16]
  Q5_0    22 (32)  = f16 d, qh[4] (bit j: fifth bit of element j), qs[16]
  Q5_1    24 (32)  = f16 d, f16 m, qh[4], qs[16]
  Q8_0    34 (32)  = f16 d, int8 qs[32]
  Q1_0    18 (128) = f16 d, qs[16] (bit set: +d, clear: -d)
  MXFP4   17 (32)  = e8m0 e, qs[16]
  NVFP4   36 (64)  = ue4m3 d[4], qs[32] (4 sub-blocks of 16)
  Q2_K    84 (256) = scales[16] (4-bit scale | 4-bit min), qs[64], f16 d, f16 dmin
  Q3_K   110 (256) = hmask[32], qs[64], scales[12] (16 six-bit), f16 d
  Q4_K   144 (256) = f16 d, f16 dmin, scales[12] (6-bit sc/m pairs), qs[128]
  Q5_K   176 (256) = f16 d, f16 dmin, scales[12], qh[32], qs[128]
  Q6_K   210 (256) = ql[128], qh[64], int8 scales[16], f16 d
  TQ1_0   54 (256) = qs[48] (5 trits per byte), qh[4] (4 trits), f16 d
  TQ2_0   66 (256) = qs[64] (2-bit codes), f16 d
  IQ2_XXS 66 (256) = f16 d, per 32 values 4 grid bytes + uint32 (4 x 7-bit signs, scale)
  IQ2_XS  74 (256) = f16 d, uint16 qs[32] (9-bit grid | 7-bit signs), scales[8]
  IQ2_S   82 (256) = f16 d, qs[32], signs[32], qh[8], scales[8]
  IQ3_XXS 98 (256) = f16 d, qs[64] (grid bytes), 8 x uint32 (4 x 7-bit signs, scale)
  IQ3_S  110 (256) = f16 d, qs[64], qh[8], signs[32], scales[4]
  IQ1_S   50 (256) = f16 d, qs[32], uint16 qh[8] (3 high index bits x 4, scale, delta sign)
  IQ1_M   56 (256) = qs[32], qh[16], scales[8] (3-bit scales; top nibbles = f16 d)
  IQ4_NL  18 (32)  = f16 d, qs[16] (kvalues_iq4nl indices)
  IQ4_XS 136 (256) = f16 d, uint16 scales_h, scales_l[4], qs[128]
"""

from __future__ import annotations

import functools
from functools import partial

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from k3kit.gguf.quants import gguf_py

T = GGMLQuantizationType

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
    h = b.contiguous().view(torch.int16)
    f = h.view(torch.float16).to(torch.float32)
    _fix_f16_nans(h, f)
    return f


def _fix_f16_nans(h: torch.Tensor, f: torch.Tensor) -> None:
    """Rebuild the NaNs of `f` (float32 converted from the fp16 bits `h`, same shape) from their
    bits: sign, quiet bit, payload << 13, as F16C and ggml convert them. torch's scalar tail
    loop turns some NaNs into 0x7fffffff (seen at index 1169 of 1171 values)."""
    if f.numel() == 0 or not bool(torch.isnan(f.max())):  # max propagates NaN; 10x cheaper than isnan().any()
        return
    nan = torch.isnan(f)
    if bool(nan.any()):
        h32 = h.to(torch.int32)
        bits = ((h32 & 0x8000) << 16) | 0x7FC00000 | ((h32 & 0x3FF) << 13)
        torch.where(nan, bits.view(torch.float32), f, out=f)


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
_MXFP4_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _mxfp4_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    table = _MXFP4_TABLES.get((dtype, device))
    if table is None:
        if device.type != "cpu":      # made once on the CPU, copied once per device
            table = _MXFP4_TABLES[dtype, device] = _mxfp4_table(dtype, _CPU).to(device)
            return table
        d = _e8m0_half(torch.arange(256, dtype=torch.int32)).view(256, 1)
        kv = torch.tensor(_KV, dtype=torch.float32)
        byte = torch.arange(256)
        # ggml's `kvalue * d` in float32, then the one rounding to the output dtype.
        lo, hi = (kv[byte & 0xF] * d).to(dtype), (kv[byte >> 4] * d).to(dtype)
        table = torch.stack([lo, hi], dim=2).contiguous().view(_WIDE[dtype.itemsize]).reshape(65536)
        _MXFP4_TABLES[dtype, device] = table
    return table


def _numpy_copy(t: torch.Tensor) -> bool:
    """May `t` be written through numpy (CPU memory)?"""
    return t.device.type == "cpu"


def _mxfp4(blocks: torch.Tensor, out: torch.Tensor, index: torch.Tensor | None = None,
           pairs: torch.Tensor | None = None) -> None:
    """Any 2- or 4-byte float `out` (each value is ggml's float32 value rounded once).

    index (int32 [>= nb, 16]) and pairs (the table's dtype, >= nb * 16) are optional work
    buffers that a caller reuses across chunks: a fresh 4 MiB buffer per chunk is above
    glibc's mmap threshold and comes back page-faulted every time (float32 output measured
    40 ms per 11M values with per-chunk buffers, 22 ms with reused ones).
    """
    nb = blocks.shape[0]
    index = torch.empty(nb, 16, dtype=torch.int32, device=blocks.device) if index is None else index[:nb]
    index.copy_(blocks[:, 1:]).add_(blocks[:, 0:1].to(torch.int32) << 8)  # e*256 + byte
    table = _mxfp4_table(out.dtype, out.device)
    pairs = torch.index_select(table, 0, index.view(-1), out=None if pairs is None else pairs[: nb * 16])
    # [nb, 16 bytes, (lo, hi)] -> [nb, (lo, hi), 16]: element j is byte j's low nibble, j+16 its
    # high one. numpy's strided copy is about twice as fast as torch's for this shape (CPU).
    narrow = _NARROW[out.dtype.itemsize]
    src = pairs.view(narrow).view(nb, 16, 2).transpose(1, 2)
    if _numpy_copy(out):
        np.copyto(out.view(narrow).numpy().reshape(nb, 2, 16), src.numpy())
    else:
        out.view(narrow).view(nb, 2, 16).copy_(src)


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
    _sub_c(out.view(-1, 8, 32).copy_(q).mul_(d1), m1)


def _q4_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _scale_min(_nibbles(blocks[:, 16:144]), blocks, out)


_BIT_MASKS = (1 << torch.arange(8, dtype=torch.int32)).to(torch.uint8).view(1, 8, 1)
_ON_DEVICE: dict[tuple[str, torch.device], torch.Tensor] = {}
_CPU = torch.device("cpu")


def _on(name: str, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A module-level constant `t` on `device` (copied once per device; the CPU one as is)."""
    if device.type == "cpu":
        return t
    c = _ON_DEVICE.get((name, device))
    if c is None:
        c = _ON_DEVICE[name, device] = t.to(device)
    return c


def _masks(blocks: torch.Tensor) -> torch.Tensor:
    return _on("bit_masks", _BIT_MASKS, blocks.device)


def _q5_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    qh = blocks[:, 16:48].unsqueeze(1)  # sub-block s takes bit s of qh[l] as its fifth bit
    high = torch.bitwise_and(qh, _masks(qh)).ne_(0).bitwise_left_shift_(4)  # tensor-by-tensor shifts are slow
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
        if src == torch.float16 and out.dtype == torch.float32:
            _fix_f16_nans(blocks.view(torch.int16), out)

    return kernel


# ---- shared pieces of the remaining types -------------------------------------------------


def _sub_c(y: torch.Tensor, m: torch.Tensor) -> None:
    """y -= m (m broadcast per block along dim 0) with C's NaN payload rule."""
    _offset_c(y, m, torch.Tensor.sub_)


def _add_c(y: torch.Tensor, m: torch.Tensor) -> None:
    """y += m (m broadcast per block along dim 0) with C's NaN payload rule."""
    _offset_c(y, m, torch.Tensor.add_)


def _offset_c(y: torch.Tensor, m: torch.Tensor, op) -> None:
    """torch adds and subtracts as fma(m, +-1, y), which keeps m's NaN payload when both sides
    are NaN; C's `y - m` / `y + m` keeps y's. Blocks with a NaN in m are redone the C way
    (only corrupt blocks have one, so the check is all that valid data pays)."""
    nan_rows = torch.isnan(m).flatten(1).any(1).nonzero().flatten()
    if nan_rows.numel() == 0:
        op(y, m)
        return
    keep = y.index_select(0, nan_rows)
    op(y, m)
    both = torch.isnan(keep) & torch.isnan(m.index_select(0, nan_rows))
    y.index_copy_(0, nan_rows, torch.where(both, keep, y.index_select(0, nan_rows)))


def _u16(blocks: torch.Tensor, off: int, n: int) -> torch.Tensor:
    """n little-endian uint16 words at byte `off` of each block, as int32 [nb, n]."""
    b = blocks[:, off : off + 2 * n].to(torch.int32).view(-1, n, 2)
    return b[:, :, 0] | (b[:, :, 1] << 8)


def _nibbles16(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] -> [..., 32]: the 16 low nibbles, then the 16 high ones (legacy/IQ4 layout)."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """[nb, k, 32] bytes -> [nb, k, 4, 32]: 2-bit fields at shifts 0, 2, 4, 6 (Q2_K/Q3_K/TQ2_0)."""
    return torch.stack([qs & 3, (qs >> 2) & 3, (qs >> 4) & 3, qs >> 6], dim=2)


def _bits(b: torch.Tensor) -> torch.Tensor:
    """[nb, k] bytes -> bool [nb, 8k]: element 8i + j is bit j of byte i (a little-endian bitset)."""
    return torch.bitwise_and(b.unsqueeze(2), _masks(b).view(1, 1, 8)).ne_(0).flatten(1)


def _sign_idx(a: torch.Tensor) -> torch.Tensor:
    """[..., 4] bytes of a little-endian uint32 -> its four 7-bit sign indices (bits 0, 7, 14, 21)."""
    a = a.to(torch.int32)
    b0, b1, b2, b3 = a[..., 0], a[..., 1], a[..., 2], a[..., 3]
    return torch.stack([b0 & 127, ((b0 >> 7) | (b1 << 1)) & 127,
                        ((b1 >> 6) | (b2 << 2)) & 127, ((b2 >> 5) | (b3 << 3)) & 127], dim=-1)


def _half_scales(d: torch.Tensor, nibbles: torch.Tensor, step: float) -> torch.Tensor:
    """IQ2/IQ3 `d * (0.5f + s) * step`, left to right, each product rounded to float32."""
    return (d * (nibbles.to(torch.float32) + 0.5)).mul_(step)


def _gather(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows of `table` [entries, w] at `idx` (any int shape) -> [*idx.shape, w]."""
    return torch.index_select(table, 0, idx.reshape(-1).to(torch.int64)).view(*idx.shape, table.shape[1])


@functools.cache
def _tables(device: torch.device = _CPU) -> dict[str, torch.Tensor]:
    """gguf-py's data as torch tables: IQ grids, ksigns as +-1 rows, kvalues, NVFP4 scales;
    made once on the CPU (numpy, at first use), copied once to any other device."""
    if device.type != "cpu":
        return {k: v.to(device) for k, v in _tables().items()}
    byte_bits = (np.arange(256, dtype=np.uint8)[:, None] >> np.arange(8, dtype=np.uint8)) & 1
    t = {name: torch.from_numpy(gguf_py.grid(qt)) for name, qt in (
        ("iq2xxs", T.IQ2_XXS), ("iq2xs", T.IQ2_XS), ("iq2s", T.IQ2_S), ("iq3xxs", T.IQ3_XXS),
        ("iq3s", T.IQ3_S), ("iq1s", T.IQ1_S))}
    t["ksigns"] = torch.from_numpy(gguf_py.sign_table())  # [128, 8]
    t["byte_signs"] = torch.from_numpy(np.where(byte_bits == 0, np.float32(1), np.float32(-1)))  # [256, 8]
    # byte -> (value of its low nibble, value of its high nibble) as one 8-byte row: one gather
    # decodes both nibbles (a gather of 1-float rows measured ~8x slower per value)
    for name, kv in (("iq4nl", gguf_py.KVALUES_IQ4NL), ("fp4", gguf_py.KVALUES_FP4)):
        pair = np.stack([kv[np.arange(256) & 15], kv[np.arange(256) >> 4]], axis=1).astype(np.float32)
        t[name] = torch.from_numpy(pair.view(np.int64).reshape(256))
    # Q1_0: byte -> 8 sign masks (bit clear -> 0x80000000): C's `bit ? d : -d` is a sign flip
    t["q1_0"] = torch.from_numpy(np.where(byte_bits == 0, np.int32(-(2**31)), np.int32(0)))  # [256, 8]
    t["ue4m3"] = torch.from_numpy(gguf_py.ue4m3_table()).view(256, 1)
    # TQ1_0: byte b holds 5 trits; trit n is ((uint8)(b * 3^n) * 3) >> 8, minus 1
    pow3 = np.array([1, 3, 9, 27, 81], dtype=np.uint32)
    q = (np.arange(256, dtype=np.uint32)[:, None] * pow3) & 0xFF
    t["tq1"] = torch.from_numpy((((q * 3) >> 8).astype(np.int32) - 1).astype(np.float32))  # [256, 5]
    return t


# ---- legacy 32-value blocks and Q1_0 ---------------------------------------------------------


def _q4_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """f16 d, qs[16]: (nibble - 8) * d."""
    q = _nibbles16(blocks[:, 2:18]).view(torch.int8).sub_(8)
    out.copy_(q).mul_(_f16(blocks[:, 0:2]))


def _q4_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """f16 d, f16 m, qs[16]: nibble * d + m."""
    _add_c(out.copy_(_nibbles16(blocks[:, 4:20])).mul_(_f16(blocks[:, 0:2])), _f16(blocks[:, 2:4]))


def _q5(blocks: torch.Tensor, qh: int) -> torch.Tensor:
    """Five-bit values: nibble | bit e of the little-endian uint32 qh << 4."""
    high = _bits(blocks[:, qh : qh + 4]).to(torch.uint8) << 4
    return _nibbles16(blocks[:, qh + 4 : qh + 20]).bitwise_or_(high)


def _q5_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """f16 d, qh[4], qs[16]: (q5 - 16) * d."""
    out.copy_(_q5(blocks, 2).view(torch.int8).sub_(16)).mul_(_f16(blocks[:, 0:2]))


def _q5_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """f16 d, f16 m, qh[4], qs[16]: q5 * d + m."""
    _add_c(out.copy_(_q5(blocks, 4)).mul_(_f16(blocks[:, 0:2])), _f16(blocks[:, 2:4]))


def _q1_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """f16 d, qs[16]: +d where the bit is set, else -d (a sign-bit flip, NaNs included)."""
    nb = blocks.shape[0]
    flips = _gather(_tables(blocks.device)["q1_0"], blocks[:, 2:18]).view(nb, 128)
    torch.bitwise_xor(flips, _f16(blocks[:, 0:2]).view(torch.int32), out=out.view(torch.int32))


# ---- K-quants Q2_K, Q3_K and the ternary TQ1_0 / TQ2_0 -------------------------------------


def _q2_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """scales[16], qs[64], f16 d, f16 dmin: (d * sc) * q - dmin * m per 16 values.

    Element 128n + 32j + 16h + l is bits 2j of qs[32n + 16h + l], scale 8n + 2j + h.
    """
    nb = blocks.shape[0]
    sc = blocks[:, 0:16]
    dl = (_f16(blocks[:, 80:82]) * (sc & 0xF).to(torch.float32)).unsqueeze(2)
    ml = (_f16(blocks[:, 82:84]) * (sc >> 4).to(torch.float32)).unsqueeze(2)
    q = _crumbs(blocks[:, 16:80].reshape(nb, 2, 32))
    y = out.view(nb, 16, 16).copy_(q.view(nb, 16, 16)).mul_(dl)
    _sub_c(y, ml)


_Q3_HMASK = (1 << torch.arange(8, dtype=torch.int32)).to(torch.uint8).view(1, 2, 4, 1)


def _q3_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """hmask[32], qs[64], scales[12] (16 six-bit, -32), f16 d: (d * sc) * (q2 - (hbit ? 0 : 4)).

    Element 128n + 32j + 16h + l takes bits 2j of qs[32n + 16h + l] and bit 4n + j of
    hmask[16h + l]; scale 8n + 2j + h.
    """
    nb = blocks.shape[0]
    s = blocks[:, 96:108].to(torch.int32)
    lo, hb = s[:, 0:8], s[:, 8:12]
    low = torch.cat([lo & 0xF, lo >> 4], dim=1)
    high = torch.cat([hb & 3, (hb >> 2) & 3, (hb >> 4) & 3, hb >> 6], dim=1)
    dl = (_f16(blocks[:, 108:110]) * ((low | (high << 4)) - 32).to(torch.float32)).unsqueeze(2)
    q = _crumbs(blocks[:, 32:96].reshape(nb, 2, 32)).view(torch.int8)
    hmask = _on("q3_hmask", _Q3_HMASK, blocks.device)
    clear = torch.bitwise_and(blocks[:, 0:32].view(nb, 1, 1, 32), hmask).eq_(0)
    q.sub_(clear.view(torch.uint8).view(torch.int8) << 2)
    out.view(nb, 16, 16).copy_(q.view(nb, 16, 16)).mul_(dl)


def _tq1_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """qs[48], qh[4], f16 d: 5 trits per byte (4 per qh byte), trit-major within each run."""
    nb = blocks.shape[0]
    tq1 = _tables(blocks.device)["tq1"]
    y = out.view(nb, 256)
    y[:, 0:160].view(nb, 5, 32).copy_(_gather(tq1, blocks[:, 0:32]).transpose(1, 2))
    y[:, 160:240].view(nb, 5, 16).copy_(_gather(tq1, blocks[:, 32:48]).transpose(1, 2))
    y[:, 240:256].view(nb, 4, 4).copy_(_gather(tq1, blocks[:, 48:52])[:, :, 0:4].transpose(1, 2))
    y.mul_(_f16(blocks[:, 52:54]))


def _tq2_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """qs[64], f16 d: (2-bit q - 1) * d; element 128i + 32l + m is bits 2l of qs[32i + m]."""
    nb = blocks.shape[0]
    q = _crumbs(blocks[:, 0:64].reshape(nb, 2, 32)).view(torch.int8).sub_(1)
    out.copy_(q.view(nb, 256)).mul_(_f16(blocks[:, 64:66]))


# ---- IQ types: grid rows times sign rows times block scales -------------------------------


def _iq2_xxs(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """f16 d, then per 32 values 8 bytes: 4 grid indices, uint32 (4 x 7-bit signs, 4-bit scale)."""
    nb = blocks.shape[0]
    t = _tables(blocks.device)
    q = blocks[:, 2:66].reshape(nb, 8, 8)
    db = _half_scales(_f16(blocks[:, 0:2]), q[:, :, 7] >> 4, 0.25).view(nb, 8, 1, 1)
    y = out.view(nb, 8, 4, 8)
    torch.mul(_gather(t["iq2xxs"], q[:, :, 0:4]), db, out=y)  # ggml: db * grid[j] * sign
    y.mul_(_gather(t["ksigns"], _sign_idx(q[:, :, 4:8])))


def _iq2_xs(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """f16 d, uint16 qs[32] (9-bit grid index | 7-bit sign index), scales[8] (two nibbles)."""
    nb = blocks.shape[0]
    t = _tables(blocks.device)
    w = _u16(blocks, 2, 32)
    sc = blocks[:, 66:74]
    db = _half_scales(_f16(blocks[:, 0:2]).view(nb, 1, 1), torch.stack([sc & 0xF, sc >> 4], dim=2), 0.25)
    y = out.view(nb, 8, 2, 2, 8)
    torch.mul(_gather(t["iq2xs"], w & 511).view(nb, 8, 2, 2, 8), db.view(nb, 8, 2, 1, 1), out=y)
    y.mul_(_gather(t["ksigns"], w >> 9).view(nb, 8, 2, 2, 8))


def _iq2_s(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """f16 d, qs[32] (grid low bytes), signs[32], qh[8] (2 high index bits each), scales[8]."""
    nb = blocks.shape[0]
    t = _tables(blocks.device)
    qh = blocks[:, 66:74]
    hi = torch.stack([qh & 3, (qh >> 2) & 3, (qh >> 4) & 3, qh >> 6], dim=2).to(torch.int32)
    idx = blocks[:, 2:34].reshape(nb, 8, 4).to(torch.int32) | (hi << 8)
    sc = blocks[:, 74:82]
    db = _half_scales(_f16(blocks[:, 0:2]).view(nb, 1, 1), torch.stack([sc & 0xF, sc >> 4], dim=2), 0.25)
    y = out.view(nb, 8, 2, 2, 8)
    torch.mul(_gather(t["iq2s"], idx).view(nb, 8, 2, 2, 8), db.view(nb, 8, 2, 1, 1), out=y)
    y.mul_(_gather(t["byte_signs"], blocks[:, 34:66]).view(nb, 8, 2, 2, 8))


def _iq3_xxs(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """f16 d, qs[64] (grid indices of 4 values), 8 x uint32 (4 x 7-bit signs, 4-bit scale)."""
    nb = blocks.shape[0]
    t = _tables(blocks.device)
    a = blocks[:, 66:98].reshape(nb, 8, 4)
    db = _half_scales(_f16(blocks[:, 0:2]), a[:, :, 3] >> 4, 0.5).view(nb, 8, 1, 1)
    y = out.view(nb, 8, 4, 8)
    torch.mul(_gather(t["iq3xxs"], blocks[:, 2:66]).view(nb, 8, 4, 8), db, out=y)
    y.mul_(_gather(t["ksigns"], _sign_idx(a)))


def _iq3_s(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """f16 d, qs[64], qh[8] (9th index bit of each), signs[32], scales[4]: d * (1 + 2 s)."""
    nb = blocks.shape[0]
    t = _tables(blocks.device)
    hi = torch.bitwise_and(blocks[:, 66:74].unsqueeze(2), _masks(blocks).view(1, 1, 8)).ne_(0).to(torch.int32)
    idx = blocks[:, 2:66].reshape(nb, 8, 8).to(torch.int32) | (hi << 8)
    sc = blocks[:, 106:110]
    s = torch.stack([sc & 0xF, sc >> 4], dim=2).reshape(nb, 8).to(torch.int32)
    db = (_f16(blocks[:, 0:2]) * (1 + 2 * s).to(torch.float32)).view(nb, 8, 1, 1)
    y = out.view(nb, 8, 4, 8)
    torch.mul(_gather(t["iq3s"], idx).view(nb, 8, 4, 8), db, out=y)
    y.mul_(_gather(t["byte_signs"], blocks[:, 74:106]).view(nb, 8, 4, 8))


def _iq1_groups(out: torch.Tensor, idx: torch.Tensor, delta_neg: torch.Tensor, dl: torch.Tensor) -> None:
    """ggml's dl * (grid[j] + delta) for groups of 8: idx/delta_neg [nb, 32], dl [nb, 32, 1]."""
    nb = idx.shape[0]
    delta = torch.where(delta_neg, -float(gguf_py.IQ1S_DELTA), float(gguf_py.IQ1S_DELTA)).to(torch.float32)
    y = out.view(nb, 32, 8)
    torch.add(_gather(_tables(idx.device)["iq1s"], idx), delta.unsqueeze(2), out=y)
    y.mul_(dl)


def _iq1_s(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """f16 d, qs[32], uint16 qh[8] (4 x 3 high index bits, 3-bit scale, delta sign)."""
    nb = blocks.shape[0]
    qh = _u16(blocks, 34, 8)
    hi = torch.stack([qh & 7, (qh >> 3) & 7, (qh >> 6) & 7, (qh >> 9) & 7], dim=2)
    idx = blocks[:, 2:34].reshape(nb, 8, 4).to(torch.int32) | (hi << 8)
    dl = _f16(blocks[:, 0:2]) * (2 * ((qh >> 12) & 7) + 1).to(torch.float32)
    neg = (qh & 0x8000).ne(0).unsqueeze(2).expand(nb, 8, 4)
    _iq1_groups(out, idx.view(nb, 32), neg.reshape(nb, 32), dl.repeat_interleave(4, dim=1).unsqueeze(2))


def _iq1_m(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """qs[32], qh[16] (two nibbles: 3 index bits + delta sign), 4 x uint16 scales (3-bit each;
    their top nibbles together are the f16 d)."""
    nb = blocks.shape[0]
    sc = _u16(blocks, 48, 4)
    bits = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0xF0) | ((sc[:, 2] >> 4) & 0xF00) | (sc[:, 3] & 0xF000)
    d = _f16(torch.stack([bits & 0xFF, bits >> 8], dim=1).to(torch.uint8))
    s = torch.stack([sc & 7, (sc >> 3) & 7, (sc >> 6) & 7, (sc >> 9) & 7], dim=2).reshape(nb, 16)
    dl = d * (2 * s + 1).to(torch.float32)  # scale 2ib + h covers qh byte 2ib + h: groups 2h, 2h+1
    qh = blocks[:, 32:48]
    nib = torch.stack([qh & 0xF, qh >> 4], dim=2).reshape(nb, 32)
    idx = blocks[:, 0:32].to(torch.int32) | ((nib & 7).to(torch.int32) << 8)
    _iq1_groups(out, idx, (nib & 8).ne(0), dl.repeat_interleave(2, dim=1).unsqueeze(2))


def _kv_pairs(table: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Bytes [..., k] -> float32 [..., 2, k]: values of the k low nibbles, then of the k high."""
    pairs = torch.index_select(table, 0, qs.reshape(-1).to(torch.int64)).view(torch.float32)
    return pairs.view(*qs.shape, 2).transpose(-1, -2)


def _iq4_nl(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """f16 d, qs[16]: d * kvalues_iq4nl[nibble]."""
    nb = blocks.shape[0]
    kv = _kv_pairs(_tables(blocks.device)["iq4nl"], blocks[:, 2:18])
    torch.mul(kv, _f16(blocks[:, 0:2]).view(nb, 1, 1), out=out.view(nb, 2, 16))


def _iq4_xs(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """f16 d, uint16 scales_h, scales_l[4], qs[128]: (d * (ls - 32)) * kvalues_iq4nl[nibble]."""
    nb = blocks.shape[0]
    sh = _u16(blocks, 2, 1)
    sl = blocks[:, 4:8]
    lo = torch.stack([sl & 0xF, sl >> 4], dim=2).reshape(nb, 8).to(torch.int32)
    hi = torch.cat([(sh >> (2 * i)) & 3 for i in range(8)], dim=1)
    dl = (_f16(blocks[:, 0:2]) * ((lo | (hi << 4)) - 32).to(torch.float32)).view(nb, 8, 1, 1)
    kv = _kv_pairs(_tables(blocks.device)["iq4nl"], blocks[:, 8:136].reshape(nb, 8, 16))
    torch.mul(kv, dl, out=out.view(nb, 8, 2, 16))


def _nvfp4(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """ue4m3 d[4], qs[32]: four sub-blocks of 16, kvalues_mxfp4[nibble] * d[s]."""
    nb = blocks.shape[0]
    t = _tables(blocks.device)
    d = _gather(t["ue4m3"], blocks[:, 0:4]).view(nb, 4, 1, 1)
    kv = _kv_pairs(t["fp4"], blocks[:, 4:36].reshape(nb, 4, 8))
    torch.mul(kv, d, out=out.view(nb, 4, 2, 8))


_KERNELS = {
    T.Q8_0: _q8_0, T.MXFP4: _mxfp4, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
    T.F32: _float(torch.float32), T.F16: _float(torch.float16), T.BF16: _float(torch.bfloat16),
    T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q1_0: _q1_0,
    T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.TQ1_0: _tq1_0, T.TQ2_0: _tq2_0,
    T.IQ1_S: _iq1_s, T.IQ1_M: _iq1_m, T.IQ2_XXS: _iq2_xxs, T.IQ2_XS: _iq2_xs, T.IQ2_S: _iq2_s,
    T.IQ3_XXS: _iq3_xxs, T.IQ3_S: _iq3_s, T.IQ4_NL: _iq4_nl, T.IQ4_XS: _iq4_xs, T.NVFP4: _nvfp4,
}
SUPPORTED: frozenset[GGMLQuantizationType] = frozenset(_KERNELS)
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
    dev = data.device          # any device: the kernels are torch ops on `blocks`' device
    out = torch.empty(blocks.shape[0], elems, dtype=dtype, device=dev)
    direct = dtype == torch.float32 or (
        qtype in _ANY_DTYPE and dtype.is_floating_point and dtype.itemsize in _WIDE)
    step = max(1, CHUNK_ELEMS // elems)
    scratch = None if direct else torch.empty(min(step, blocks.shape[0]), elems, device=dev)
    kernel = _KERNELS[qtype]
    if qtype == T.MXFP4:
        wide = _WIDE[(dtype if direct else torch.float32).itemsize]
        n = min(step, blocks.shape[0])
        kernel = partial(_mxfp4, index=torch.empty(n, 16, dtype=torch.int32, device=dev),
                         pairs=torch.empty(n * 16, dtype=wide, device=dev))
    for i in range(0, blocks.shape[0], step):
        chunk = blocks[i : i + step]
        if scratch is None:
            kernel(chunk, out[i : i + step])
        else:  # one rounding from float32 to the compute dtype
            kernel(chunk, scratch[: chunk.shape[0]])
            out[i : i + step].copy_(scratch[: chunk.shape[0]])
    return out.view(tuple(reversed(shape)))
