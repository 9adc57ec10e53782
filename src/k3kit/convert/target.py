"""`k3kit convert target`: a Hugging Face Kimi-K3 checkpoint -> one kimi-k3 GGUF.

The output is the file llama.cpp's own `convert_hf_to_gguf.py` writes for
`KimiK3ForConditionalGeneration` (conversion/kimi_k3.py on conversion/base.py): same tensor
names, shapes, types and bytes, same KVs (tests/interop/test_convert_vs_llama.py checks it
tensor by tensor). The mapping, in short:

* names lose `language_model.`; vision_tower./mm_projector. tensors are skipped (text only),
  so are rotary inv_freq buffers; any other tensor the config does not explain is an error;
* KDA convs [C, 1, K] -> ggml [K, 1, C, 1] (a pure reshape); A_log -> ssm_a = -exp(A_log);
  dt_bias -> ssm_dt.bias; g_proj is ssm_g on KDA layers and attn_gate on MLA layers;
* MLA kv_b_proj [H*(nope+v), kv_lora] splits per head into attn_k_b (ggml [nope, kv_lora, H],
  i.e. transposed) and attn_v_b (ggml [kv_lora, v, H]);
* `<x>_res_norm` * `<x>_res_proj` fuse into one F32 vector (attn/ffn/output_res_score);
* routed experts stack into blk.N.ffn_{gate,down,up}_exps [cols, rows, E]; compressed-tensors
  MXFP4 (`weight_packed` + E8M0 `weight_scale`) is repacked bit for bit into ggml MXFP4 blocks,
  never dequantized: the QAT-rounded 4-bit values ARE the model;
* the trunk is quantized with k3kit.gguf.quants (Q8_0 default, or BF16/F32); 1-D tensors,
  norms, the router, conv kernels and non-`.weight` tensors stay F32; a Q8_0 tensor whose rows
  are not whole 32-blocks falls back to F16, as llama.cpp's converter does.

Deliberate differences from llama.cpp's file: tensor ORDER (ours is embedding, layers in
order, output; llama.cpp's follows the checkpoint's key order with experts first);
`general.name` is the directory name as is, unless given (llama.cpp title-cases and parses it;
its general.size_label rule is reproduced); the tokenizer KVs (llama.cpp only converts tokenizers
whose hash it knows; see vocab.py), with no bundled chat template when the checkpoint has
none; ssm_a is -exp(A_log) computed in float64 and rounded once (llama.cpp: torch's float32
exp, within 1 ulp of it), and always the [n_head] vector kimi-k3's loader wants, also from
Kimi-Linear's [1, 1, H, 1] A_log (llama.cpp's converter keeps that shape, which its loader
then rejects).

Everything is planned and checked before the output is created (names, shapes, dtypes,
config/tensor agreement), then written by k3kit.gguf.writer with one callable per tensor, so
at most one tensor's data is in memory (for K3, a stacked expert tensor: ~5.2 GB) and a
failure leaves nothing behind.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, Keys, LlamaFileType
from gguf.utility import size_label

from k3kit.errors import ConvertError, K3Error
from k3kit.gguf import format as fmt
from k3kit.gguf import quants
from k3kit.gguf.reader import KV, tensor_nbytes
from k3kit.gguf.writer import TensorSpec, kv, write_gguf
from k3kit.progress import byte_progress

from .checkpoint import Checkpoint, TensorEntry, read_json
from .hparams import K3HParams, parse_hparams
from .mxfp4_repack import repack_mxfp4
from .vocab import tokenizer_kvs

T = GGMLQuantizationType
TRUNK_TYPES = {"Q8_0": T.Q8_0, "BF16": T.BF16, "F32": T.F32}
_FILE_TYPES = {T.Q8_0: LlamaFileType.MOSTLY_Q8_0, T.BF16: LlamaFileType.MOSTLY_BF16,
               T.F32: LlamaFileType.ALL_F32}
PREFIX = "language_model."
SKIPPED_PREFIXES = ("vision_tower.", "mm_projector.")
SKIPPED_SUFFIXES = (".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")  # as llama.cpp
# compressed-tensors expert projections: w1 gate, w2 down, w3 up
_EXPERT_PROJ = (("w1", "ffn_gate_exps"), ("w2", "ffn_down_exps"), ("w3", "ffn_up_exps"))
MXFP4_PACKED_DTYPES = ("U8", "I8")
MXFP4_SCALE_DTYPES = ("U8", "F8_E8M0")


@dataclass
class ConvertResult:
    """What `convert target` did; the CLI prints it for people or as JSON."""

    output: str
    source: str
    trunk_type: str
    tensors: int
    kvs: int
    file_bytes: int
    expert_tensors: int
    expert_bytes: int
    type_counts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------- tensor plumbing


def _encode(x: np.ndarray, qtype: T) -> np.ndarray:
    """float32 (numpy shape) -> the tensor's ggml bytes."""
    if qtype == T.F32:
        return np.ascontiguousarray(x, dtype=np.float32).reshape(-1).view(np.uint8)
    rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    # in row chunks: the codec's float temporaries stay small even for a 163840-row embedding
    return quants.quantize_rows(rows, qtype, chunk_rows=4096).reshape(-1)


