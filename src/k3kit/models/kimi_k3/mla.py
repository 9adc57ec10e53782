"""MLA of K3: multi-head latent attention with no rotary part and a sigmoid output gate.

As llama.cpp's kimi-k3 runs it (build_mla_layer, absorbed "MQA" form):
  q        = W_qb RMSNorm(W_qa x)  (or W_q x), per head [nope | pe]
  [c | pe] = W_kva x;  c = RMSNorm(c)                 c is the cached latent (kv_lora wide)
  score    = ((W_kb^T q_nope) . c + q_pe . pe) / sqrt(nope + pe)    causal softmax
  out      = W_o[ (W_vb (softmax . c)) * sigmoid(W_gate x) ]
The "pe" parts are NOT rotated (mla_use_nope): they are a head-shared extra key slice.
W_kb / W_vb are the two halves of HF's kv_b_proj, per head: a float `kv_b_proj` Linear (HF weights,
training, `--trunk float`), or, in a quantized trunk, `kv_b_heads` (LatentHeads): the file's
attn_k_b / attn_v_b bytes, multiplied per head where they lie.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeGuard

import torch
from gguf import GGMLQuantizationType
from torch import Tensor, nn

from k3kit.kernels import attn as attn_kernels
from k3kit.kernels.qmatmul import QuantizedHeads
from k3kit.layers.norm import rms_norm
from k3kit.layers.quantized_linear import GGMLWeight

from .config import K3ModelConfig
from .mxfp4 import ggml_input_round
from .state import MLACache

# Rows (of one call: B * T) up to which a quantized kv_b multiplies natively; beyond (prefill),
# its halves are dequantized for the call and torch's GEMM runs, as a float kv_b would. K3's W_kb
# rows are 128 values, a quarter of the int8 kernels' 512-value lane group, so many rows lose to
# the float32 einsums: both halves, Q8_0 k_b + Q4_K v_b, ggml arithmetic, 1 thread, time over the
# float kv_b's = 0.26 at 1 row, 0.49 at 8, 0.79 at 16, 1.09 at 64, 1.92 at 512
# (benchmarks/bench_mla_heads.py, 2026-12-02). Only in the "float" arithmetic: in "ggml" (the CPU
# default) every row count runs natively, the exact llama.cpp products, so that a row's logits do
# not depend on the size of the chunk it was prefilled in (a prompt's chunks vary with the other
# requests of a serving pass; the float path differs from the int8 one by ~1e-3). Prefill pays
# ~0.1 ms a row per MLA layer for it, well under 1% of a K3 row. Row-batched decode rows
# (absorb_q_rows, value_rows) always run natively.
HEADS_NATIVE_MAX_ROWS = 32


def _native(heads: LatentHeads | None, rows: int) -> TypeGuard[LatentHeads]:
    """Whether a product over `rows` rows runs on the quantized heads (see HEADS_NATIVE_MAX_ROWS)."""
    return heads is not None and heads.native and (heads.k_b.arith == "ggml" or rows <= HEADS_NATIVE_MAX_ROWS)


class MLA(nn.Module):
    def __init__(self, cfg: K3ModelConfig):
        super().__init__()
        self.cfg = cfg
        H, E = cfg.num_heads, cfg.hidden_size
        if cfg.q_lora_rank is not None:
            self.q_a_proj = nn.Linear(E, cfg.q_lora_rank, bias=False)
            self.q_a_norm = nn.Parameter(torch.ones(cfg.q_lora_rank))
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(E, H * cfg.qk_head_dim, bias=False)
        self.kv_a_proj = nn.Linear(E, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_norm = nn.Parameter(torch.ones(cfg.kv_lora_rank))
        # HF layout: [H * (nope + v), kv_lora], per head nope rows then v rows. A quantized trunk
        # sets it to None and holds the halves as the file's bytes in kv_b_heads instead.
        self.kv_b_proj: nn.Linear | None = nn.Linear(
            cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.kv_b_heads: LatentHeads | None = None
        self.g_proj = nn.Linear(E, H * cfg.v_head_dim, bias=False) if cfg.mla_output_gate else None
        self.o_proj = nn.Linear(H * cfg.v_head_dim, E, bias=False)
        # ggml-cpu input rounding of the products that are not one Linear ("k_b", "v_b",
        # "kv_b" -> "q8_0" / "f16" / ...), see K3Model.set_ggml_q8_inputs
        self.ggml_inputs: dict[str, str | None] = {}

    def forward(self, x: Tensor, cache: MLACache | None = None) -> Tensor:
        """x [B, T, hidden] (attn-normed). With `cache`, the new rows are appended and the
        queries see the cached rows before them."""
        cfg = self.cfg
        B, T, _ = x.shape
        H, nope, pe_dim, L = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        eps = cfg.rms_norm_eps

        if cfg.q_lora_rank is not None:
            q = self.q_b_proj(rms_norm(self.q_a_proj(x), self.q_a_norm, eps))
        else:
            q = self.q_proj(x)
        q = q.view(B, T, H, cfg.qk_head_dim)
        q_nope, q_pe = q[..., :nope], q[..., nope:]

        kv_pe = self.kv_a_proj(x)
        c = rms_norm(kv_pe[..., :L], self.kv_a_norm, eps)       # [B, T, L]
        k_pe = kv_pe[..., L:]                                    # [B, T, pe]

        # llama.cpp's unabsorbed path multiplies kv_b with the latent rows: rounded once, as cached
        c = ggml_input_round(c, self.ggml_inputs.get("kv_b"))
        if cache is not None:
            offset = cache.length
            cache.append(c, k_pe)
            K = cache.keys()                                     # [B, S, L + pe]
            if c.requires_grad:
                # the cache holds detached copies; keep this chunk's own rows differentiable
                K = torch.cat((K[:, :offset], torch.cat((c, k_pe), dim=-1)), dim=1)
        else:
            offset, K = 0, torch.cat((c, k_pe), dim=-1)
        c_all = K[..., :L]

        q_abs = absorb_q(self, q_nope)
        Q = torch.cat((q_abs, q_pe), dim=-1)                     # [B, T, H, L + pe]
        lat = attend(Q, K, c_all, offset, 1.0 / math.sqrt(nope + pe_dim))   # [B, T, H, L]
        out = value_heads(self, lat)                             # [B, T, H * v]
        if self.g_proj is not None:
            out = out * torch.sigmoid(self.g_proj(x))
        return self.o_proj(out)


def project_rows(mla: MLA, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The row-wise half of MLA.forward (x [B, T, hidden]) for a pass over rows of several
    sequences: (q [B, T, H, nope + pe], latent c [B, T, L] (normed), k_pe [B, T, pe], the
    output gate's logits or None). Same products as forward's."""
    cfg = mla.cfg
    B, T, _ = x.shape
    if cfg.q_lora_rank is not None:
        q = mla.q_b_proj(rms_norm(mla.q_a_proj(x), mla.q_a_norm, cfg.rms_norm_eps))
    else:
        q = mla.q_proj(x)
    kv_pe = mla.kv_a_proj(x)
    c = rms_norm(kv_pe[..., :cfg.kv_lora_rank], mla.kv_a_norm, cfg.rms_norm_eps)
    gate = mla.g_proj(x) if mla.g_proj is not None else None
    return q.view(B, T, cfg.num_heads, cfg.qk_head_dim), c, kv_pe[..., cfg.kv_lora_rank:], gate


