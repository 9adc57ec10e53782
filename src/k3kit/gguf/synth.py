"""Random kimi-k3 GGUFs with real K3 geometry, written at disk speed.

Everything that reads, rewrites or serves a 1.4 TB model needs test inputs with the real
shapes, names, types and shard layout, and nobody can download the real one in CI. A
synthetic model has the exact tensor set llama.cpp's kimi-k3 loader creates (fewer layers
and experts, optionally a smaller vocab), so llama.cpp loads it and runs a finite forward.

Random bytes are generated directly in the quantized block layout (Q8_0: fp16 scale +
int8; MXFP4: E8M0 exponent + e2m1 nibbles) into one pool per type, created once; each
tensor is its pool read from a seed- and name-dependent offset, repeated, in chunks. Writing is a
memory-to-disk copy: no float generation, no quantization, no per-tensor Python work.
Scales are small so activations stay finite through the forward pass.

The types of the published low-bit K3 files can be asked for: routed experts in any of
EXPERT_TYPES (gate/up and down separately, e.g. IQ2_XXS + IQ3_XXS like UD-IQ1_S), trunk
matrices in any of TRUNK_TYPES; their blocks come from synth_blocks (random codes, scales
chosen for the same weight size). Like the published files, the first shard can hold only
metadata (`metadata_shard`). A `sparse` model has exact headers and a data region that is a
hole: full size, (almost) no disk blocks, so the full 1.4 TB K3 geometry can be inspected or
planned on any machine. Holes read as zeros, which every block type decodes to 0.0.
"""

from __future__ import annotations

import os
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, Keys, LlamaFileType, TokenType

from k3kit._io import fsync_dir, fsync_file, temp_path
from k3kit.errors import K3Error
from k3kit.gguf import format as fmt
from k3kit.gguf import synth_blocks
from k3kit.gguf.reader import KV, align_up, tensor_nbytes
from k3kit.gguf.shards import SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS_COUNT
from k3kit.gguf.writer import TensorSpec, header_bytes, kv, output_paths, write_gguf, write_model
from k3kit.progress import ByteProgress, byte_progress

Q8_0 = GGMLQuantizationType.Q8_0
MXFP4 = GGMLQuantizationType.MXFP4
F32 = GGMLQuantizationType.F32
F16 = GGMLQuantizationType.F16
BF16 = GGMLQuantizationType.BF16
U16 = GGUFValueType.UINT16
U32 = GGUFValueType.UINT32
I32 = GGUFValueType.INT32
F32V = GGUFValueType.FLOAT32
STR = GGUFValueType.STRING
ARR = GGUFValueType.ARRAY

ALIGNMENT = 32
MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS
MAX_EXPERTS = 4096
MIN_VOCAB = 512
MAX_VOCAB = 1 << 20


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


# ---------------------------------------------------------------- tokenizer


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, so byte-level BPE tokens are valid strings."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


@dataclass(frozen=True)
class Vocab:
    tokens: list[str]
    token_types: np.ndarray  # int32
    merges: list[str]
    bos: int
    eos: int


def make_vocab(n_vocab: int) -> Vocab:
    """A byte-level BPE vocab of exactly n_vocab tokens that llama.cpp's gpt2 tokenizer accepts.

    ids 0-255: the 256 byte tokens (every text tokenizes); then two-character merges over
    lowercase letters and space (so merging is exercised); then unused fillers; the last R
    ids are control tokens with [BOS] and [EOS] first (R = 256, as K2/K3's 163584.. block).
    """
    if not MIN_VOCAB <= n_vocab <= MAX_VOCAB:
        raise K3Error(f"--vocab {n_vocab}: must be between {MIN_VOCAB} and {MAX_VOCAB}")
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    n_reserved = 256 if n_vocab >= 4096 else 16
    alphabet = [b2u[ord(" ")]] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    room = n_vocab - 256 - n_reserved
    merges = [f"{a} {b}" for a in alphabet for b in alphabet][:room]
    tokens += [m.replace(" ", "") for m in merges]
    n_fill = n_vocab - n_reserved - len(tokens)
    tokens += [f"<|k3kit_unused_{i}|>" for i in range(n_fill)]
    first = len(tokens)
    tokens += ["[BOS]", "[EOS]"] + [f"<|reserved_token_{i}|>" for i in range(2, n_reserved)]
    types = np.full(n_vocab, int(TokenType.NORMAL), dtype=np.int32)
    types[256 + len(merges):first] = int(TokenType.UNUSED)
    types[first:] = int(TokenType.CONTROL)
    assert len(tokens) == n_vocab and len(set(tokens)) == n_vocab
    return Vocab(tokens, types, merges, bos=first, eos=first + 1)


