"""The shape of a synthetic kimi-k3 model: its dimensions (Geometry, and the K3, MINI and MINI256
presets), the tensors llama.cpp's kimi-k3 loader creates for them (tensor_shapes) and the KVs that
describe them (build_kv).

This is the part that must match llama.cpp's contract exactly, so it is kept apart from how the
bytes are made (k3kit.gguf.synth_pools) and written (k3kit.gguf.synth_write).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gguf import GGMLQuantizationType, GGUFValueType, Keys, LlamaFileType

from k3kit.gguf import format as fmt
from k3kit.gguf.reader import KV
from k3kit.gguf.synth_types import F32, MXFP4, Q8_0, Shape, TensorList
from k3kit.gguf.synth_vocab import Vocab
from k3kit.gguf.writer import kv

U16 = GGUFValueType.UINT16
U32 = GGUFValueType.UINT32
I32 = GGUFValueType.INT32
F32V = GGUFValueType.FLOAT32
STR = GGUFValueType.STRING
ARR = GGUFValueType.ARRAY

MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS
MAX_EXPERTS = 4096


@dataclass(frozen=True)
class Geometry:
    """Model dimensions. `k3` is Kimi-K3's (see K3 below for where each number comes from)."""

    name: str
    n_embd: int
    n_head: int  # ONE head count: llama.cpp uses it for KDA and MLA layers alike
    kda_head_dim: int
    conv_kernel: int
    q_lora: int
    kv_lora: int
    qk_nope: int
    qk_rope: int
    v_head: int
    n_ff_dense: int
    n_ff_exp: int
    expert_latent: int
    n_shared: int
    top_k: int
    attn_res_block: int
    situ_beta: float
    situ_linear_beta: float
    gate_lower_bound: float
    rms_eps: float
    context_length: int
    vocab: int
    expert_weights_scale: float
    n_dense_lead: int = 1
    mla_every: int = 4


# Kimi-K3. From k3-notes.md: hidden 7168, 93 layers (every 4th + last MLA), 896 experts top-16,
# latent MoE 3584 with routed norm, expert FFN 3072, MLA q_lora 1536 / kv_lora 512 /
# nope 128 + rope 64 / v 128, KDA head_dim 128 and conv 4, gate lower bound -5, situ 4 / 25,
# vocab 163840, 1M context. 96 heads is the brief's KDA head count (llama.cpp reads one count).
# Not published, closest documented values: dense FFN 18432 and routed scale 2.827 are Kimi-K2's
# (same hidden size); attn-res block 6 is the Attention Residuals paper's Kimi-Linear setting;
# 2 shared experts is what makes the Q8_0 trunk ~59.6 GB with the rest of this geometry
# (1 gives ~56 GB), rms eps 1e-5 as the K3 draft's.
K3 = Geometry(
    name="k3", n_embd=7168, n_head=96, kda_head_dim=128, conv_kernel=4,
    q_lora=1536, kv_lora=512, qk_nope=128, qk_rope=64, v_head=128,
    n_ff_dense=18432, n_ff_exp=3072, expert_latent=3584, n_shared=2, top_k=16,
    attn_res_block=6, situ_beta=4.0, situ_linear_beta=25.0, gate_lower_bound=-5.0,
    rms_eps=1e-5, context_length=1 << 20, vocab=163840, expert_weights_scale=2.827,
)

# The tiny model of k3-notes.md that llama.cpp was seen to load and run (dense FFN 512 chosen).
MINI = Geometry(
    name="mini", n_embd=256, n_head=4, kda_head_dim=64, conv_kernel=4,
    q_lora=64, kv_lora=64, qk_nope=32, qk_rope=16, v_head=32,
    n_ff_dense=512, n_ff_exp=96, expert_latent=128, n_shared=1, top_k=4,
    attn_res_block=2, situ_beta=4.0, situ_linear_beta=25.0, gate_lower_bound=-5.0,
    rms_eps=1e-5, context_length=4096, vocab=1024, expert_weights_scale=2.827,
)

# mini with 256-wide expert rows (latent 256, expert FFN 256), so the 256-weight block types
# (K-quants, i-quants, TQ) can be routed experts; mini's 128 / 96 fit only 32-weight blocks.
MINI256 = replace(MINI, name="mini256", n_ff_exp=256, expert_latent=256)