def head_weights(mla: MLA) -> tuple[Tensor, Tensor]:
    """kv_b's per-head halves as float tensors: W_kb [H, nope, L] and W_vb [H, v, L] (views of
    kv_b_proj, or a quantized trunk's halves dequantized for this call)."""
    return _w_kb(mla), _w_vb(mla)


def _kv_b(mla: MLA) -> Tensor:
    cfg = mla.cfg
    assert mla.kv_b_proj is not None
    return mla.kv_b_proj.weight.view(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)


def _w_kb(mla: MLA) -> Tensor:
    if mla.kv_b_heads is not None:
        return mla.kv_b_heads.w_kb()
    return _kv_b(mla)[:, :mla.cfg.qk_nope_head_dim]


def _w_vb(mla: MLA) -> Tensor:
    if mla.kv_b_heads is not None:
        return mla.kv_b_heads.w_vb()
    return _kv_b(mla)[:, mla.cfg.qk_nope_head_dim:]


def _one_per_row(x: Tensor) -> bool:
    """Whether a [B, T, ...] operand takes the per-row products (no gradient, T == 1)."""
    return x.shape[1] == 1 and not torch.is_grad_enabled()


def absorb(q_nope: Tensor, w_kb: Tensor) -> Tensor:
    """W_kb^T q_nope per head with a float W_kb: [B, T, H, nope] -> [B, T, H, L]. One-row operands
    (decode) go through `absorb_rows`, so a decoding row gets the same floats alone or batched
    with others (W_vb's product needs no such care: it runs per sequence, one row each, in both
    cases)."""
    if _one_per_row(q_nope):
        return absorb_rows(q_nope[:, 0], w_kb)[:, None]
    return torch.einsum("bthd,hdl->bthl", q_nope, w_kb)


