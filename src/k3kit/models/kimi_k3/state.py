"""Per-sequence inference state of the K3 model: everything that must roll back together.

* MLA layers keep a latent cache (the RMS-normed compressed kv and the shared "pe" key
  part, per position). It rolls back by position: drop rows past the kept length.
* KDA layers keep a recurrent state S [B, H, d_k, d_v] in float32 and the last
  d_conv-1 raw q/k/v projections (the short-conv windows). They cannot roll back by
  position; speculative rows are instead captured (see `kda.KDARows`) and only the
  accepted ones are committed (`model.commit_rows`).
* attn-res banks are NOT state: they mix across the layers of one token and are rebuilt
  inside every forward (see attn_res.py).

`pos` is the number of committed tokens. MLA caches may hold more rows than `pos` after a
speculative forward; the next forward or commit discards them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .config import K3ModelConfig


@dataclass
class KDAState:
    S: Tensor       # [B, H, d_k, d_v] float32; S[i, j] maps key dim i to value dim j
    conv: Tensor    # [B, 3, d_conv-1, d_inner] float32: raw q/k/v projections, oldest first

    def clone(self) -> KDAState:
        return KDAState(self.S.clone(), self.conv.clone())


class MLACache:
    """Growable latent cache with O(1) truncation: per position, the latent c (kv_lora wide) and
    the shared key part pe, side by side in one buffer `rows` [B, capacity, kv_lora + rope].

    Side by side because attention multiplies every cached position by [q_abs | q_pe] each pass:
    `keys()` is that key matrix as a view, with no per-pass concatenation of the whole context
    (which, with the per-pass rounding of c that it replaces, cost as much as the products on a
    short prefill after a long cached prompt). The latents are stored as attention uses them:
    rounded as ggml rounds the kv_b operand when the trunk asks for it (mla.attend_latent), so
    what `view()` returns and a saved state holds are those rounded latents."""

    def __init__(self, batch: int, kv_lora: int, rope: int, device: torch.device | str = "cpu",
                 capacity: int = 64, dtype: torch.dtype = torch.float32):
        self.rows = torch.zeros(batch, capacity, kv_lora + rope, device=device, dtype=dtype)
        self.kv_lora = kv_lora
        self.length = 0

    @property
    def kv(self) -> Tensor:
        """The latents [B, capacity, kv_lora] (a view of `rows`)."""
        return self.rows[..., :self.kv_lora]

    @property
    def pe(self) -> Tensor:
        """The shared key parts [B, capacity, rope] (a view of `rows`)."""
        return self.rows[..., self.kv_lora:]

    def to_(self, device: torch.device | str) -> None:
        """Move the buffer to `device` (in place of the attribute)."""
        self.rows = self.rows.to(device)

    def reserve(self, capacity: int) -> None:
        """Room for `capacity` positions without growing again (a restored state reserves its
        next turn: growing copies every cached row, on a long context as long as a short pass)."""
        if capacity > self.rows.shape[1]:
            B, _, W = self.rows.shape
            rows = self.rows.new_empty(B, capacity, W)    # rows past `length` are never read: no zeros
            rows[:, :self.length] = self.rows[:, :self.length]
            self.rows = rows

    def append(self, kv: Tensor, pe: Tensor) -> None:
        n = kv.shape[1]
        need = self.length + n
        if need > self.rows.shape[1]:
            self.reserve(max(need, 2 * self.rows.shape[1]))
        # detach only what carries a gradient (a detach is an op of its own on every decode row)
        self.rows[:, self.length:need, :self.kv_lora] = kv.detach() if kv.requires_grad else kv
        self.rows[:, self.length:need, self.kv_lora:] = pe.detach() if pe.requires_grad else pe
        self.length = need

    def view(self) -> tuple[Tensor, Tensor]:
        """(latents [B, length, kv_lora], pe [B, length, rope]) of the cached positions."""
        k = self.keys()
        return k[..., :self.kv_lora], k[..., self.kv_lora:]

    def keys(self) -> Tensor:
        """[latent | pe] of every cached position, [B, length, kv_lora + rope] (a view)."""
        return self.rows[:, :self.length]

    def truncate(self, length: int) -> None:
        """Roll back by position: keep the first `length` rows."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate an MLA cache of {self.length} rows to {length}")
        self.length = length

    def clone(self) -> MLACache:
        c = MLACache.__new__(MLACache)
        c.rows, c.kv_lora, c.length = self.rows.clone(), self.kv_lora, self.length
        return c


class K3State:
    """The state of B sequences of equal length, one entry per layer."""

    def __init__(self, layers: list[KDAState | MLACache], pos: int = 0):
        self.layers = layers
        self.pos = pos

    @classmethod
    def new(cls, cfg: K3ModelConfig, batch: int = 1, device: torch.device | str = "cpu",
            dtype: torch.dtype = torch.float32) -> K3State:
        """Empty state; float32 as llama.cpp keeps it (float64 only for exactness checks)."""
        layers: list[KDAState | MLACache] = []
        for il in range(cfg.num_layers):
            if cfg.is_kda(il):
                H, D = cfg.num_heads, cfg.kda_head_dim
                layers.append(KDAState(
                    torch.zeros(batch, H, D, D, device=device, dtype=dtype),
                    torch.zeros(batch, 3, cfg.conv_kernel - 1, cfg.kda_dim, device=device, dtype=dtype)))
            else:
                layers.append(MLACache(batch, cfg.kv_lora_rank, cfg.qk_rope_head_dim, device, dtype=dtype))
        return cls(layers)

    @property
    def batch(self) -> int:
        first = self.layers[0]
        return first.S.shape[0] if isinstance(first, KDAState) else first.rows.shape[0]

    def clone(self) -> K3State:
        return K3State([layer.clone() for layer in self.layers], self.pos)

    def mla_caches(self) -> list[MLACache]:
        return [x for x in self.layers if isinstance(x, MLACache)]

    def truncate(self, pos: int, recurrent: K3State | None = None) -> None:
        """Roll the sequence back to `pos` committed tokens.

        MLA caches roll back by position. KDA state cannot: pass `recurrent`, a snapshot
        taken when the sequence was at `pos` (e.g. `clone()`), whose KDA state is copied in.
        """
        if not 0 <= pos <= self.pos:
            raise ValueError(f"cannot roll back from position {self.pos} to {pos}")
        has_kda = any(isinstance(x, KDAState) for x in self.layers)
        if has_kda and pos != self.pos:
            if recurrent is None or recurrent.pos != pos:
                raise ValueError("KDA layers roll back only from a snapshot taken at the target position")
        for il, layer in enumerate(self.layers):
            if isinstance(layer, MLACache):
                layer.truncate(min(pos, layer.length))
            elif recurrent is not None and pos != self.pos:
                src = recurrent.layers[il]
                assert isinstance(src, KDAState)
                self.layers[il] = src.clone()
        self.pos = pos

    def nbytes(self) -> int:
        total = 0
        for x in self.layers:
            if isinstance(x, KDAState):
                total += x.S.nbytes + x.conv.nbytes
            else:
                total += x.length * x.rows.shape[2] * x.rows.shape[0] * x.rows.element_size()
        return total
