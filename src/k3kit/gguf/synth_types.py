"""The ggml types of a synthetic kimi-k3 model: which routed-expert and trunk types can be asked
for, the general.file_type each mix is named by, and applying a mix to the tensor list.

Kept apart from the geometry (k3kit.gguf.synth_geometry, which lays out the tensors in the
converter's default types) because a mix is a choice made per file on top of a layout: `synth
--expert-type IQ2_XXS --trunk-type Q4_K` gives the tensor types of the published low-bit files,
and `Types.file_type` names the file the way llama-quantize would.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from k3kit.errors import K3Error
from k3kit.gguf import format as fmt

Q8_0 = GGMLQuantizationType.Q8_0
MXFP4 = GGMLQuantizationType.MXFP4
F32 = GGMLQuantizationType.F32
F16 = GGMLQuantizationType.F16
BF16 = GGMLQuantizationType.BF16

Shape = tuple[int, ...]
TensorList = list[tuple[str, Shape, GGMLQuantizationType]]


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