def absorb_rows(x: Tensor, w_kb: Tensor) -> Tensor:
    """x [N, H, nope] (N rows, of any sequences) -> [N, H, L], each (row, head) its own 1-row
    product with a float W_kb[h] (the floats of the per-sequence einsum). For several rows, head
    by head: W_kb[h] (256 KiB on K3) is read once for all of them, where a GEMM over the rows would
    sum differently for different N, and a product per sequence reads all of W_kb (25 MB in
    float32 on K3) for each row."""
    N, H, d = x.shape
    L = w_kb.shape[-1]
    if N == 1:
        return torch.bmm(x.transpose(0, 1), w_kb).transpose(0, 1)
    out = x.new_empty(H, N, 1, L)
    for h in range(H):
        torch.bmm(x[:, h, None, :], w_kb[h].expand(N, d, L), out=out[h])
    return out[:, :, 0].transpose(0, 1)


def absorb_q(mla: MLA, q_nope: Tensor) -> Tensor:
    """q_abs = W_kb^T q_nope per head, [B, T, H, nope] -> [B, T, H, L], with the input rounded as
    ggml rounds it where the arithmetic does not already. A quantized kv_b multiplies natively (in
    the float arithmetic up to HEADS_NATIVE_MAX_ROWS rows, a float W_kb beyond)."""
    heads = mla.kv_b_heads
    B, T, H, d = q_nope.shape
    if _native(heads, B * T):
        return heads.absorb(heads.round_k(q_nope, mla.ggml_inputs).reshape(B * T, H, d)).reshape(B, T, H, -1)
    return absorb(ggml_input_round(q_nope, mla.ggml_inputs.get("k_b")), _w_kb(mla))


def absorb_q_rows(mla: MLA, x: Tensor) -> Tensor:
    """absorb_q for x [N, H, nope], rows of any sequences -> [N, H, L]: each row's floats are the
    ones it gets alone (the native head products never mix rows; float weights per row)."""
    heads = mla.kv_b_heads
    if heads is not None and heads.native:
        return heads.absorb(heads.round_k(x, mla.ggml_inputs))
    return absorb_rows(ggml_input_round(x, mla.ggml_inputs.get("k_b")), _w_kb(mla))


def value_heads(mla: MLA, lat: Tensor) -> Tensor:
    """W_vb per head on the attended latents: [B, T, H, L] -> [B, T, H * v], the input rounded as
    ggml rounds it where the arithmetic does not already. Natively (never mixing rows) as
    absorb_q, else a float W_vb."""
    B, T, H, L = lat.shape
    heads = mla.kv_b_heads
    if _native(heads, B * T):
        return heads.value(heads.round_v(lat, mla.ggml_inputs).reshape(B * T, H, L)).reshape(B, T, -1)
    lat = ggml_input_round(lat, mla.ggml_inputs.get("v_b"))
    return torch.einsum("bthl,hvl->bthv", lat, _w_vb(mla)).reshape(B, T, H * mla.cfg.v_head_dim)


