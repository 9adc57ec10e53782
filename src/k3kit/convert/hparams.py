"""A K3 `config.json`, read the way llama.cpp's converter reads it, and checked: the one parser.

llama.cpp's converter (conversion/base.py TextModel + conversion/kimi_k3.py) lifts
`text_config` to the top level (`{**config, **text_config}`), then reads plain keys. We do
the same, but a hostile or foreign config fails here with one line naming the key, instead
of an assert or a KeyError halfway through the tensors.

Both sides of k3kit read config.json through `parse_hparams`: the converter (convert/target.py)
and the torch model (`K3ModelConfig.from_hf_config` builds its dataclass from the K3HParams).
So this module stays torch-free and owns the bounds a hostile config is held to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3kit.errors import ConvertError

HF_ARCHITECTURE = "KimiK3ForConditionalGeneration"
MXFP4_FORMAT = "mxfp4-pack-quantized"

# Sanity bounds for configs read from disk (hostile JSON): generous for a 2.8T model.
MAX_DIM = 1 << 20
MAX_LAYERS = 4096
MAX_EXPERTS = 1 << 16
MAX_VOCAB = 1 << 24


@dataclass(frozen=True)
class K3HParams:
    """What the conversion needs from config.json, validated."""

    vocab_size: int
    hidden_size: int
    n_layer: int
    mla_layers: frozenset[int]          # 0-based (config.json lists them 1-based)
    n_head: int
    n_ctx: int
    rms_eps: float
    n_ff: int                           # dense FFN width
    # KDA
    kda_head_dim: int
    conv_kernel: int
    gate_lower_bound: float | None
    # MLA
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_head_dim: int
    mla_output_gate: bool | None        # None: the config does not say; take g_proj if present
    # MoE
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_shared: int
    n_dense_lead: int
    expert_weights_scale: float
    expert_weights_norm: bool
    latent: int                         # 0: routed experts run at hidden_size
    routed_norm: bool | None            # None: the config does not say
    experts_mxfp4: bool
    # K3 extras
    situ_beta: float
    situ_linear_beta: float
    attn_res_block_size: int
    # optional extras llama.cpp's TextModel also writes when present
    rope_theta: float | None
    n_group: int | None
    topk_group: int | None
    bos_token_id: int | None
    eos_token_id: int | None

    def is_mla(self, il: int) -> bool:
        return il in self.mla_layers

    def is_dense(self, il: int) -> bool:
        return il < self.n_dense_lead

    @property
    def kda_dim(self) -> int:
        return self.n_head * self.kda_head_dim

    @property
    def moe_in(self) -> int:
        return self.latent if self.latent > 0 else self.hidden_size


def _find(hp: dict, keys: tuple[str, ...]) -> Any:
    return next((hp[k] for k in keys if k in hp), None)


def parse_hparams(cfg: object, where: Path | str) -> K3HParams:
    """Validate a parsed config.json as a K3 text model; ConvertError naming `where` and the key."""
    if not isinstance(cfg, dict):
        raise ConvertError(f"{where}: not a JSON object")
    arch = cfg.get("architectures")
    if not isinstance(arch, list) or HF_ARCHITECTURE not in arch:
        raise ConvertError(f"{where}: architectures is {arch!r}, expected [{HF_ARCHITECTURE!r}]")
    text = cfg.get("text_config", {})
    if not isinstance(text, dict):
        raise ConvertError(f"{where}: text_config is not an object")
    hp = {**cfg, **text}

    def bad(key: str, msg: str) -> ConvertError:
        return ConvertError(f"{where}: {key} {msg}")

    def integer(key: str, lo: int, hi: int, value: Any = KeyError, src: dict = hp) -> int:
        v = src.get(key, value)
        if v is KeyError:
            raise bad(key, "is missing")
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise bad(key, f"must be an integer in {lo}..{hi}, got {v!r}")
        return v

    def opt_int(key: str, lo: int, hi: int, src: dict = hp) -> int | None:
        return None if src.get(key) is None else integer(key, lo, hi, src=src)

    def number(key: str, value: Any = KeyError, src: dict = hp) -> float:
        v = src.get(key, value)
        if v is KeyError:
            raise bad(key, "is missing")
        if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
            raise bad(key, f"must be a finite number, got {v!r}")
        return float(v)

    def flag(key: str, value: Any = KeyError) -> bool:
        v = hp.get(key, value)
        if v is KeyError:
            raise bad(key, "is missing")
        if not isinstance(v, bool):
            raise bad(key, f"must be true or false, got {v!r}")
        return v

    def text_is(key: str, want: str) -> None:
        if hp.get(key) != want:
            raise bad(key, f"is {hp.get(key)!r}, expected {want!r}")

    text_is("hidden_act", "situ")
    text_is("moe_router_activation_func", "sigmoid")
    if hp.get("mla_use_nope") is not True:
        raise bad("mla_use_nope", "must be true (K3's MLA has no rotary part)")
    if hp.get("tie_word_embeddings"):
        raise bad("tie_word_embeddings", "is set; K3 has a separate output matrix")

    n_layer = integer("num_hidden_layers", 1, MAX_LAYERS)
    n_head = integer("num_attention_heads", 1, MAX_DIM)
    lin = hp.get("linear_attn_config")
    if not isinstance(lin, dict):
        raise bad("linear_attn_config", "is missing or not an object")
    full = lin.get("full_attn_layers")
    if (not isinstance(full, list) or len(full) > n_layer
            or not all(isinstance(i, int) and not isinstance(i, bool) and 1 <= i <= n_layer for i in full)):
        raise bad("linear_attn_config.full_attn_layers", f"must list 1-based layers in 1..{n_layer}")
    mla = frozenset(i - 1 for i in full)
    if not mla or len(mla) == n_layer:
        raise bad("linear_attn_config.full_attn_layers", "must leave at least one KDA and one MLA layer")
    if lin.get("num_heads", n_head) != n_head:
        raise bad("linear_attn_config.num_heads", "differs from num_attention_heads; llama.cpp's kimi-k3 "
                  "has one head count")
    lb = lin.get("gate_lower_bound")

    quant = hp.get("quantization_config")
    mxfp4 = False
    if quant is not None:
        if not isinstance(quant, dict):
            raise bad("quantization_config", "is not an object")
        if quant.get("quant_method") != "compressed-tensors" or quant.get("format") != MXFP4_FORMAT:
            raise bad("quantization_config", f"has unsupported quant format {quant.get('quant_method')!r}/"
                      f"{quant.get('format')!r} (only compressed-tensors {MXFP4_FORMAT!r} routed experts)")
        mxfp4 = True

    def opt_flag(key: str) -> bool | None:
        return None if key not in hp else flag(key)

    n_ff = _find(hp, ("prefix_dense_intermediate_size", "dense_intermediate_size", "intermediate_size"))
    hp_ff = {"intermediate_size": n_ff}
    h = K3HParams(
        vocab_size=integer("vocab_size", 1, MAX_VOCAB),
        hidden_size=integer("hidden_size", 1, MAX_DIM),
        n_layer=n_layer,
        mla_layers=mla,
        n_head=n_head,
        n_ctx=integer("max_position_embeddings", 1, (1 << 32) - 1),
        rms_eps=number("rms_norm_eps"),
        n_ff=integer("intermediate_size", 1, MAX_DIM * 8, src=hp_ff),
        kda_head_dim=integer("head_dim", 1, MAX_DIM, src=lin),
        conv_kernel=integer("short_conv_kernel_size", 2, 64, src=lin),
        gate_lower_bound=None if lb is None else number("gate_lower_bound", src=lin),
        q_lora_rank=opt_int("q_lora_rank", 1, MAX_DIM),
        kv_lora_rank=integer("kv_lora_rank", 1, MAX_DIM),
        qk_nope=integer("qk_nope_head_dim", 1, MAX_DIM),
        qk_rope=integer("qk_rope_head_dim", 0, MAX_DIM),
        v_head_dim=integer("v_head_dim", 1, MAX_DIM),
        mla_output_gate=opt_flag("mla_output_gate"),
        n_expert=integer("num_experts", 1, MAX_EXPERTS),
        n_expert_used=integer("num_experts_per_tok", 1, MAX_EXPERTS),
        n_ff_exp=integer("moe_intermediate_size", 1, MAX_DIM),
        n_shared=integer("num_shared_experts", 0, 64),
        n_dense_lead=integer("first_k_dense_replace", 0, n_layer),
        expert_weights_scale=number("routed_scaling_factor"),
        expert_weights_norm=flag("moe_renormalize"),
        latent=opt_int("routed_expert_hidden_size", 1, MAX_DIM) or 0,
        routed_norm=opt_flag("routed_expert_norm"),
        experts_mxfp4=mxfp4,
        situ_beta=number("activation_situ_beta"),
        situ_linear_beta=number("activation_situ_linear_beta"),
        attn_res_block_size=integer("attn_res_block_size", 0, MAX_LAYERS),
        rope_theta=None if hp.get("rope_theta") is None else number("rope_theta"),
        n_group=opt_int("n_group", 1, MAX_EXPERTS),
        topk_group=opt_int("topk_group", 1, MAX_EXPERTS),
        bos_token_id=opt_int("bos_token_id", 0, MAX_VOCAB),
        eos_token_id=opt_int("eos_token_id", 0, MAX_VOCAB),
    )
    if h.n_expert_used > h.n_expert:
        raise bad("num_experts_per_tok", f"{h.n_expert_used} exceeds num_experts {h.n_expert}")
    if h.rms_eps <= 0:
        raise bad("rms_norm_eps", "must be positive")
    if mxfp4 and (h.moe_in % 32 or h.n_ff_exp % 32):
        raise ConvertError(f"{where}: MXFP4 experts need routed_expert_hidden_size (or hidden_size) and "
                           f"moe_intermediate_size to be multiples of 32")
    return h
