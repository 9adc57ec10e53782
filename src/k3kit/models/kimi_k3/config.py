"""Hyperparameters of the Kimi-K3 text model, and their Hugging Face `config.json` form.

Field set = what llama.cpp's `kimi-k3` loader reads (src/models/kimi-k3.cpp,
load_arch_hparams) plus the shape facts it derives from tensors. The HF form is what
llama.cpp's converter (conversion/kimi_k3.py on top of conversion/base.py) reads:
`KimiK3ForConditionalGeneration` with the text model's keys under `text_config`.
config.json is parsed by the converter's parser (k3kit.convert.hparams), the only one;
`from_hf_config` maps its K3HParams onto this dataclass.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from k3kit.convert.hparams import (
    HF_ARCHITECTURE,
    MAX_DIM,
    MAX_EXPERTS,
    MAX_LAYERS,
    MAX_VOCAB,
    MXFP4_FORMAT,
    K3HParams,
    parse_hparams,
)
from k3kit.errors import K3Error

KDA = "kda"
MLA = "mla"


@dataclass
class K3ModelConfig:
    """Every hyperparameter llama.cpp's kimi-k3 graph uses.

    Defaults follow the published K3 where k3-notes states it (vocab, hidden 7168, 93 layers
    with MLA every 4th and last, q_lora 1536, kv_lora 512, qk 128+64, v 128, conv 4,
    lb -5, 896 experts top-16, expert FFN 3072, latent 3584, situ 4/25, 1M context); heads,
    KDA head_dim, dense width, attn-res block size and the routing scale are placeholders.
    Load the real config.json rather than trusting them.
    """

    vocab_size: int = 163840
    hidden_size: int = 7168
    layer_kinds: list[str] = field(default_factory=lambda: [
        MLA if (i + 1) % 4 == 0 or i == 92 else KDA for i in range(93)])
    num_heads: int = 64                 # ONE head count for KDA and MLA (llama.cpp: head_count)
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-5

    # KDA (linear attention)
    kda_head_dim: int = 128
    conv_kernel: int = 4
    gate_lower_bound: float | None = -5.0   # None: kimi-linear's softplus gate

    # MLA (NoPE)
    q_lora_rank: int | None = 1536          # None: a plain q_proj
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64              # no rotary: only sizes the shared "pe" part of q.k
    v_head_dim: int = 128
    mla_output_gate: bool = True

    # FFN / MoE
    intermediate_size: int = 18432          # dense FFN width (leading dense layers)
    first_k_dense: int = 1
    num_experts: int = 896
    num_experts_per_tok: int = 16
    moe_intermediate_size: int = 3072       # expert FFN width; shared width = this * num_shared_experts
    expert_latent_size: int = 3584          # 0: routed experts run at hidden_size (no latent MoE)
    routed_expert_norm: bool = True         # RMSNorm on the routed sum, in latent space
    num_shared_experts: int = 1
    routed_scaling_factor: float = 1.0
    moe_renormalize: bool = True
    experts_mxfp4: bool = True              # routed experts are MXFP4 (QAT): fake-quantized in forward

    # cross-layer residual attention and the situ activation
    attn_res_block_size: int = 6
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0

    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        self.layer_kinds = list(self.layer_kinds)

    # -- derived ------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def kda_dim(self) -> int:
        return self.num_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def moe_in_dim(self) -> int:
        """Width the routed experts see: the latent length, or the hidden size."""
        return self.expert_latent_size if self.expert_latent_size > 0 else self.hidden_size

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * max(self.num_shared_experts, 1)

    def is_kda(self, il: int) -> bool:
        return self.layer_kinds[il] == KDA

    def is_dense(self, il: int) -> bool:
        return il < self.first_k_dense

    # -- checks -------------------------------------------------------------------------------
    def validate(self, where: str = "config") -> K3ModelConfig:
        """Raise K3Error naming `where` if the config cannot describe a working model."""

        def bad(msg: str) -> K3Error:
            return K3Error(f"{where}: {msg}")

        for name in ("vocab_size", "hidden_size", "num_heads", "kda_head_dim", "kv_lora_rank",
                     "qk_nope_head_dim", "v_head_dim", "intermediate_size", "moe_intermediate_size",
                     "num_experts", "num_experts_per_tok", "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 < v <= MAX_DIM * 64:
                raise bad(f"{name} must be a positive integer, got {v!r}")
        for name in ("qk_rope_head_dim", "expert_latent_size", "num_shared_experts", "first_k_dense",
                     "attn_res_block_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_DIM:
                raise bad(f"{name} must be a non-negative integer, got {v!r}")
        if self.hidden_size > MAX_DIM or self.vocab_size > MAX_VOCAB:
            raise bad("hidden_size or vocab_size out of range")
        if not 0 < self.num_layers <= MAX_LAYERS:
            raise bad(f"{self.num_layers} layers is out of range")
        unknown = sorted({k for k in self.layer_kinds if k not in (KDA, MLA)})
        if unknown:
            raise bad(f"unknown layer kind(s) {unknown}")
        if KDA not in self.layer_kinds or MLA not in self.layer_kinds:
            raise bad("kimi-k3 needs at least one KDA and one MLA layer")
        if self.q_lora_rank is not None and not (isinstance(self.q_lora_rank, int) and self.q_lora_rank > 0):
            raise bad(f"q_lora_rank must be a positive integer or null, got {self.q_lora_rank!r}")
        if not isinstance(self.conv_kernel, int) or not 2 <= self.conv_kernel <= 64:
            raise bad(f"conv_kernel must be 2..64, got {self.conv_kernel!r}")
        if self.num_experts > MAX_EXPERTS or not 0 < self.num_experts_per_tok <= self.num_experts:
            raise bad(f"top-{self.num_experts_per_tok} of {self.num_experts} experts is not possible")
        if not 0 <= self.first_k_dense <= self.num_layers:
            raise bad(f"first_k_dense {self.first_k_dense} exceeds {self.num_layers} layers")
        for name in ("rms_norm_eps", "situ_beta", "situ_linear_beta", "routed_scaling_factor"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise bad(f"{name} must be a finite number, got {v!r}")
        if self.rms_norm_eps <= 0 or self.situ_beta <= 0:
            raise bad("rms_norm_eps and situ_beta must be positive")
        if self.gate_lower_bound is not None and not (
                isinstance(self.gate_lower_bound, (int, float)) and math.isfinite(self.gate_lower_bound)):
            raise bad(f"gate_lower_bound must be a finite number or null, got {self.gate_lower_bound!r}")
        if self.experts_mxfp4 and (self.moe_in_dim % 32 or self.moe_intermediate_size % 32):
            raise bad("MXFP4 experts need the expert input widths (latent/hidden and expert FFN) "
                      "to be multiples of 32")
        return self

    # -- Hugging Face config.json -------------------------------------------------------------
    def to_hf_config(self) -> dict[str, Any]:
        """The `config.json` llama.cpp's converter accepts for this model."""
        full = [i + 1 for i, k in enumerate(self.layer_kinds) if k == MLA]   # 1-indexed
        kda = [i + 1 for i, k in enumerate(self.layer_kinds) if k == KDA]
        linear: dict[str, Any] = {
            "full_attn_layers": full,
            "kda_layers": kda,
            "num_heads": self.num_heads,
            "head_dim": self.kda_head_dim,
            "short_conv_kernel_size": self.conv_kernel,
        }
        if self.gate_lower_bound is not None:
            linear["gate_lower_bound"] = float(self.gate_lower_bound)
        text: dict[str, Any] = {
            "model_type": "kimi_k3_text",
            "architectures": ["KimiLinearForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            # the converter splits kv_b_proj per key/value head: MLA has one per query head
            "num_key_value_heads": self.num_heads,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "linear_attn_config": linear,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "mla_use_nope": True,
            "mla_output_gate": self.mla_output_gate,
            "intermediate_size": self.intermediate_size,
            "first_k_dense_replace": self.first_k_dense,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_shared_experts": self.num_shared_experts,
            "routed_scaling_factor": float(self.routed_scaling_factor),
            "moe_renormalize": self.moe_renormalize,
            "moe_router_activation_func": "sigmoid",
            "routed_expert_norm": self.routed_expert_norm,
            "hidden_act": "situ",
            "activation_situ_beta": float(self.situ_beta),
            "activation_situ_linear_beta": float(self.situ_linear_beta),
            "attn_res_block_size": self.attn_res_block_size,
            "tie_word_embeddings": False,
        }
        if self.expert_latent_size > 0:
            text["routed_expert_hidden_size"] = self.expert_latent_size
        for key in ("bos_token_id", "eos_token_id"):
            if getattr(self, key) is not None:
                text[key] = getattr(self, key)
        out: dict[str, Any] = {
            "architectures": [HF_ARCHITECTURE],
            "model_type": "kimi_k3",
            "text_config": text,
            "tie_word_embeddings": False,
        }
        for key in ("bos_token_id", "eos_token_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.experts_mxfp4:
            out["quantization_config"] = _compressed_tensors_mxfp4()
        return out

    @classmethod
    def from_hf_config(cls, cfg: Any, where: str = "config.json") -> K3ModelConfig:
        """Parse a K3 `config.json` dict (as the converter reads it); ConvertError if it is not one."""
        return cls.from_hparams(parse_hparams(cfg, where), where)

    @classmethod
    def from_hparams(cls, hp: K3HParams, where: str = "config.json") -> K3ModelConfig:
        """The model's config for a parsed config.json. What the file leaves unsaid (output gate,
        routed-expert norm) is taken as present; a loader with the tensors corrects it."""
        conf = cls(
            vocab_size=hp.vocab_size,
            hidden_size=hp.hidden_size,
            layer_kinds=[MLA if hp.is_mla(i) else KDA for i in range(hp.n_layer)],
            num_heads=hp.n_head,
            max_position_embeddings=hp.n_ctx,
            rms_norm_eps=hp.rms_eps,
            kda_head_dim=hp.kda_head_dim,
            conv_kernel=hp.conv_kernel,
            gate_lower_bound=hp.gate_lower_bound,
            q_lora_rank=hp.q_lora_rank,
            kv_lora_rank=hp.kv_lora_rank,
            qk_nope_head_dim=hp.qk_nope,
            qk_rope_head_dim=hp.qk_rope,
            v_head_dim=hp.v_head_dim,
            mla_output_gate=True if hp.mla_output_gate is None else hp.mla_output_gate,
            intermediate_size=hp.n_ff,
            first_k_dense=hp.n_dense_lead,
            num_experts=hp.n_expert,
            num_experts_per_tok=hp.n_expert_used,
            moe_intermediate_size=hp.n_ff_exp,
            expert_latent_size=hp.latent,
            routed_expert_norm=True if hp.routed_norm is None else hp.routed_norm,
            num_shared_experts=hp.n_shared,
            routed_scaling_factor=hp.expert_weights_scale,
            moe_renormalize=hp.expert_weights_norm,
            experts_mxfp4=hp.experts_mxfp4,
            attn_res_block_size=hp.attn_res_block_size,
            situ_beta=hp.situ_beta,
            situ_linear_beta=hp.situ_linear_beta,
            bos_token_id=hp.bos_token_id,
            eos_token_id=hp.eos_token_id,
        )
        return conf.validate(where)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> K3ModelConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def _compressed_tensors_mxfp4() -> dict[str, Any]:
    """compressed-tensors block for MXFP4 routed experts; everything else stays unquantized."""
    return {
        "quant_method": "compressed-tensors",
        "format": MXFP4_FORMAT,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "format": MXFP4_FORMAT,
                "targets": [r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"],
                "weights": {
                    "num_bits": 4,
                    "type": "float",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": 32,
                    "scale_dtype": "uint8",   # E8M0 biased exponent
                    "dynamic": False,
                },
                "input_activations": None,
            }
        },
        "ignore": ["lm_head"],
    }


def tiny_config(**overrides: Any) -> K3ModelConfig:
    """A few-hundred-kB K3 with every feature switched on: for tests and smoke runs.

    Layers KDA, KDA, MLA, KDA, KDA, MLA with a dense first layer and attn-res block 2,
    so a short sequence crosses several banks and conv windows.
    """
    base: dict[str, Any] = dict(
        vocab_size=96, hidden_size=64, layer_kinds=[KDA, KDA, MLA, KDA, KDA, MLA], num_heads=2,
        max_position_embeddings=512, rms_norm_eps=1e-5, kda_head_dim=16, conv_kernel=4,
        gate_lower_bound=-5.0, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, mla_output_gate=True, intermediate_size=96,
        first_k_dense=1, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
        expert_latent_size=32, routed_expert_norm=True, num_shared_experts=1,
        routed_scaling_factor=2.5, moe_renormalize=True, experts_mxfp4=True,
        attn_res_block_size=2, situ_beta=4.0, situ_linear_beta=25.0,
    )
    base.update(overrides)
    return K3ModelConfig(**base).validate("tiny_config")