# ---------------------------------------------------------------- random block pools


POOL_BYTES = 16 << 20
F32_POOL_BYTES = 4 << 20


class Pools:
    """One pool of valid random blocks per type; every tensor is a window into it, repeated.

    Each pool (at most POOL_BYTES of random blocks) is kept twice over, so a pool-sized window
    at any block offset is contiguous. A tensor is the pool read from a seed- and name-dependent
    offset and repeated until it is long enough, handed to the writer in pool-sized chunks:
    memory stays at two pools per type whatever the size of the model.
    """

    def __init__(self, seed: int, largest: dict[GGMLQuantizationType, int] | None = None) -> None:
        self.seed = seed
        self._largest = largest or {}
        self._doubled: dict[GGMLQuantizationType, np.ndarray] = {}

    def _pool(self, qtype: GGMLQuantizationType) -> np.ndarray:
        """Random blocks: the cap in bytes, or less for small models (the largest tensor fits)."""
        if qtype not in (Q8_0, MXFP4, F32, F16, BF16) and qtype not in synth_blocks.GENERATORS:
            raise ValueError(f"no random pool for {qtype.name}")
        _, block_bytes = GGML_QUANT_SIZES[qtype]
        cap = F32_POOL_BYTES if qtype == F32 else POOL_BYTES
        size = max(1, -(-min(cap, self._largest.get(qtype, cap)) // block_bytes)) * block_bytes
        rng = np.random.default_rng([self.seed, int(qtype)])
        if qtype == F32:
            return rng.normal(0.0, 0.02, size // 4).astype(np.float32).view(np.uint8)
        if qtype in (F16, BF16):
            return _float16_pool(rng, size // 2, qtype)
        if qtype in synth_blocks.GENERATORS:
            return synth_blocks.random_blocks(qtype, size // block_bytes, rng).reshape(-1)
        # raw generator output is ~5x faster than rng.bytes; any bytes are valid int8 / nibbles
        pool = rng.bit_generator.random_raw(-(-size // 8)).view(np.uint8)[:size].copy()
        if qtype == Q8_0:
            # d ~ 1e-4..2e-4: |w| <= 0.025, std ~ 0.011 ~ 1/sqrt(7168)
            blocks = pool.reshape(-1, 34)
            d = rng.uniform(1e-4, 2e-4, len(blocks)).astype(np.float16)
            blocks[:, :2] = d.view(np.uint8).reshape(-1, 2)
        else:
            # E8M0 118..120: 2^-9..2^-7 times e2m1 values up to 6: |w| <= 0.047, std ~ 0.01
            blocks = pool.reshape(-1, 17)
            blocks[:, 0] = rng.integers(118, 121, len(blocks), dtype=np.uint8)
        return pool

    def doubled(self, qtype: GGMLQuantizationType) -> np.ndarray:
        """The pool of qtype laid out twice (built on first use)."""
        got = self._doubled.get(qtype)
        if got is None:
            pool = self._pool(qtype)
            got = self._doubled[qtype] = np.concatenate([pool, pool])
        return got

    def window(self, qtype: GGMLQuantizationType, name: str, nbytes: int) -> Iterator[np.ndarray]:
        """The tensor's bytes as pool-sized chunks (zero-copy views)."""
        buf = self.doubled(qtype)
        size = len(buf) // 2
        _, block_bytes = GGML_QUANT_SIZES[qtype]
        off = (zlib.crc32(name.encode()) ^ (self.seed * 0x9E3779B1)) % (size // block_bytes) * block_bytes
        for start in range(0, nbytes, size):
            yield buf[off:off + min(size, nbytes - start)]


def _float16_pool(rng: np.random.Generator, n: int, qtype: GGMLQuantizationType) -> np.ndarray:
    """n normal(0, 0.02) weights (the F32 pool's) as F16, or as BF16 rounded to nearest even."""
    x = rng.normal(0.0, 0.02, n).astype(np.float32)
    if qtype == F16:
        return x.astype(np.float16).view(np.uint8)
    u = x.view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16).view(np.uint8)


def _small_rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


# ---------------------------------------------------------------- types


def _types(*names: str) -> tuple[GGMLQuantizationType, ...]:
    return tuple(GGMLQuantizationType[n] for n in names)


# The routed-expert types of published K3 files and llama-quantize's mixes; the trunk types
# people run (the converter's Q8_0, `k3kit requant`'s Q4_K, and the float types).
EXPERT_TYPES = _types("MXFP4", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
                      "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "TQ1_0", "TQ2_0")
TRUNK_TYPES = _types("Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "F32")

LFT = LlamaFileType
# general.file_type of a file whose routed experts are of the key type: the llama-quantize mix
# that has it as default type (IQ2_S is IQ2_M's; IQ2_S-the-mix uses IQ2_XS). File types name
# the experts because they are ~96% of K3's bytes, as "UD-IQ1_S" names a Q8_0-trunk file.
_FTYPE_OF_EXPERTS: dict[GGMLQuantizationType, LlamaFileType] = {
    GGMLQuantizationType.IQ1_S: LFT.MOSTLY_IQ1_S, GGMLQuantizationType.IQ1_M: LFT.MOSTLY_IQ1_M,
    GGMLQuantizationType.IQ2_XXS: LFT.MOSTLY_IQ2_XXS, GGMLQuantizationType.IQ2_XS: LFT.MOSTLY_IQ2_XS,
    GGMLQuantizationType.IQ2_S: LFT.MOSTLY_IQ2_M, GGMLQuantizationType.IQ3_XXS: LFT.MOSTLY_IQ3_XXS,
    GGMLQuantizationType.IQ3_S: LFT.MOSTLY_IQ3_S, GGMLQuantizationType.Q2_K: LFT.MOSTLY_Q2_K,
    GGMLQuantizationType.Q3_K: LFT.MOSTLY_Q3_K_S, GGMLQuantizationType.Q4_K: LFT.MOSTLY_Q4_K_S,
    GGMLQuantizationType.Q5_K: LFT.MOSTLY_Q5_K_S, GGMLQuantizationType.Q6_K: LFT.MOSTLY_Q6_K,
    Q8_0: LFT.MOSTLY_Q8_0, GGMLQuantizationType.TQ1_0: LFT.MOSTLY_TQ1_0,
    GGMLQuantizationType.TQ2_0: LFT.MOSTLY_TQ2_0,
}
# With the QAT MXFP4 experts kept, the trunk decides: MXFP4_MOE is llama.cpp's name for MXFP4
# experts + Q8_0 rest; a requantized trunk gets what `k3kit requant` writes for it.
_FTYPE_OF_TRUNK: dict[GGMLQuantizationType, LlamaFileType] = {
    Q8_0: LFT.MOSTLY_MXFP4_MOE, GGMLQuantizationType.Q4_K: LFT.MOSTLY_Q4_K_S,
    GGMLQuantizationType.Q5_K: LFT.MOSTLY_Q5_K_S, GGMLQuantizationType.Q6_K: LFT.MOSTLY_Q6_K,
    F16: LFT.MOSTLY_F16, BF16: LFT.MOSTLY_BF16, F32: LFT.ALL_F32,
}


@dataclass(frozen=True)
class Types:
    """ggml types of the routed experts (gate/up, down) and of the trunk matrices."""

    expert: GGMLQuantizationType = MXFP4
    expert_down: GGMLQuantizationType = MXFP4
    trunk: GGMLQuantizationType = Q8_0

    @property
    def file_type(self) -> int:
        """general.file_type for this mix (see _FTYPE_OF_EXPERTS and _FTYPE_OF_TRUNK)."""
        if self.expert != MXFP4:
            return int(_FTYPE_OF_EXPERTS[self.expert])
        return int(_FTYPE_OF_TRUNK[self.trunk])

    def suffix(self) -> str:
        """"" for the default mix, else e.g. "-IQ2_XXS-IQ3_XXS-Q4_K" (for default file names)."""
        if self == Types():
            return ""
        names = [self.expert.name] + ([self.expert_down.name] if self.expert_down != self.expert else [])
        return "-" + "-".join([*names, self.trunk.name])


def _one_type(value: str | GGMLQuantizationType | None, allowed: tuple[GGMLQuantizationType, ...],
              flag: str, default: GGMLQuantizationType) -> GGMLQuantizationType:
    if value is None:
        return default
    if isinstance(value, GGMLQuantizationType):
        qtype: GGMLQuantizationType | None = value
    else:
        qtype = GGMLQuantizationType.__members__.get(str(value).upper())
    if qtype not in allowed:
        raise K3Error(f"{flag} {getattr(value, 'name', value)}: expected one of "
                      f"{', '.join(t.name for t in allowed)}")
    return qtype


def types_for(expert: str | GGMLQuantizationType | None = None,
              expert_down: str | GGMLQuantizationType | None = None,
              trunk: str | GGMLQuantizationType | None = None) -> Types:
    """Checked Types from names (None: MXFP4 experts, down like gate/up, Q8_0 trunk)."""
    e = _one_type(expert, EXPERT_TYPES, "--expert-type", MXFP4)
    return Types(e, _one_type(expert_down, EXPERT_TYPES, "--expert-type-down", e),
                 _one_type(trunk, TRUNK_TYPES, "--trunk-type", Q8_0))


def apply_types(shapes: TensorList, types: Types, geometry: str = "") -> tuple[TensorList, list[str]]:
    """`shapes` with routed experts and trunk matrices in `types`, and the trunk matrices kept Q8_0.

    Routed gate/up take types.expert, down types.expert_down; experts whose rows are not a
    multiple of the type's block are an error (mini's are 128 / 96 wide: use mini256 or k3).
    Trunk matrices are the ones `k3kit requant` converts: format.is_trunk_matrix except
    token_embd and output, which stay Q8_0 as requant keeps them. A trunk matrix whose rows do
    not fit the type's block (K3's attn_k_b and ssm_f_b rows are 128 wide) stays Q8_0, as
    requant leaves it, so `synth --trunk-type T` has the tensor types of synth + requant to T.
    """
    out: TensorList = []
    kept: list[str] = []
    for name, shape, qtype in shapes:
        if fmt.is_routed_expert(name):
            qtype = types.expert_down if f".{fmt.FFN_DOWN_EXPS}." in name else types.expert
            block = GGML_QUANT_SIZES[qtype][0]
            if shape[0] % block:
                where = f" of geometry {geometry}" if geometry else ""
                raise K3Error(f"{qtype.name} experts need rows that are a multiple of {block}; "
                              f"'{name}'{where} has rows of {shape[0]} (use --geometry mini256 or k3)")
        elif (qtype == Q8_0 and types.trunk != Q8_0 and fmt.is_trunk_matrix(name, len(shape))
              and fmt.role_of(name, len(shape)) != fmt.ROLE_EMBEDDINGS_OUTPUT):
            if shape[0] % GGML_QUANT_SIZES[types.trunk][0]:
                kept.append(name)
            else:
                qtype = types.trunk
        out.append((name, shape, qtype))
    return out, kept


# ---------------------------------------------------------------- the plan


@dataclass
class SynthPlan:
    """Everything that will be written: KVs, tensor specs (lazy sources), the shard layout."""

    geometry: Geometry
    n_layers: int
    n_experts: int
    mla_layers: list[int]
    kv: list[KV]
    tensors: list[TensorSpec]
    layout: list[list[str]]  # with a metadata shard, layout[0] is empty
    types: Types = field(default_factory=Types)
    trunk_kept_q8_0: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def _geometry_for(geometry: Geometry | str, vocab: int | None) -> Geometry:
    if isinstance(geometry, str):
        if geometry not in GEOMETRIES:
            raise K3Error(f"--geometry {geometry}: expected one of {', '.join(GEOMETRIES)}")
        geometry = GEOMETRIES[geometry]
    if vocab is not None:
        geometry = replace(geometry, vocab=vocab)
    return geometry


def _check_counts(n_layers: int, n_experts: int, shards: int, seed: int) -> None:
    if not 2 <= n_layers <= MAX_LAYERS:
        raise K3Error(f"--layers {n_layers}: need 2..{MAX_LAYERS} (at least one KDA and one MLA layer)")
    if not 1 <= n_experts <= MAX_EXPERTS:
        raise K3Error(f"--experts {n_experts}: need 1..{MAX_EXPERTS}")
    if not 1 <= shards <= 0xFFFF:
        raise K3Error(f"--shards {shards}: need 1..65535")
    if not 0 <= seed < 2**63:
        raise K3Error(f"--seed {seed}: need 0 <= seed < 2**63")


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


Shape = tuple[int, ...]
TensorList = list[tuple[str, Shape, GGMLQuantizationType]]


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


def _f32_values(name: str, n: int, seed: int) -> np.ndarray | None:
    """Values for F32 tensors whose meaning needs a sane range; None = small random from the pool."""
    if name.endswith(("_norm.weight",)):
        return np.ones(n, dtype=np.float32)
    rng = _small_rng(seed, name)
    if name.endswith(".ssm_a"):
        # the converter stores -exp(A_log); A_log ~ U(0, ln 16) like Mamba/KDA initialisation
        return -np.exp(rng.uniform(0.0, np.log(16.0), n)).astype(np.float32)
    if name.endswith(".ssm_dt.bias"):
        return rng.uniform(-0.5, 0.5, n).astype(np.float32)
    if name.endswith(".exp_probs_b.bias"):
        return rng.normal(0.0, 0.01, n).astype(np.float32)
    if name.endswith("res_score.weight"):
        return rng.normal(0.0, 0.05, n).astype(np.float32)
    return None


def _source(pools: Pools, name: str, qtype: GGMLQuantizationType, nbytes: int, n_elem: int,
            seed: int) -> Callable[[], np.ndarray | Iterator[np.ndarray]]:
    if qtype == F32:
        def make() -> np.ndarray | Iterator[np.ndarray]:
            vals = _f32_values(name, n_elem, seed)
            return vals.view(np.uint8) if vals is not None else pools.window(F32, name, nbytes)
        return make
    return lambda: pools.window(qtype, name, nbytes)


def balanced_layout(names: list[str], sizes: list[int], shards: int) -> list[list[str]]:
    """Split tensors (in order) into `shards` non-empty groups of roughly equal bytes.

    Each tensor goes to the shard its byte midpoint falls in, then the assignment is clamped
    so it never skips a shard and leaves enough tensors for the shards after it.
    """
    n = len(names)
    if shards > n:
        raise K3Error(f"--shards {shards}: the model has only {n} tensors")
    total = sum(sizes)
    groups: list[list[str]] = [[] for _ in range(shards)]
    cum, prev = 0, 0
    for j, (name, size) in enumerate(zip(names, sizes, strict=True)):
        mid = cum + size / 2
        s = min(int(mid * shards / total) if total else 0, shards - 1)
        s = min(max(s, prev), prev + 1 if j else 0)
        s = max(s, shards - (n - j))
        groups[s].append(name)
        cum += size
        prev = s
    return groups


def plan(geometry: Geometry | str, n_layers: int, n_experts: int, *, vocab: int | None = None,
         shards: int = 1, seed: int = 0, name: str | None = None, types: Types | None = None,
         metadata_shard: bool = False) -> SynthPlan:
    """The KVs, tensor specs and shard layout of a synthetic kimi-k3 model (nothing is generated yet).

    With metadata_shard, `shards` counts the first file, which holds the KVs and no tensors
    (as split.count does), and the tensors are balanced over the other shards - 1.
    """
    _check_counts(n_layers, n_experts, shards, seed)
    if metadata_shard and shards < 2:
        raise K3Error(f"--metadata-shard needs --shards >= 2 (the first shard holds no tensors), "
                      f"got {shards}")
    types = types or Types()
    g = _geometry_for(geometry, vocab)
    name = name or default_name(g, n_layers, n_experts, types)
    voc = make_vocab(g.vocab)
    kvs = build_kv(g, n_layers, n_experts, name, voc, file_type=types.file_type)
    shapes, kept = apply_types(tensor_shapes(g, n_layers, n_experts), types, g.name)
    largest: dict[GGMLQuantizationType, int] = {}
    for _, shape, qtype in shapes:
        largest[qtype] = max(largest.get(qtype, 0), tensor_nbytes(shape, qtype))
    pools = Pools(seed, largest)
    specs = []
    for tname, shape, qtype in shapes:
        nbytes = tensor_nbytes(shape, qtype)
        n_elem = int(np.prod(shape))
        source = _source(pools, tname, qtype, nbytes, n_elem, seed)
        specs.append(TensorSpec(tname, shape, qtype, nbytes, source))
    sizes = [align_up(t.nbytes, ALIGNMENT) for t in specs]
    if metadata_shard:
        layout = [[], *balanced_layout([t.name for t in specs], sizes, shards - 1)]
    else:
        layout = balanced_layout([t.name for t in specs], sizes, shards)
    return SynthPlan(g, n_layers, n_experts, mla_layers(n_layers, g.mla_every), kvs, specs, layout,
                     types, kept)


def default_name(g: Geometry, n_layers: int, n_experts: int, types: Types | None = None) -> str:
    return f"kimi-k3-synth-{g.name}-{n_layers}L-{n_experts}E{(types or Types()).suffix()}"


@dataclass
class SynthResult:
    """What `k3kit synth` made; printed for people or as --json."""

    paths: list[str]
    geometry: str
    layers: int
    experts: int
    mla_layers: list[int]
    vocab: int
    tensors: int
    tensor_bytes: int
    file_bytes: int
    seconds: float
    gb_per_s: float
    expert_type: str = "MXFP4"
    expert_type_down: str = "MXFP4"
    trunk_type: str = "Q8_0"
    file_type: int = int(LlamaFileType.MOSTLY_MXFP4_MOE)
    trunk_kept_q8_0: int = 0  # trunk matrices whose rows do not fit trunk_type's block
    metadata_shard: bool = False
    sparse: bool = False
    disk_bytes: int = 0  # blocks the files occupy (st_blocks); ~header bytes when sparse

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _shard_jobs(p: SynthPlan, out: Path) -> list[tuple[Path, list[KV], list[TensorSpec]]]:
    """(path, KVs, tensors) of every file: write_model's split convention, empty groups kept.

    Shard 1 has every KV, all shards have split.no / split.count / split.tensors.count; a
    metadata shard is simply a first group without tensors.
    """
    by_name = {t.name: t for t in p.tensors}
    groups = [[by_name[n] for n in names] for names in p.layout]
    paths = output_paths(out, len(groups))
    if len(groups) == 1:
        return [(paths[0], list(p.kv), groups[0])]
    jobs = []
    for i, (path, group) in enumerate(zip(paths, groups, strict=True)):
        split = [kv(SPLIT_NO, U16, i), kv(SPLIT_COUNT, U16, len(groups)),
                 kv(SPLIT_TENSORS_COUNT, I32, len(p.tensors))]
        jobs.append((path, (list(p.kv) if i == 0 else []) + split, group))
    return jobs


def _write_sparse(path: Path, kvs: list[KV], tensors: list[TensorSpec]) -> None:
    """The exact header, then the data region as a hole: ftruncate to the full size."""
    header = header_bytes(kvs, tensors, ALIGNMENT)
    size = len(header) + sum(align_up(t.nbytes, ALIGNMENT) for t in tensors)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(header)
        while view:
            view = view[os.write(fd, view):]
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def _write_files(jobs: list[tuple[Path, list[KV], list[TensorSpec]]], *, sparse: bool,
                 progress: ByteProgress | None) -> None:
    """Every file under a temporary name, then all renamed: the set appears complete or not at all."""
    temps = [temp_path(path) for path, _, _ in jobs]
    try:
        for tmp, (_, kvs, tensors) in zip(temps, jobs, strict=True):
            if sparse:
                _write_sparse(tmp, kvs, tensors)
                fsync_file(tmp)
            else:
                write_gguf(tmp, kvs, tensors, alignment=ALIGNMENT, progress=progress)
        for tmp, (path, _, _) in zip(temps, jobs, strict=True):
            os.replace(tmp, path)
    except BaseException:
        for tmp in temps:
            tmp.unlink(missing_ok=True)
        raise
    fsync_dir(jobs[0][0].parent)


def synthesize(out_dir: str | Path, geometry: Geometry | str, n_layers: int, n_experts: int, *,
               vocab: int | None = None, shards: int = 1, seed: int = 0, name: str | None = None,
               progress: bool = True, expert_type: str | GGMLQuantizationType | None = None,
               expert_type_down: str | GGMLQuantizationType | None = None,
               trunk_type: str | GGMLQuantizationType | None = None, metadata_shard: bool = False,
               sparse: bool = False) -> SynthResult:
    """Write a synthetic kimi-k3 model into out_dir (as NAME.gguf or NAME-0000K-of-0000N.gguf).

    expert_type / expert_type_down / trunk_type: see apply_types (defaults: MXFP4 experts,
    Q8_0 trunk). metadata_shard: shard 1 holds only the KVs (needs shards >= 2). sparse: exact
    headers, data left as a hole (no tensor bytes are generated or written).
    """
    if name is not None and (not name or "/" in name or "\0" in name or name.startswith(".")):
        raise K3Error(f"--name {name!r}: must be a plain file name")
    types = types_for(expert_type, expert_type_down, trunk_type)
    p = plan(geometry, n_layers, n_experts, vocab=vocab, shards=shards, seed=seed, name=name, types=types,
             metadata_shard=metadata_shard)
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise K3Error(f"{out_dir}: exists and is not a directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{name or default_name(p.geometry, n_layers, n_experts, types)}.gguf"
    t0 = time.perf_counter()
    if sparse or metadata_shard:
        jobs = _shard_jobs(p, out)
        with byte_progress("synth", p.nbytes, enabled=progress and not sparse) as bar:
            _write_files(jobs, sparse=sparse, progress=bar)
        paths = [path for path, _, _ in jobs]
    else:
        with byte_progress("synth", p.nbytes, enabled=progress) as bar:
            paths = write_model(out, p.kv, p.tensors, layout=p.layout, alignment=ALIGNMENT, progress=bar)
    dt = time.perf_counter() - t0
    stats = [q.stat() for q in paths]
    file_bytes = sum(st.st_size for st in stats)
    return SynthResult(
        paths=[str(q) for q in paths], geometry=p.geometry.name, layers=n_layers, experts=n_experts,
        mla_layers=p.mla_layers, vocab=p.geometry.vocab, tensors=len(p.tensors), tensor_bytes=p.nbytes,
        file_bytes=file_bytes, seconds=round(dt, 3), gb_per_s=round(file_bytes / dt / 1e9, 3) if dt else 0.0,
        expert_type=types.expert.name, expert_type_down=types.expert_down.name, trunk_type=types.trunk.name,
        file_type=types.file_type, trunk_kept_q8_0=len(p.trunk_kept_q8_0), metadata_shard=metadata_shard,
        sparse=sparse, disk_bytes=sum(st.st_blocks * 512 for st in stats),
    )


__all__ = ["Geometry", "K3", "MINI", "MINI256", "GEOMETRIES", "SynthPlan", "SynthResult", "Pools", "Vocab",
           "Types", "EXPERT_TYPES", "TRUNK_TYPES", "types_for", "apply_types", "make_vocab", "mla_layers",
           "tensor_shapes", "build_kv", "balanced_layout", "plan", "synthesize"]