def value_rows(mla: MLA, lat: Tensor) -> Tensor:
    """value_heads for lat [N, H, L], one row of each of N sequences -> [N, H * v], each row's
    floats the ones its own sequence's one-row pass gives it (natively for any N)."""
    heads = mla.kv_b_heads
    if heads is not None and heads.native:
        return heads.value(heads.round_v(lat, mla.ggml_inputs))
    return torch.cat([value_heads(mla, lat[i][None, None])[0] for i in range(lat.shape[0])])


SCORE_BUDGET = 1 << 20    # score elements per product (4 MB in float32): rows are taken this many at a time


# up to this many rows (a verify block, a short chunk) attend one row at a time, as decode rows
ROWWISE_MAX = 16


def attend(Q: Tensor, K: Tensor, c_all: Tensor, offset: int, scale: float) -> Tensor:
    """Causal attention of T rows after `offset` cached ones over latent keys: Q [B, T, H, C],
    K [B, S, C] (S = offset + T), values c_all [B, S, L] -> [B, T, H, L].

    Scores stay in the queries' (row, head) order, so neither product needs its operand copied
    into another layout (an einsum to [B, H, T, S] and back copied the scores twice: as much time
    as the softmax on a long context). Rows go a few at a time, each group's scores at most
    SCORE_BUDGET elements: a long prompt's scores (T x H x S: 2.6 GB for 512 K3 rows at 20k
    positions) never exist whole, and a group's stay in the caches from the product through
    the scale, the mask and the softmax to the second product (1.5x faster on the mini at 4k
    positions). Every row attends over all S columns, later ones masked, so a group's bounds
    change only how many rows each product holds (on the mini's widths no bit; at some wider
    ones the GEMM's last bits follow the row count, as they follow a pass's). On a CPU with
    AVX-512 the products and the masked softmax run natively (k3kit.kernels.attn: torch's MKL
    takes its AVX2 code on AMD processors; 2x on a Zen 5 core), each output's sum in an order its
    row and column fix."""
    B, T, H, C = Q.shape
    S = K.shape[1]
    L = c_all.shape[-1]
    if T == 1:                                 # one row sees every position: no mask, one group
        scores = torch.bmm(Q.reshape(B, H, C), K.transpose(1, 2)).mul_(scale)
        return torch.bmm(torch.softmax(scores, dim=-1), c_all).view(B, 1, H, L)
    if T <= ROWWISE_MAX and not torch.is_grad_enabled():
        # a verify block (or a short chunk): each row as a decode row of its own, over the columns
        # it sees, so its floats are the ones an AR step of that row gets (a GEMM's sums follow
        # its row count: in ggml's arithmetic one last bit can move an int8 rounding downstream)
        return torch.cat([attend(Q[:, a:a + 1], K[:, :offset + a + 1], c_all[:, :offset + a + 1], offset + a,
                                 scale) for a in range(T)], dim=1)
    out = Q.new_empty(B, T, H, L)
    Kt = K.transpose(1, 2)
    step = max(1, SCORE_BUDGET // (B * H * S))
    packed: list[Tensor | None] = []
    if attn_kernels.available() and all(x.dtype is torch.float32 and x.is_cpu for x in (Q, K, c_all)):
        packed = [attn_kernels.keys(K[i], f"keys{i}") for i in range(B)]  # laid out once for every group
    native = bool(packed) and all(p is not None for p in packed)
    for a in range(0, T, step):
        b = min(T, a + step)
        t = b - a
        if native:           # the same two products (AVX-512, each sum in a fixed order), per sequence
            scores = attn_kernels.workspace(B * t * H * S).view(B, t, H, S)
            for i, keys in enumerate(packed):
                assert keys is not None
                q = Q[i, a:b].reshape(t * H, C)
                native = attn_kernels.scores(q, keys, S, scores[i].view(t * H, S), scale)
        if not native:
            scores = torch.bmm(Q[:, a:b].reshape(B, t * H, C), Kt).view(B, t, H, S).mul_(scale)
        first = offset + a + 1                 # the first column row a must not see
        for i in range(B) if native else ():
            native = attn_kernels.softmax(scores[i].view(t * H, S), H, first)
        if native:
            probs = scores
        else:
            if first < S:                      # row a + i sees columns before first + i
                future = torch.ones(t, S - first, dtype=torch.bool, device=Q.device).triu()
                scores[..., first:].masked_fill_(future[:, None, :], float("-inf"))
            probs = torch.softmax(scores, dim=-1)
        for i in range(B) if native else ():
            native = attn_kernels.values(probs[i].view(t * H, S), c_all[i], out[i, a:b].view(t * H, L))
        if not native:
            out[:, a:b] = torch.bmm(probs.view(B, t * H, S), c_all).view(B, t, H, L)
    return out


def attend_latent(mla: MLA, cache: MLACache, q_abs: Tensor, q_pe: Tensor, c: Tensor, k_pe: Tensor) -> Tensor:
    """One sequence's attention over its latents: append the rows' latents to `cache`, attend
    with the absorbed queries q_abs [B, T, H, L] (+ q_pe [B, T, H, pe]); the attended latents
    [B, T, H, L], before W_vb (value_heads)."""
    cfg = mla.cfg
    offset = cache.length
    cache.append(ggml_input_round(c, mla.ggml_inputs.get("kv_b")), k_pe)   # the kv_b operand, as cached
    K = cache.keys()
    c_all = K[..., :cfg.kv_lora_rank]
    Q = torch.cat((q_abs, q_pe), dim=-1)
    scale = 1.0 / math.sqrt(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    return attend(Q, K, c_all, offset, scale)


def attend_rows(mla: MLA, cache: MLACache, q: Tensor, c: Tensor, k_pe: Tensor) -> Tensor:
    """The per-sequence half: append the rows' latents to `cache` and attend over it; the
    value-projected heads [B, T, H * v] (before the gate and W_o)."""
    nope = mla.cfg.qk_nope_head_dim
    q_abs = absorb_q(mla, q[..., :nope])
    return value_heads(mla, attend_latent(mla, cache, q_abs, q[..., nope:], c, k_pe))


def output_rows(mla: MLA, out: Tensor, gate: Tensor | None) -> Tensor:
    """The row-wise tail: W_o(out * sigmoid(gate))."""
    if gate is not None:
        out = out * torch.sigmoid(gate)
    return mla.o_proj(out)


def _device_of(fn: Callable[[Tensor], Tensor], current: torch.device) -> torch.device:
    """Where `Module._apply(fn)` would send a uint8 tensor now on `current` (only the device is
    taken from fn: the bytes stay uint8)."""
    return fn(torch.empty(0, dtype=torch.uint8, device=current)).device


class LatentHeads(nn.Module):
    """MLA's kv_b as the file stores it: attn_k_b (ggml [nope, L, H]: per head L rows of nope
    values, W_kb^T) and attn_v_b (ggml [L, v, H]: per head v rows of L values, W_vb), kept as
    their bytes.

    A float kv_b_proj is 4x (Q8_0) to 7x (Q4_K) the file's bytes (50 MB per K3 MLA layer in
    float32 where the file holds 10 MB) and read whole by every decode step. Here, on the CPU
    with a type the extension multiplies, each half is one native call over all heads
    (k3kit.kernels.qmatmul.QuantizedHeads; up to HEADS_NATIVE_MAX_ROWS rows per call, and for
    row-batched decode rows always, see absorb_q) in the trunk's arithmetic: in "ggml" it is llama.cpp's
    product (q_nope / the latents rounded to Q8_0 / Q8_K blocks, integer dots), so the input
    rounding emulation (MLA.ggml_inputs) is skipped; in "float" the inputs are rounded as before
    and multiplied by the exactly dequantized weights. Elsewhere (CUDA, types without a kernel)
    each product dequantizes its half for the call (one half at a time, the size of the file's
    tensor in the compute dtype) and runs the float path. Inference only: no Parameters.
    """

    check: Callable[[], None] | None

    def __init__(self, k_b: GGMLWeight, v_b: GGMLWeight, dtype: torch.dtype = torch.float32, arith: str = ""):
        super().__init__()
        if len(k_b.shape) != 3 or len(v_b.shape) != 3:
            raise ValueError(f"attn_k_b / attn_v_b must be 3-D, got {k_b.shape} and {v_b.shape}")
        nope, L, H = (int(d) for d in k_b.shape)
        L2, v, H2 = (int(d) for d in v_b.shape)
        if (L2, H2) != (L, H):
            raise ValueError(f"attn_v_b {v_b.shape} does not fit attn_k_b {k_b.shape} "
                             f"([L, v, H] after [nope, L, H])")
        self.num_heads, self.nope, self.kv_lora, self.v_dim = H, nope, L, v
        self.k_type, self.v_type = GGMLQuantizationType(k_b.qtype), GGMLQuantizationType(v_b.qtype)
        self.dtype = dtype
        self.arith = arith
        self.check = None
        self._place(k_b.raw.reshape(-1), v_b.raw.reshape(-1))

    def _place(self, k_raw: Tensor, v_raw: Tensor) -> None:
        self.k_raw, self.v_raw = k_raw, v_raw
        self.k_b = QuantizedHeads(k_raw, self.k_type, (self.nope, self.kv_lora, self.num_heads), self.dtype,
                                  self.arith)
        self.v_b = QuantizedHeads(v_raw, self.v_type, (self.kv_lora, self.v_dim, self.num_heads), self.dtype,
                                  self.arith)

    def _apply(self, fn, recurse=True):
        """`.to(device)` / `.cuda()` move the bytes too (they stay uint8)."""
        super()._apply(fn, recurse)
        dev = _device_of(fn, self.k_raw.device)
        if dev != self.k_raw.device:
            self._place(self.k_raw.to(dev), self.v_raw.to(dev))
        return self

    @property
    def nbytes(self) -> int:
        return self.k_raw.numel() + self.v_raw.numel()

    @property
    def numel(self) -> int:
        return self.num_heads * self.kv_lora * (self.nope + self.v_dim)

    @property
    def native(self) -> bool:
        """Both halves multiply natively (CPU bytes, types with a kernel)."""
        return self.k_b.native and self.v_b.native

    @property
    def ggml_exact(self) -> bool:
        """The products are ggml's own arithmetic: no input rounding emulation needed."""
        return self.native and self.arith == "ggml"

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, nope={self.nope}, kv_lora={self.kv_lora}, v={self.v_dim}, "
                f"k_b={self.k_type.name}, v_b={self.v_type.name}, device={self.k_raw.device.type}")

    def _checked(self) -> None:
        if self.check is not None:
            self.check()          # raises on a corrupt tensor; kept until it has passed once
            self.check = None

    def round_k(self, x: Tensor, kinds: dict[str, str | None]) -> Tensor:
        return x if self.ggml_exact else ggml_input_round(x, kinds.get("k_b"))

    def round_v(self, x: Tensor, kinds: dict[str, str | None]) -> Tensor:
        return x if self.ggml_exact else ggml_input_round(x, kinds.get("v_b"))

    def absorb(self, x: Tensor) -> Tensor:
        """x [N, H, nope] -> [N, H, L]: row n, head h is W_kb[h]^T x[n, h] (natively)."""
        self._checked()
        return self.k_b.matmul(x.transpose(0, 1)).transpose(0, 1)

    def value(self, x: Tensor) -> Tensor:
        """x [N, H, L] -> [N, H * v]: row n, head h is W_vb[h] x[n, h] (natively)."""
        self._checked()
        return self.v_b.matmul(x.transpose(0, 1)).transpose(0, 1).reshape(x.shape[0], -1)

    def w_kb(self) -> Tensor:
        """W_kb [H, nope, L] in the compute dtype, dequantized for this call (the float path)."""
        self._checked()
        return self.k_b.dequantize().transpose(1, 2).contiguous()

    def w_vb(self) -> Tensor:
        """W_vb [H, v, L] in the compute dtype, dequantized for this call (the float path)."""
        self._checked()
        return self.v_b.dequantize()