GEOMETRIES = {"k3": K3, "mini": MINI, "mini256": MINI256}


def mla_layers(n_layers: int, every: int = 4) -> list[int]:
    """K3's layer pattern scaled to n_layers: every `every`-th layer (1-indexed) plus the last."""
    return sorted({i for i in range(n_layers) if (i + 1) % every == 0} | {n_layers - 1})


def build_kv(g: Geometry, n_layers: int, n_experts: int, name: str, vocab: Vocab, *,
             file_type: int = int(LlamaFileType.MOSTLY_MXFP4_MOE)) -> list[KV]:
    a = fmt.ARCH_KIMI_K3
    mla = set(mla_layers(n_layers, g.mla_every))

    def k(template: str, vtype: GGUFValueType, value: object, item_type: GGUFValueType | None = None) -> KV:
        return kv(template.format(arch=a), vtype, value, item_type)

    L, A = Keys.LLM, Keys.Attention
    return [
        kv(Keys.General.ARCHITECTURE, STR, a),
        kv(Keys.General.NAME, STR, name),
        kv(Keys.General.FILE_TYPE, U32, file_type),
        kv(Keys.General.QUANTIZATION_VERSION, U32, 2),
        k(L.VOCAB_SIZE, U32, g.vocab),
        k(L.CONTEXT_LENGTH, U32, g.context_length),
        k(L.EMBEDDING_LENGTH, U32, g.n_embd),
        k(L.BLOCK_COUNT, U32, n_layers),
        k(L.FEED_FORWARD_LENGTH, U32, g.n_ff_dense),
        k(A.HEAD_COUNT, U32, g.n_head),
        k(A.HEAD_COUNT_KV, ARR, [1 if i in mla else 0 for i in range(n_layers)], I32),
        k(A.LAYERNORM_RMS_EPS, F32V, g.rms_eps),
        k(A.Q_LORA_RANK, U32, g.q_lora),
        k(A.KV_LORA_RANK, U32, g.kv_lora),
        k(A.KEY_LENGTH, U32, g.kv_lora + g.qk_rope),
        k(A.VALUE_LENGTH, U32, g.kv_lora),
        k(A.KEY_LENGTH_MLA, U32, g.qk_nope + g.qk_rope),
        k(A.VALUE_LENGTH_MLA, U32, g.v_head),
        k(Keys.Rope.DIMENSION_COUNT, U32, g.qk_rope),
        k(Keys.SSM.CONV_KERNEL, U32, g.conv_kernel),
        k(fmt.KEY_KDA_HEAD_DIM, U32, g.kda_head_dim),
        k(fmt.KEY_KDA_GATE_LOWER_BOUND, F32V, g.gate_lower_bound),
        k(L.EXPERT_COUNT, U32, n_experts),
        k(L.EXPERT_USED_COUNT, U32, min(g.top_k, n_experts)),
        k(L.EXPERT_FEED_FORWARD_LENGTH, U32, g.n_ff_exp),
        k(L.EXPERT_SHARED_COUNT, U32, g.n_shared),
        k(L.LEADING_DENSE_BLOCK_COUNT, U32, g.n_dense_lead),
        k(L.EXPERT_WEIGHTS_SCALE, F32V, g.expert_weights_scale),
        k(L.EXPERT_WEIGHTS_NORM, GGUFValueType.BOOL, True),
        k(L.EXPERT_GATING_FUNC, U32, fmt.EXPERT_GATING_SIGMOID),
        k(fmt.KEY_EXPERT_LATENT_LENGTH, U32, g.expert_latent),
        k(fmt.KEY_ATTN_RES_BLOCK_SIZE, U32, g.attn_res_block),
        k(fmt.KEY_SITU_BETA, F32V, g.situ_beta),
        k(fmt.KEY_SITU_LINEAR_BETA, F32V, g.situ_linear_beta),
        kv(Keys.Tokenizer.MODEL, STR, "gpt2"),
        kv(Keys.Tokenizer.PRE, STR, "kimi-k2"),
        kv(Keys.Tokenizer.LIST, ARR, vocab.tokens, STR),
        kv(Keys.Tokenizer.TOKEN_TYPE, ARR, vocab.token_types, I32),
        kv(Keys.Tokenizer.MERGES, ARR, vocab.merges, STR),
        kv(Keys.Tokenizer.BOS_ID, U32, vocab.bos),
        kv(Keys.Tokenizer.EOS_ID, U32, vocab.eos),
        kv(Keys.Tokenizer.ADD_BOS, GGUFValueType.BOOL, False),
    ]