def _out_type(name: str, np_shape: tuple[int, ...], trunk: T) -> T:
    """llama.cpp's converter's choice for a float tensor (conversion/base.py prepare_tensors)."""
    if fmt.converter_keeps_f32(name, len(np_shape)):
        return T.F32
    block = quants.type_size(trunk)[0]
    if np_shape[-1] % block:
        return T.F16          # gguf-py raises QuantError and the converter falls back to F16
    return trunk


class _Planner:
    """Walks the expected K3 tensors, checks them against the checkpoint, builds TensorSpecs."""

    def __init__(self, ckpt: Checkpoint, hp: K3HParams, trunk: T):
        self.ckpt, self.hp, self.trunk = ckpt, hp, trunk
        self.specs: list[TensorSpec] = []
        self.used: set[str] = set()
        self.by_name: dict[str, TensorEntry] = {}
        for raw, e in ckpt.tensors.items():
            if raw.startswith(SKIPPED_PREFIXES) or raw.endswith(SKIPPED_SUFFIXES):
                continue
            name = raw.removeprefix(PREFIX)
            if name in self.by_name:
                raise ConvertError(f"{e.where}: same tensor as {self.by_name[name].where} after removing "
                                   f"{PREFIX!r}")
            self.by_name[name] = e

    # -- lookups
    def has(self, name: str) -> bool:
        return name in self.by_name

    def take(self, name: str, shape: tuple[int, ...] | None = None, numel: int | None = None,
             dtypes: tuple[str, ...] = ("F32", "F16", "BF16")) -> TensorEntry:
        e = self.by_name.get(name)
        if e is None:
            raise ConvertError(f"{self.ckpt.source}: missing tensor {PREFIX + name!r}")
        if e.dtype not in dtypes:
            raise ConvertError(f"{e.where}: dtype {e.dtype}, expected {'/'.join(dtypes)}")
        if shape is not None and e.shape != shape:
            raise ConvertError(f"{e.where}: shape {list(e.shape)}, expected {list(shape)}")
        if numel is not None and math.prod(e.shape) != numel:
            raise ConvertError(f"{e.where}: shape {list(e.shape)} holds {math.prod(e.shape)} values, "
                               f"expected {numel}")
        self.used.add(name)
        return e

    # -- emitting
    def add(self, name: str, np_shape: tuple[int, ...], make: Callable[[], np.ndarray],
            qtype: T | None = None) -> None:
        """One float tensor: `make()` gives float32 of `np_shape`, encoded here as llama.cpp would."""
        qtype = qtype or _out_type(name, np_shape, self.trunk)
        shape = tuple(reversed(np_shape))
        nbytes = tensor_nbytes(shape, qtype)

        def source() -> np.ndarray:
            x = make()
            if x.shape != np_shape:   # a bug in the mapping, not user input
                raise AssertionError(f"{name}: built {x.shape}, planned {np_shape}")
            return _encode(x, qtype)

        self.specs.append(TensorSpec(name, shape, qtype, nbytes, source))

    def add_stacked(self, name: str, np_shape: tuple[int, ...], parts: list[Callable[[], np.ndarray]],
                    qtype: T | None = None) -> None:
        """A [E, rows, cols] tensor written one expert at a time: a K3 expert stack is gigabytes,
        and every codec works along rows, so per-expert encodings concatenate to the whole's."""
        qtype = qtype or _out_type(name, np_shape, self.trunk)
        shape = tuple(reversed(np_shape))
        nbytes = tensor_nbytes(shape, qtype)

        def source() -> Iterator[np.ndarray]:
            for make in parts:
                x = make()
                if x.shape != np_shape[1:]:   # a bug in the mapping, not user input
                    raise AssertionError(f"{name}: built an expert of {x.shape}, planned {np_shape[1:]}")
                yield _encode(x, qtype)

        self.specs.append(TensorSpec(name, shape, qtype, nbytes, source))

    def plain(self, gguf_name: str, hf_name: str, np_shape: tuple[int, ...]) -> None:
        e = self.take(hf_name, np_shape)
        self.add(gguf_name, np_shape, lambda: self.ckpt.floats(e))


