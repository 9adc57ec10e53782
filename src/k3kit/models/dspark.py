"""The DFlash / DSpark draft network (torch).

A draft is a few transformer layers that denoise a block [anchor, MASK x (B-1)] in one forward.
It has no embedding and no LM head of its own: it borrows the target's (passed in, not owned),
and it sees the target through "context features": the hidden states of a few tapped target
layers, concatenated, projected by `fc` and normalised by `hidden_norm`. In every layer those
projected rows become extra K/V rows (K normalised by the layer's k_norm and roped at the
position of the token they came from, V as is); queries come only from the block, and the
block attends to all context rows and to itself bidirectionally.

DSpark adds two small heads on top of DFlash:
  * Markov:     logits_k += W2 . W1[x_{k-1}], chained left to right from the anchor;
  * confidence: c_k = sigmoid(w . [h_k ; W1[x_{k-1}]] + b), h_k the final-normed hidden row.

Every hidden row is a proposal ("sample from anchor"): row k predicts the token after x_{k-1},
so B rows give B proposals and the target verifies B+1 rows (anchor + proposals).

Parameter names are the HF checkpoint names without the leading "model."; `gguf_tensor_name`
maps them 1:1 onto llama.cpp's `dflash` tensor names.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from k3kit.errors import ConvertError
from k3kit.runtime.speculative.feature_ring import FeatureRing
from k3kit.runtime.speculative.interface import DraftBlock

# ----------------------------------------------------------------------------- config

_MAX_DIM = 1 << 20      # bound on any width read from a (hostile) config
_MAX_LAYERS = 1024
_MAX_VOCAB = 1 << 24


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rope scaling (the HF `rope_scaling: {type: yarn, ...}` block)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None   # explicit override of the cos/sin magnitude
    truncate: bool = True


@dataclass(frozen=True)
class DraftConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    target_layer_ids: tuple[int, ...]   # HF convention: output of layer i (GGUF stores i + 1)
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None
    rope_dim: int | None = None         # rotary dims per head (default: all of head_dim)
    target_hidden_size: int | None = None   # width of one tap (default: hidden_size)
    markov_rank: int = 0                # 0: plain DFlash, no Markov head
    has_confidence: bool = False
    confidence_with_markov: bool = True  # confidence input [h ; W1[x_prev]] (llama.cpp) or just h
    sample_from_anchor: bool = True     # DSpark: every block row (row 0 too) is a proposal
    embedding_scale: float | None = None        # multiplies the borrowed token embeddings
    logit_scale: float | None = None            # HF output_multiplier, on the base logits
    final_logit_softcapping: float | None = None

    @property
    def n_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def tap_width(self) -> int:
        return self.target_hidden_size or self.hidden_size

    @property
    def n_proposals(self) -> int:
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    def validate(self, source: str = "draft config") -> DraftConfig:
        def bad(msg: str) -> ConvertError:
            return ConvertError(f"{source}: {msg}")

        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or not 0 < v <= _MAX_DIM:
                raise bad(f"{name}={v!r} out of range")
        th = self.target_hidden_size
        if th is not None and (not isinstance(th, int) or not 0 < th <= _MAX_DIM):
            raise bad(f"target_hidden_size={th!r} out of range")
        if not 0 < self.num_layers <= _MAX_LAYERS:
            raise bad(f"num_layers={self.num_layers} out of range")
        if not 0 < self.vocab_size <= _MAX_VOCAB:
            raise bad(f"vocab_size={self.vocab_size} out of range")
        if not 0 < self.block_size <= 256:
            raise bad(f"block_size={self.block_size} out of range")
        if not self.sample_from_anchor and self.block_size < 2:
            raise bad("block_size must be >= 2 when row 0 is not a proposal")
        if self.num_heads % self.num_kv_heads:
            raise bad(f"num_heads={self.num_heads} not a multiple of num_kv_heads={self.num_kv_heads}")
        # -1 is the embedding output (DeepSpec convention); GGUF stores i + 1 = 0
        if not 0 < len(self.target_layer_ids) <= 64 or any(i < -1 for i in self.target_layer_ids):
            raise bad(f"target_layer_ids={list(self.target_layer_ids)} invalid")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise bad(f"mask_token_id={self.mask_token_id} outside vocab {self.vocab_size}")
        if not 0 <= self.markov_rank <= _MAX_DIM:
            raise bad(f"markov_rank={self.markov_rank} out of range")
        if self.has_confidence and self.confidence_with_markov and self.markov_rank == 0:
            raise bad("a confidence head over [h ; W1[x_prev]] needs the Markov head")
        rd = self.rope_dim or self.head_dim
        if rd % 2 or rd > self.head_dim:
            raise bad(f"rope_dim={rd} must be even and <= head_dim={self.head_dim}")
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0):
            raise bad("rms_norm_eps and rope_theta must be positive")
        for name in ("embedding_scale", "logit_scale", "final_logit_softcapping"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise bad(f"{name}={v!r} must be a finite non-negative number")
        if self.rope_scaling is not None and not (
            self.rope_scaling.factor > 0 and self.rope_scaling.original_max_position_embeddings > 0
        ):
            raise bad("rope_scaling needs factor > 0 and original_max_position_embeddings > 0")
        return self

    @classmethod
    def from_hf(cls, cfg: Mapping, source: str = "config.json") -> DraftConfig:
        """Read an HF DFlash/DSpark draft config (flat keys plus `dflash_config`)."""
        try:
            dcfg = cfg.get("dflash_config") or {}
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or None
            scaling = None
            if rs and (rs.get("rope_type") or rs.get("type")) == "yarn":
                scaling = YarnScaling(
                    factor=float(rs["factor"]),
                    original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
                    beta_fast=float(rs.get("beta_fast", 32.0)),
                    beta_slow=float(rs.get("beta_slow", 1.0)),
                    mscale=float(rs.get("mscale", 0.0) or 0.0),
                    mscale_all_dim=float(rs.get("mscale_all_dim", 0.0) or 0.0),
                    attention_factor=rs.get("attention_factor"),
                    truncate=bool(rs.get("truncate", True)),
                )
            theta = cfg.get("rope_theta", (rs or {}).get("rope_theta", 10000.0))

            def opt(name: str) -> float | None:
                v = dcfg.get(name, cfg.get(name))
                return None if v is None else float(v)

            ids = dcfg.get("target_layer_ids", cfg.get("target_layer_ids"))
            mask = dcfg.get("mask_token_id", cfg.get("mask_token_id"))
            if ids is None or mask is None:
                raise ConvertError(f"{source}: needs target_layer_ids and mask_token_id")
            out = cls(
                hidden_size=hidden,
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                intermediate_size=int(cfg["intermediate_size"]),
                vocab_size=int(cfg["vocab_size"]),
                block_size=int(dcfg.get("block_size", cfg.get("block_size", 16))),
                target_layer_ids=tuple(int(i) for i in ids),
                mask_token_id=int(mask),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta),
                rope_scaling=scaling,
                target_hidden_size=(None if cfg.get("target_hidden_size") is None
                                    else int(cfg["target_hidden_size"])),
                markov_rank=int(cfg.get("markov_rank", 0)),
                has_confidence=bool(cfg.get("enable_confidence_head", cfg.get("has_confidence_head", False))),
                confidence_with_markov=bool(cfg.get("confidence_head_with_markov", True)),
                sample_from_anchor=bool(cfg.get("sample_from_anchor", True)),
                embedding_scale=opt("input_embedding_scale"),
                logit_scale=opt("output_multiplier"),
                final_logit_softcapping=opt("final_logit_softcapping"),
            )
        except ConvertError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise ConvertError(f"{source}: bad draft config ({type(e).__name__}: {e})") from None
        return out.validate(source)

    # GGUF metadata (llama.cpp `dflash` arch). target_layers holds HF ids + 1: llama.cpp reads
    # the INPUT of layer i+1, which is the output of layer i.
    def to_gguf_kv(self, arch: str = "dflash") -> dict[str, object]:
        kv: dict[str, object] = {
            f"{arch}.embedding_length": self.hidden_size,
            f"{arch}.block_count": self.num_layers,
            f"{arch}.feed_forward_length": self.intermediate_size,
            f"{arch}.attention.head_count": self.num_heads,
            f"{arch}.attention.head_count_kv": self.num_kv_heads,
            f"{arch}.attention.key_length": self.head_dim,
            f"{arch}.attention.value_length": self.head_dim,
            f"{arch}.attention.layer_norm_rms_epsilon": self.rms_norm_eps,
            f"{arch}.rope.freq_base": self.rope_theta,
            f"{arch}.rope.dimension_count": self.rope_dim or self.head_dim,
            f"{arch}.block_size": self.block_size,
            f"{arch}.target_layers": [i + 1 for i in self.target_layer_ids],
            f"{arch}.sample_from_anchor": self.sample_from_anchor,
            f"{arch}.has_confidence_head": self.has_confidence,
            "tokenizer.ggml.mask_token_id": self.mask_token_id,
        }
        for key, val in (("embedding_scale", self.embedding_scale), ("logit_scale", self.logit_scale),
                         ("final_logit_softcapping", self.final_logit_softcapping)):
            if val is not None:
                kv[f"{arch}.{key}"] = val
        if self.rope_scaling is not None:
            ys = self.rope_scaling
            kv |= {f"{arch}.rope.scaling.type": "yarn",
                   f"{arch}.rope.scaling.factor": ys.factor,
                   f"{arch}.rope.scaling.original_context_length": ys.original_max_position_embeddings,
                   f"{arch}.rope.scaling.yarn_beta_fast": ys.beta_fast,
                   f"{arch}.rope.scaling.yarn_beta_slow": ys.beta_slow}
            if ys.attention_factor is not None:
                kv[f"{arch}.rope.scaling.attn_factor"] = ys.attention_factor
        return kv

    @classmethod
    def from_gguf_kv(cls, kv: Mapping[str, object], *, vocab_size: int, markov_rank: int = 0,
                     target_hidden_size: int | None = None, confidence_with_markov: bool = True,
                     source: str = "draft.gguf", arch: str = "dflash") -> DraftConfig:
        """Config from GGUF metadata; vocab, Markov rank and the confidence input width come
        from tensor shapes (markov_w1 {r, V}; conf_proj {H + r, 1} or {H, 1})."""
        def get(key, default=None, required=False):
            full = f"{arch}.{key}" if not key.startswith("tokenizer.") else key
            if full not in kv:
                if required:
                    raise ConvertError(f"{source}: missing GGUF key {full!r}")
                return default
            return kv[full]

        try:
            heads = int(get("attention.head_count", required=True))
            hidden = int(get("embedding_length", required=True))
            scaling = None
            if get("rope.scaling.type") == "yarn":
                af = get("rope.scaling.attn_factor")
                scaling = YarnScaling(
                    factor=float(get("rope.scaling.factor", required=True)),
                    original_max_position_embeddings=int(get("rope.scaling.original_context_length",
                                                             required=True)),
                    beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)),
                    attention_factor=None if af is None else float(af),
                )
            layers = [int(i) - 1 for i in get("target_layers", required=True)]
            head_dim = int(get("attention.key_length", hidden // heads))

            def opt(key: str) -> float | None:
                v = get(key)
                return None if v is None else float(v)

            rope_dim = int(get("rope.dimension_count", head_dim))
            out = cls(
                hidden_size=hidden,
                num_layers=int(get("block_count", required=True)),
                num_heads=heads,
                num_kv_heads=int(get("attention.head_count_kv", heads)),
                head_dim=head_dim,
                intermediate_size=int(get("feed_forward_length", required=True)),
                vocab_size=int(vocab_size),
                block_size=int(get("block_size", 16)),
                target_layer_ids=tuple(layers),
                mask_token_id=int(get("tokenizer.ggml.mask_token_id", required=True)),
                rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", required=True)),
                rope_theta=float(get("rope.freq_base", 10000.0)),
                rope_scaling=scaling,
                rope_dim=None if rope_dim == head_dim else rope_dim,
                target_hidden_size=target_hidden_size,
                markov_rank=int(markov_rank),
                has_confidence=bool(get("has_confidence_head", False)),
                confidence_with_markov=confidence_with_markov,
                sample_from_anchor=bool(get("sample_from_anchor", True)),
                embedding_scale=opt("embedding_scale"),
                logit_scale=opt("logit_scale"),
                final_logit_softcapping=opt("final_logit_softcapping"),
            )
        except ConvertError:
            raise
        except (TypeError, ValueError) as e:
            raise ConvertError(f"{source}: bad draft metadata ({type(e).__name__}: {e})") from None
        return out.validate(source)


# ----------------------------------------------------------------------------- names

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL_NAMES = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
    "markov_head.markov_w1.weight": "markov_w1.weight",
    "markov_head.markov_w2.weight": "markov_w2.weight",
    "confidence_head.proj.weight": "conf_proj.weight",
    "confidence_head.proj.bias": "conf_proj.bias",
}
_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)")


def gguf_tensor_name(param: str) -> str:
    """DSparkDraft parameter name (= HF name without "model.") -> llama.cpp dflash tensor name."""
    if param.startswith("model."):
        param = param[len("model."):]
    if param in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[param]
    m = _LAYER_RE.fullmatch(param)
    if m and m.group(2) in _LAYER_NAMES:
        return f"blk.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise KeyError(f"no dflash GGUF name for draft parameter {param!r}")


def hf_tensor_name(param: str) -> str:
    return "model." + param


# ----------------------------------------------------------------------------- pieces

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * self.weight


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(cfg: DraftConfig) -> tuple[Tensor, float]:
    """Inverse frequencies (float64) and the cos/sin magnitude, YaRN-blended when configured.

    YaRN keeps high-frequency dims as trained (extrapolation), divides low-frequency dims by
    `factor` (interpolation) and ramps linearly between the dims that complete beta_fast and
    beta_slow rotations over the original context.
    """
    dim = cfg.rope_dim or cfg.head_dim
    base = cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    inv_extra = 1.0 / pos_freqs
    ys = cfg.rope_scaling
    if ys is None:
        return inv_extra, 1.0
    inv_inter = 1.0 / (ys.factor * pos_freqs)
    n_orig = ys.original_max_position_embeddings

    def correction_dim(n_rot: float) -> float:
        return (dim * math.log(n_orig / (n_rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(ys.beta_fast), correction_dim(ys.beta_slow)
    if ys.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extra_w = 1.0 - ramp
    inv = inv_inter * (1 - extra_w) + inv_extra * extra_w
    if ys.attention_factor is not None:
        mag = float(ys.attention_factor)
    elif ys.mscale and ys.mscale_all_dim:
        mag = _yarn_mscale(ys.factor, ys.mscale) / _yarn_mscale(ys.factor, ys.mscale_all_dim)
    else:
        mag = _yarn_mscale(ys.factor)
    return inv, mag


def apply_rope(x: Tensor, pos: Tensor, inv_freq: Tensor, mag: float) -> Tensor:
    """NeoX-style rotary embedding on the first len(inv_freq)*2 dims of x [n, heads, head_dim]."""
    rd = inv_freq.numel() * 2
    ang = pos.to(torch.float64)[:, None] * inv_freq[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    cos = (ang.cos() * mag).to(x.dtype)[:, None, :]
    sin = (ang.sin() * mag).to(x.dtype)[:, None, :]
    xr, xp = x[..., :rd], x[..., rd:]
    x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
    rot = torch.cat([-x2, x1], dim=-1)
    return torch.cat([xr * cos + rot * sin, xp], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = nn.Linear(h, nh * hd, bias=False)
        self.k_proj = nn.Linear(h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def kv(self, x: Tensor, pos: Tensor, rope: tuple[Tensor, float]) -> tuple[Tensor, Tensor]:
        n = x.shape[0]
        k = self.k_norm(self.k_proj(x).view(n, self.nkv, self.hd))
        v = self.v_proj(x).view(n, self.nkv, self.hd)
        return apply_rope(k, pos, *rope), v

    def forward(self, x: Tensor, pos: Tensor, rope: tuple[Tensor, float],
                ctx: tuple[Tensor, Tensor] | None) -> Tensor:
        n = x.shape[0]
        q = apply_rope(self.q_norm(self.q_proj(x).view(n, self.nh, self.hd)), pos, *rope)
        k, v = self.kv(x, pos, rope)
        if ctx is not None and ctx[0].shape[0]:
            k = torch.cat([ctx[0].to(k.dtype), k], 0)
            v = torch.cat([ctx[1].to(v.dtype), v], 0)
        rep = self.nh // self.nkv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        # no mask: the block sees every context row and every other block row
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        return self.o_proj(o.transpose(0, 1).reshape(n, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, pos, rope, ctx):
        x = x + self.self_attn(self.input_layernorm(x), pos, rope, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)


class ConfidenceHead(nn.Module):
    def __init__(self, in_features: int):
        super().__init__()
        self.proj = nn.Linear(in_features, 1, bias=True)


# ----------------------------------------------------------------------------- the draft

Embed = Tensor | Callable[[Tensor], Tensor]
Head = Tensor | Callable[[Tensor], Tensor]


class DSparkDraft(nn.Module):
    """The draft network. `embed` and `lm_head` belong to the target and are not parameters.

    embed:   [V, H] table or ids -> [n, H];   lm_head: [V, H] matrix or hidden [n, H] -> [n, V].
    """

    def __init__(self, cfg: DraftConfig, embed: Embed | None = None, lm_head: Head | None = None):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.fc = nn.Linear(cfg.n_taps * cfg.tap_width, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.markov_head = MarkovHead(cfg.vocab_size, cfg.markov_rank) if cfg.markov_rank else None
        self.confidence_head = (
            ConfidenceHead(cfg.hidden_size + (cfg.markov_rank if cfg.confidence_with_markov else 0))
            if cfg.has_confidence else None
        )
        inv, mag = rope_inv_freq(cfg)
        self.rope_inv_freq = inv          # float64, deliberately not a buffer: .half() must not touch it
        self.rope_mag = mag
        self._embed = embed
        self._head = lm_head

    def set_target(self, embed: Embed, lm_head: Head) -> None:
        self._embed, self._head = embed, lm_head

    # -- weights from a GGUF
    # The target's tensors a self-contained draft may carry; the draft borrows the target's instead.
    BORROWED = frozenset({"token_embd.weight", "output.weight"})

    @torch.no_grad()
    def load_gguf_tensors(self, tensors: Mapping[str, object], source: str = "draft.gguf") -> None:
        """Fill every parameter from float arrays keyed by llama.cpp dflash name, in numpy
        (row-major) shape = torch shape = reversed ggml shape. Missing, misshapen or unknown
        tensors are errors: a draft that silently keeps random weights proposes garbage."""
        names = {gguf_tensor_name(n): p for n, p in self.named_parameters()}
        unknown = sorted(set(tensors) - set(names) - self.BORROWED)
        if unknown:
            raise ConvertError(f"{source}: tensors this draft does not have: {', '.join(unknown[:5])}")
        for gname, p in names.items():
            if gname not in tensors:
                raise ConvertError(f"{source}: missing tensor {gname!r}")
            t = torch.as_tensor(tensors[gname])
            if tuple(t.shape) != tuple(p.shape):
                raise ConvertError(f"{source}: tensor {gname!r} has shape {tuple(reversed(t.shape))} "
                                   f"(ggml order), expected {tuple(reversed(p.shape))}")
            p.copy_(t.to(p.dtype))

    # -- borrowed pieces
    def embed(self, ids: Tensor) -> Tensor:
        if self._embed is None:
            raise RuntimeError("DSparkDraft has no target embedding; call set_target()")
        e = F.embedding(ids, self._embed) if isinstance(self._embed, Tensor) else self._embed(ids)
        e = e.to(self.fc.weight.dtype)
        return e if self.cfg.embedding_scale is None else e * self.cfg.embedding_scale

    def logits(self, hidden: Tensor) -> Tensor:
        """Base draft logits through the target's LM head (before the Markov bias)."""
        if self._head is None:
            raise RuntimeError("DSparkDraft has no target LM head; call set_target()")
        if isinstance(self._head, Tensor):
            logits = hidden.to(self._head.dtype) @ self._head.T
        else:
            logits = self._head(hidden)
        if self.cfg.logit_scale is not None:
            logits = logits * self.cfg.logit_scale
        cap = self.cfg.final_logit_softcapping
        if cap is not None and cap > 0:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # -- context
    def project_context(self, taps: Tensor) -> Tensor:
        """Concatenated tap features [n, n_taps*H_target] -> fused context rows [n, H]."""
        return self.hidden_norm(self.fc(taps.to(self.fc.weight.dtype)))

    def context_kv(self, taps: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Per-layer (K, V) of context rows at their own positions; they do not depend on the block."""
        g = self.project_context(taps)
        rope = (self.rope_inv_freq, self.rope_mag)
        return [layer.self_attn.kv(g, positions, rope) for layer in self.layers]

    # -- block
    def forward(self, block_ids: Tensor, positions: Tensor,
                ctx_kv: list[tuple[Tensor, Tensor]] | None = None) -> Tensor:
        """Block token ids [B] at positions [B] -> final-normed hidden rows [B, H]."""
        x = self.embed(block_ids)
        rope = (self.rope_inv_freq, self.rope_mag)
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, rope, None if ctx_kv is None else ctx_kv[i])
        return self.norm(x)

    # -- DSpark heads
    def markov_embed(self, prev: Tensor) -> Tensor:
        """W1[x_prev] rows [n, r]."""
        if self.markov_head is None:
            raise RuntimeError("this draft has no Markov head")
        return self.markov_head.markov_w1(prev)

    def markov_bias(self, w1_prev: Tensor) -> Tensor:
        """W2 . W1[x_prev] -> [n, V], added to the base logits of the row."""
        return self.markov_head.markov_w2(w1_prev)

    def confidence(self, hidden: Tensor, w1_prev: Tensor | None) -> Tensor:
        """c = sigmoid(w . [h ; W1[x_prev]] + b) -> [n]: the chance that this proposal is accepted
        given that every proposal before it was (the head was trained on prefix acceptance)."""
        if self.confidence_head is None:
            raise RuntimeError("this draft has no confidence head")
        feat = hidden
        if self.cfg.confidence_with_markov:
            feat = torch.cat([hidden, w1_prev.to(hidden.dtype)], dim=-1)
        return torch.sigmoid(self.confidence_head.proj(feat)).squeeze(-1)


# ----------------------------------------------------------------------------- runtime adapter

class _Rows:
    """Rows appended at the end, dropped at the front, read as one contiguous view; storage grows
    by doubling and compacts in place, so a decode pass copies only its new rows."""

    def __init__(self):
        self.buf: Tensor | None = None
        self.off = self.n = 0

    def append(self, x: Tensor) -> None:
        m = x.shape[0]
        if self.buf is None:
            self.buf = x.new_empty((max(64, 2 * m), *x.shape[1:]))
        elif self.off + self.n + m > self.buf.shape[0]:
            old = self.buf[self.off:self.off + self.n]
            if self.n + m > self.buf.shape[0] // 2:
                self.buf = x.new_empty((2 * (self.n + m), *x.shape[1:]))
            self.buf[: self.n] = old.clone()
            self.off = 0
        self.buf[self.off + self.n:self.off + self.n + m] = x
        self.n += m

    def drop_front(self, k: int) -> None:
        k = min(k, self.n)
        self.off += k
        self.n -= k

    def view(self) -> Tensor:
        return self.buf[self.off:self.off + self.n]


class DSparkDrafter:
    """Adapts a DSparkDraft to the runtime's Draft protocol.

    Keeps the per-layer K/V of the context rows: they depend only on committed features, so
    each committed position is projected once, when the ring first holds it. `max_context`
    bounds the attention window (None: whatever the ring holds).
    """

    def __init__(self, draft: DSparkDraft, max_context: int | None = None, chunk: int = 256,
                 block_size: int | None = None):
        self.draft = draft
        self.chunk = chunk
        self.cfg = draft.cfg
        self.max_context = max_context
        lo = 1 if draft.cfg.sample_from_anchor else 2
        if block_size is not None and not lo <= block_size <= draft.cfg.block_size:
            raise ValueError(f"block size {block_size} must be in {lo}..{draft.cfg.block_size} "
                             "(the draft's trained block)")
        # a shorter block than trained: fewer MASK rows in the forward, fewer proposals
        self.block_size = block_size or draft.cfg.block_size
        self.has_markov = draft.markov_head is not None
        self.has_confidence = draft.confidence_head is not None
        self._rows: list[tuple[_Rows, _Rows]] = []
        self._begin = self._end = 0
        self._ring_version: tuple[int, int] | None = None

    @property
    def n_proposals(self) -> int:
        return self.block_size if self.cfg.sample_from_anchor else self.block_size - 1

    @property
    def feature_width(self) -> int:
        return self.cfg.n_taps * self.cfg.tap_width

    @property
    def context_span(self) -> tuple[int, int]:
        return self._begin, self._end

    def context(self) -> list[tuple[Tensor, Tensor]] | None:
        """Per-layer (K, V) of the context rows currently held."""
        if self._end == self._begin:
            return None
        return [(k.view(), v.view()) for k, v in self._rows]

    @torch.no_grad()
    def sync(self, ring: FeatureRing) -> None:
        begin = ring.start
        if self.max_context is not None:
            begin = max(begin, ring.length - self.max_context)
        key = (id(ring), ring.version)
        if key != self._ring_version or self._end > ring.length or begin > self._end:
            self._rows = [(_Rows(), _Rows()) for _ in self.draft.layers]     # rebuild from the ring
            self._begin = self._end = begin
            self._ring_version = key
        if begin > self._begin:                                             # slide the window
            for k, v in self._rows:
                k.drop_front(begin - self._begin)
                v.drop_front(begin - self._begin)
            self._begin = begin
        while ring.length > self._end:          # chunked: a long prompt's taps are wide
            end = min(ring.length, self._end + self.chunk)
            new = self.draft.context_kv(ring.get(self._end, end), torch.arange(self._end, end))
            for (k, v), (nk, nv) in zip(self._rows, new, strict=True):
                k.append(nk)
                v.append(nv)
            self._end = end

    @torch.no_grad()
    def draft_block(self, anchor: int, position: int) -> DraftBlock:
        b = self.block_size
        ids = torch.full((b,), self.cfg.mask_token_id, dtype=torch.long)
        ids[0] = anchor
        pos = torch.arange(position, position + b)
        hidden = self.draft(ids, pos, self.context())
        logits = self.draft.logits(hidden)
        if not self.cfg.sample_from_anchor:      # DFlash: row 0 only re-reads the anchor
            hidden, logits = hidden[1:], logits[1:]
        return DraftBlock(logits=logits, hidden=hidden)

    @torch.no_grad()
    def markov_embed(self, prev: Tensor) -> Tensor:
        return self.draft.markov_embed(prev)

    @torch.no_grad()
    def markov_bias(self, w1_prev: Tensor) -> Tensor:
        return self.draft.markov_bias(w1_prev)

    @torch.no_grad()
    def confidence(self, hidden: Tensor, w1_prev: Tensor | None) -> Tensor:
        return self.draft.confidence(hidden, w1_prev)