def tensor_shapes(g: Geometry, n_layers: int, n_experts: int) -> TensorList:
    """(name, ggml shape, type) of every tensor, in file order, as kimi-k3.cpp creates them.

    Types follow llama.cpp's converter for a Q8_0 trunk with QAT MXFP4 experts: F32 for
    1-D tensors, norms, the router (ffn_gate_inp), the KDA conv kernels and suffix-less /
    bias tensors (ssm_a, ssm_dt.bias, exp_probs_b.bias); MXFP4 for the routed experts;
    Q8_0 for every other matrix. The MLA kv path is the split attn_k_b + attn_v_b.
    """
    H, nh, hd = g.n_embd, g.n_head, g.kda_head_dim
    d_inner = nh * hd
    lat, ffe, E = g.expert_latent, g.n_ff_exp, n_experts
    ff_sh = ffe * max(g.n_shared, 1)
    mla = set(mla_layers(n_layers, g.mla_every))
    out: TensorList = [
        ("token_embd.weight", (H, g.vocab), Q8_0),
    ]
    for i in range(n_layers):
        def b(base: str, shape: Shape, qtype: GGMLQuantizationType, suffix: str | None = "weight",
              i: int = i) -> None:
            out.append((fmt.blk(i, base, suffix), shape, qtype))

        b("attn_norm", (H,), F32)
        b("attn_res_score", (H,), F32)
        if i in mla:
            qk = g.qk_nope + g.qk_rope
            b("attn_q_a_norm", (g.q_lora,), F32)
            b("attn_q_a", (H, g.q_lora), Q8_0)
            b("attn_q_b", (g.q_lora, nh * qk), Q8_0)
            b("attn_kv_a_norm", (g.kv_lora,), F32)
            b("attn_kv_a_mqa", (H, g.kv_lora + g.qk_rope), Q8_0)
            b("attn_k_b", (g.qk_nope, g.kv_lora, nh), Q8_0)
            b("attn_v_b", (g.kv_lora, g.v_head, nh), Q8_0)
            b("attn_gate", (H, nh * g.v_head), Q8_0)
            b("attn_output", (nh * g.v_head, H), Q8_0)
        else:
            for x in "qkv":
                b(f"ssm_conv1d_{x}", (g.conv_kernel, 1, d_inner, 1), F32)
            for x in "qkv":
                b(f"attn_{x}", (H, d_inner), Q8_0)
            b("ssm_f_a", (H, hd), Q8_0)
            b("ssm_f_b", (hd, d_inner), Q8_0)
            b("ssm_beta", (H, nh), Q8_0)
            b("ssm_a", (nh,), F32, None)
            b("ssm_dt", (d_inner,), F32, "bias")
            b("ssm_g", (H, d_inner), Q8_0)
            b("ssm_norm", (hd,), F32)
            b("attn_output", (d_inner, H), Q8_0)
        b("ffn_norm", (H,), F32)
        b("ffn_res_score", (H,), F32)
        if i < g.n_dense_lead:
            b("ffn_gate", (H, g.n_ff_dense), Q8_0)
            b("ffn_up", (H, g.n_ff_dense), Q8_0)
            b("ffn_down", (g.n_ff_dense, H), Q8_0)
        else:
            b("ffn_gate_inp", (H, E), F32)
            b("exp_probs_b", (E,), F32, "bias")
            b("ffn_routed_down", (H, lat), Q8_0)
            b("ffn_routed_norm", (lat,), F32)
            b("ffn_gate_exps", (lat, ffe, E), MXFP4)
            b("ffn_up_exps", (lat, ffe, E), MXFP4)
            b("ffn_down_exps", (ffe, lat, E), MXFP4)
            b("ffn_routed_up", (lat, H), Q8_0)
            if g.n_shared > 0:
                b("ffn_gate_shexp", (H, ff_sh), Q8_0)
                b("ffn_up_shexp", (H, ff_sh), Q8_0)
                b("ffn_down_shexp", (ff_sh, H), Q8_0)
    out += [
        ("output_res_score.weight", (H,), F32),
        ("output_norm.weight", (H,), F32),
        ("output.weight", (H, g.vocab), Q8_0),
    ]
    return out