def _expected_rows_cols(wid: str, hp: K3HParams) -> tuple[int, int]:
    return (hp.moe_in, hp.n_ff_exp) if wid == "w2" else (hp.n_ff_exp, hp.moe_in)


def _plan_layer(p: _Planner, il: int) -> None:
    hp, ck = p.hp, p.ckpt
    H = hp.hidden_size
    src = f"model.layers.{il}."
    blk = f"blk.{il}."
    p.plain(blk + "attn_norm.weight", src + "input_layernorm.weight", (H,))
    if hp.attn_res_block_size > 0:
        _plan_res(p, blk + "attn_res_score.weight", src + "self_attention_res")
    if hp.is_mla(il):
        _plan_mla(p, il)
    else:
        _plan_kda(p, il)
    p.plain(blk + "ffn_norm.weight", src + "post_attention_layernorm.weight", (H,))
    if hp.attn_res_block_size > 0:
        _plan_res(p, blk + "ffn_res_score.weight", src + "mlp_res")
    if hp.is_dense(il):
        F = hp.n_ff
        p.plain(blk + "ffn_gate.weight", src + "mlp.gate_proj.weight", (F, H))
        p.plain(blk + "ffn_down.weight", src + "mlp.down_proj.weight", (H, F))
        p.plain(blk + "ffn_up.weight", src + "mlp.up_proj.weight", (F, H))
        return
    moe = src + "block_sparse_moe."
    E = hp.n_expert
    p.plain(blk + "ffn_gate_inp.weight", moe + "gate.weight", (E, H))
    p.plain(blk + "exp_probs_b.bias", moe + "gate.e_score_correction_bias", (E,))
    if hp.latent > 0:
        L = hp.latent
        p.plain(blk + "ffn_routed_down.weight", moe + "routed_expert_down_proj.weight", (L, H))
        p.plain(blk + "ffn_routed_up.weight", moe + "routed_expert_up_proj.weight", (H, L))
        norm = moe + "routed_expert_norm.weight"
        if hp.routed_norm or (hp.routed_norm is None and p.has(norm)):
            p.plain(blk + "ffn_routed_norm.weight", norm, (L,))
    if hp.n_shared > 0:
        S = hp.n_ff_exp * hp.n_shared
        p.plain(blk + "ffn_gate_shexp.weight", moe + "shared_experts.gate_proj.weight", (S, H))
        p.plain(blk + "ffn_down_shexp.weight", moe + "shared_experts.down_proj.weight", (H, S))
        p.plain(blk + "ffn_up_shexp.weight", moe + "shared_experts.up_proj.weight", (S, H))
    for wid, base in _EXPERT_PROJ:
        rows, cols = _expected_rows_cols(wid, hp)
        names = [f"{moe}experts.{e}.{wid}." for e in range(E)]
        if hp.experts_mxfp4:
            packed = [p.take(n + "weight_packed", (rows, cols // 2), dtypes=MXFP4_PACKED_DTYPES)
                      for n in names]
            scales = [p.take(n + "weight_scale", (rows, cols // 32), dtypes=MXFP4_SCALE_DTYPES)
                      for n in names]
            _plan_mxfp4_experts(p, blk + base + ".weight", packed, scales, rows, cols)
        else:
            entries = [p.take(n + "weight", (rows, cols)) for n in names]
            p.add_stacked(blk + base + ".weight", (E, rows, cols),
                          [partial(ck.floats, e) for e in entries])


def _plan_mxfp4_experts(p: _Planner, name: str, packed: list[TensorEntry], scales: list[TensorEntry],
                        rows: int, cols: int) -> None:
    E = len(packed)
    shape = (cols, rows, E)
    nbytes = tensor_nbytes(shape, T.MXFP4)

    def source() -> Iterator[np.ndarray]:     # one expert at a time: the stack may be gigabytes
        for pk, sc in zip(packed, scales, strict=True):
            yield repack_mxfp4(p.ckpt.raw(pk).reshape(pk.shape), p.ckpt.raw(sc).reshape(sc.shape)).reshape(-1)

    p.specs.append(TensorSpec(name, shape, T.MXFP4, nbytes, source))


def _plan_res(p: _Planner, gguf_name: str, stem: str) -> None:
    H = p.hp.hidden_size
    norm = p.take(stem + "_norm.weight", numel=H)
    proj = p.take(stem + "_proj.weight", numel=H)
    p.add(gguf_name, (H,), lambda: p.ckpt.floats(norm).reshape(-1) * p.ckpt.floats(proj).reshape(-1))


def _plan_kda(p: _Planner, il: int) -> None:
    hp, ck = p.hp, p.ckpt
    H, C, D, nh = hp.hidden_size, hp.kda_dim, hp.kda_head_dim, hp.n_head
    src, blk = f"model.layers.{il}.self_attn.", f"blk.{il}."
    for x in "qkv":
        name = f"{src}{x}_conv1d.weight"
        e = p.by_name.get(name)
        shape = (C, 1, hp.conv_kernel) if e is None or len(e.shape) == 3 else (C, hp.conv_kernel)
        e = p.take(name, shape)

        def conv(e: TensorEntry = e) -> np.ndarray:  # a def: mypy cannot type a lambda's default
            return ck.floats(e).reshape(1, C, 1, hp.conv_kernel)

        p.add(f"{blk}ssm_conv1d_{x}.weight", (1, C, 1, hp.conv_kernel), conv)
        p.plain(f"{blk}attn_{x}.weight", f"{src}{x}_proj.weight", (C, H))
    p.plain(blk + "ssm_f_a.weight", src + "f_a_proj.weight", (D, H))
    p.plain(blk + "ssm_f_b.weight", src + "f_b_proj.weight", (C, D))
    p.plain(blk + "ssm_beta.weight", src + "b_proj.weight", (nh, H))
    a_log = p.take(src + "A_log", numel=nh)
    # ssm_a holds -exp(A_log), folded here so the graph does not have to. exp in float64, then
    # one rounding: numpy's float32 exp is off by an ulp on some inputs, torch's (llama.cpp's
    # converter) is within an ulp; the correctly rounded value is the one to agree on.
    p.add(blk + "ssm_a", (nh,),
          lambda: (-np.exp(ck.floats(a_log).reshape(-1).astype(np.float64))).astype(np.float32))
    p.plain(blk + "ssm_dt.bias", src + "dt_bias", (C,))
    p.plain(blk + "ssm_g.weight", src + "g_proj.weight", (C, H))
    p.plain(blk + "ssm_norm.weight", src + "o_norm.weight", (D,))
    p.plain(blk + "attn_output.weight", src + "o_proj.weight", (H, C))


def _plan_mla(p: _Planner, il: int) -> None:
    hp, ck = p.hp, p.ckpt
    H, nh = hp.hidden_size, hp.n_head
    nope, rope, v, kvr = hp.qk_nope, hp.qk_rope, hp.v_head_dim, hp.kv_lora_rank
    src, blk = f"model.layers.{il}.self_attn.", f"blk.{il}."
    if hp.q_lora_rank is not None:
        q = hp.q_lora_rank
        p.plain(blk + "attn_q_a.weight", src + "q_a_proj.weight", (q, H))
        p.plain(blk + "attn_q_a_norm.weight", src + "q_a_layernorm.weight", (q,))
        p.plain(blk + "attn_q_b.weight", src + "q_b_proj.weight", (nh * (nope + rope), q))
    else:
        p.plain(blk + "attn_q.weight", src + "q_proj.weight", (nh * (nope + rope), H))
    p.plain(blk + "attn_kv_a_mqa.weight", src + "kv_a_proj_with_mqa.weight", (kvr + rope, H))
    p.plain(blk + "attn_kv_a_norm.weight", src + "kv_a_layernorm.weight", (kvr,))
    kv_b = p.take(src + "kv_b_proj.weight", (nh * (nope + v), kvr))

    def k_b() -> np.ndarray:   # per head [nope, kv_lora] -> transposed [kv_lora, nope]
        return ck.floats(kv_b).reshape(nh, nope + v, kvr)[:, :nope, :].transpose(0, 2, 1)

    def v_b() -> np.ndarray:
        return ck.floats(kv_b).reshape(nh, nope + v, kvr)[:, nope:, :]

    p.add(blk + "attn_k_b.weight", (nh, kvr, nope), k_b)
    p.add(blk + "attn_v_b.weight", (nh, v, kvr), v_b)
    p.plain(blk + "attn_output.weight", src + "o_proj.weight", (H, nh * v))
    gate = src + "g_proj.weight"
    if hp.mla_output_gate or (hp.mla_output_gate is None and p.has(gate)):
        p.plain(blk + "attn_gate.weight", gate, (nh * v, H))


def _plan_tensors(ckpt: Checkpoint, hp: K3HParams, trunk: T) -> list[TensorSpec]:
    p = _Planner(ckpt, hp, trunk)
    if not hp.experts_mxfp4:
        packed = next((n for n in p.by_name if n.endswith(".weight_packed")), None)
        if packed is not None:
            raise ConvertError(f"{p.by_name[packed].where}: quantized tensor, but config.json has no "
                               "quantization_config")
    H, V = hp.hidden_size, hp.vocab_size
    p.plain("token_embd.weight", "model.embed_tokens.weight", (V, H))
    for il in range(hp.n_layer):
        _plan_layer(p, il)
    p.plain("output_norm.weight", "model.norm.weight", (H,))
    if hp.attn_res_block_size > 0:
        _plan_res(p, "output_res_score.weight", "model.output_attn_res")
    p.plain("output.weight", "lm_head.weight", (V, H))
    extra = sorted(set(p.by_name) - p.used)
    if extra:
        e = p.by_name[extra[0]]
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ConvertError(f"{e.where}: unexpected tensor for this config{more}")
    return p.specs


# ---------------------------------------------------------------- KVs


def _size_label(specs: list[TensorSpec]) -> str:
    """general.size_label as gguf-py computes it (experts counted once per expert)."""
    total = shared = expert = 0
    expert_sum = n_exp = 0
    for t in specs:
        n = math.prod(t.shape)
        total += n
        if "_exps." in t.name and len(t.shape) >= 3:
            e = t.shape[1 if t.name.endswith(".bias") else 2]
            expert += n // e
            expert_sum += e
            n_exp += 1
        else:
            shared += n
    return size_label(total, shared, expert, expert_sum // n_exp if n_exp else 0)


def _model_kvs(hp: K3HParams, trunk: T, name: str, label: str) -> list[KV]:
    """The non-tokenizer KVs, in the order llama.cpp's converter writes them."""
    a = fmt.ARCH_KIMI_K3
    U32, F32, BOOL, STR, ARR = (GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.BOOL,
                                GGUFValueType.STRING, GGUFValueType.ARRAY)
    LLM, ATT = Keys.LLM, Keys.Attention

    def k(template: str, vtype: GGUFValueType, value: object, item_type: GGUFValueType | None = None) -> KV:
        return kv(template.format(arch=a), vtype, value, item_type)

    file_type = LlamaFileType.MOSTLY_MXFP4_MOE if hp.experts_mxfp4 else _FILE_TYPES[trunk]
    out = [
        k(Keys.General.ARCHITECTURE, STR, a),
        k(Keys.General.TYPE, STR, "model"),
        k(Keys.General.NAME, STR, name),
        k(Keys.General.SIZE_LABEL, STR, label),
        k(LLM.BLOCK_COUNT, U32, hp.n_layer),
        k(LLM.CONTEXT_LENGTH, U32, hp.n_ctx),
        k(LLM.EMBEDDING_LENGTH, U32, hp.hidden_size),
        k(LLM.FEED_FORWARD_LENGTH, U32, hp.n_ff),
        k(ATT.HEAD_COUNT, U32, hp.n_head),
        # 0 marks a KDA layer; MLA is served as MQA over the latent: one kv head
        k(ATT.HEAD_COUNT_KV, ARR, [1 if hp.is_mla(i) else 0 for i in range(hp.n_layer)], GGUFValueType.INT32),
    ]
    if hp.rope_theta is not None:
        out.append(k(Keys.Rope.FREQ_BASE, F32, hp.rope_theta))
    out += [
        k(ATT.LAYERNORM_RMS_EPS, F32, hp.rms_eps),
        k(LLM.EXPERT_COUNT, U32, hp.n_expert),
        k(LLM.EXPERT_USED_COUNT, U32, hp.n_expert_used),
    ]
    if hp.n_group is not None:
        out.append(k(LLM.EXPERT_GROUP_COUNT, U32, hp.n_group))
    if hp.topk_group is not None:
        out.append(k(LLM.EXPERT_GROUP_USED_COUNT, U32, hp.topk_group))
    out += [
        k(LLM.EXPERT_GATING_FUNC, U32, fmt.EXPERT_GATING_SIGMOID),
        k(Keys.General.FILE_TYPE, U32, int(file_type)),
        k(LLM.VOCAB_SIZE, U32, hp.vocab_size),
        k(Keys.SSM.CONV_KERNEL, U32, hp.conv_kernel),
        k(fmt.KEY_KDA_HEAD_DIM, U32, hp.kda_head_dim),
    ]
    if hp.gate_lower_bound is not None:
        out.append(k(fmt.KEY_KDA_GATE_LOWER_BOUND, F32, hp.gate_lower_bound))
    if hp.q_lora_rank is not None:
        out.append(k(ATT.Q_LORA_RANK, U32, hp.q_lora_rank))
    out += [
        k(ATT.KV_LORA_RANK, U32, hp.kv_lora_rank),
        k(Keys.Rope.DIMENSION_COUNT, U32, hp.qk_rope),
        k(ATT.KEY_LENGTH, U32, hp.kv_lora_rank + hp.qk_rope),     # the cache holds the latent
        k(ATT.VALUE_LENGTH, U32, hp.kv_lora_rank),
        k(ATT.KEY_LENGTH_MLA, U32, hp.qk_nope + hp.qk_rope),
        k(ATT.VALUE_LENGTH_MLA, U32, hp.v_head_dim),
        k(LLM.EXPERT_FEED_FORWARD_LENGTH, U32, hp.n_ff_exp),
        k(LLM.EXPERT_SHARED_COUNT, U32, hp.n_shared),
        k(LLM.LEADING_DENSE_BLOCK_COUNT, U32, hp.n_dense_lead),
        k(LLM.EXPERT_WEIGHTS_SCALE, F32, hp.expert_weights_scale),
        k(LLM.EXPERT_WEIGHTS_NORM, BOOL, hp.expert_weights_norm),
    ]
    if hp.latent > 0:
        out.append(k(fmt.KEY_EXPERT_LATENT_LENGTH, U32, hp.latent))
    out += [
        k(fmt.KEY_SITU_BETA, F32, hp.situ_beta),
        k(fmt.KEY_SITU_LINEAR_BETA, F32, hp.situ_linear_beta),
        k(fmt.KEY_ATTN_RES_BLOCK_SIZE, U32, hp.attn_res_block_size),
        k(Keys.General.QUANTIZATION_VERSION, U32, 2),   # GGML_QNT_VERSION
    ]
    return out


# ---------------------------------------------------------------- entry points


def plan_target(model_dir: str | Path, trunk_type: str = "Q8_0", name: str | None = None
                ) -> tuple[list[KV], list[TensorSpec]]:
    """Read and check everything; return the KVs and the (lazy) tensors of the GGUF. `name` is
    general.name (default: the directory's name, which says nothing for a directory called `hf`)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ConvertError(f"{model_dir}: not a directory")
    trunk = TRUNK_TYPES.get(trunk_type.upper())
    if trunk is None:
        raise ConvertError(f"trunk type {trunk_type!r} is not one of {', '.join(TRUNK_TYPES)}")
    cfg_path = model_dir / "config.json"
    hp = parse_hparams(read_json(cfg_path), cfg_path)
    ckpt = Checkpoint(model_dir)
    specs = _plan_tensors(ckpt, hp, trunk)
    vocab = tokenizer_kvs(model_dir, hp.vocab_size, hp.eos_token_id)
    kvs = _model_kvs(hp, trunk, name or model_dir.resolve().name, _size_label(specs)) + vocab
    problems = fmt.check_kv_types(fmt.ARCH_KIMI_K3, {x.key: x for x in kvs})
    problems += fmt.kimi_k3_check_names({t.name for t in specs}, {x.key: x for x in kvs})
    if problems:   # the mapping above is wrong, not the input
        raise AssertionError(f"converted model would not load: {problems[:3]}")
    return kvs, specs


def convert_target(model_dir: str | Path, out: str | Path, trunk_type: str = "Q8_0", *,
                   progress: bool = False, name: str | None = None) -> ConvertResult:
    """Convert the checkpoint in `model_dir` to the GGUF `out` (atomic: all or nothing); `name` is
    general.name (default: the directory's name)."""
    t0 = time.perf_counter()
    out = Path(out)
    if out.is_dir():
        raise ConvertError(f"{out}: is a directory")
    if not out.parent.is_dir():
        raise ConvertError(f"{out.parent}: output directory does not exist")
    kvs, specs = plan_target(model_dir, trunk_type, name)
    total = sum(t.nbytes for t in specs)
    try:
        with byte_progress("convert", total, progress) as bar:
            write_gguf(out, kvs, specs, progress=bar)
    except K3Error:
        raise
    except OSError as e:
        raise ConvertError(f"{out}: {e.strerror or e}") from None
    counts: dict[str, int] = {}
    for t in specs:
        counts[t.ggml_type.name] = counts.get(t.ggml_type.name, 0) + 1
    experts = [t for t in specs if fmt.is_routed_expert(t.name)]
    return ConvertResult(
        output=str(out), source=str(model_dir), trunk_type=trunk_type.upper(), tensors=len(specs),
        kvs=len(kvs), file_bytes=out.stat().st_size, expert_tensors=len(experts),
        expert_bytes=sum(t.nbytes for t in experts), type_counts=dict(sorted(counts.items())),
        seconds=time.perf_counter() - t0)
