"""Factories for small GGUF files: k3kit's writer, and raw hand-built bytes.

The raw builder is deliberately independent of k3kit's writer, so hostile-file tests say
exactly which byte is wrong and do not inherit a writer bug.
"""

from __future__ import annotations

import struct

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from k3kit.gguf.writer import TensorSpec, kv

# ---------------------------------------------------------------- raw bytes


def s(x: str | bytes) -> bytes:
    raw = x.encode() if isinstance(x, str) else x
    return struct.pack("<Q", len(raw)) + raw


def kv_u32(key: str, v: int) -> bytes:
    return s(key) + struct.pack("<II", V.UINT32, v)


def kv_str(key: str, v: str) -> bytes:
    return s(key) + struct.pack("<I", V.STRING) + s(v)


def kv_arr(key: str, item: int, count: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<IIQ", V.ARRAY, item, count) + payload


def tinfo(name: str, dims: tuple[int, ...], ggml_type: int, offset: int) -> bytes:
    return s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) + \
        struct.pack("<IQ", ggml_type, offset)


def raw_gguf(kvs: list[bytes], tensors: list[bytes], data: bytes = b"", *, version: int = 3,
             n_tensors: int | None = None, n_kv: int | None = None, alignment: int = 32,
             magic: bytes = b"GGUF") -> bytes:
    head = magic + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                               len(kvs) if n_kv is None else n_kv)
    head += b"".join(kvs) + b"".join(tensors)
    if tensors:
        head += bytes(-len(head) % alignment)
    return head + data


# ---------------------------------------------------------------- models


def f32_spec(name: str, rows: int, cols: int, seed: int = 0) -> TensorSpec:
    a = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return TensorSpec(name, (cols, rows), Q.F32, a.nbytes, a)


def quant_spec(name: str, shape: tuple[int, ...], qtype: Q, seed: int = 0) -> TensorSpec:
    """Random bytes of a quantized type: the GGUF layer never interprets them."""
    from k3kit.gguf.reader import tensor_nbytes

    n = tensor_nbytes(shape, qtype)
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    return TensorSpec(name, shape, qtype, n, data)


def every_kv_type() -> list:
    return [
        kv("general.architecture", V.STRING, "toy"),
        kv("toy.u8", V.UINT8, 200), kv("toy.i8", V.INT8, -100), kv("toy.u16", V.UINT16, 60000),
        kv("toy.i16", V.INT16, -30000), kv("toy.u32", V.UINT32, 4_000_000_000),
        kv("toy.i32", V.INT32, -2_000_000_000), kv("toy.u64", V.UINT64, 2**63 + 5),
        kv("toy.i64", V.INT64, -(2**62)), kv("toy.f32", V.FLOAT32, 0.5), kv("toy.f64", V.FLOAT64, 1e-300),
        kv("toy.bool", V.BOOL, True), kv("toy.str", V.STRING, "héllo ✓"),
        kv("toy.arr_i32", V.ARRAY, [1, -2, 3], V.INT32), kv("toy.arr_f32", V.ARRAY, [0.25, 2.0], V.FLOAT32),
        kv("toy.arr_bool", V.ARRAY, [True, False], V.BOOL), kv("toy.arr_empty", V.ARRAY, [], V.UINT8),
        kv("tokenizer.ggml.tokens", V.ARRAY, ["<s>", "a", "", "\u00e9\u00e9"], V.STRING),
    ]


K3_KDA_LAYERS = (0, 1, 2)
H = 64  # hidden size: a multiple of 32 so Q8_0/MXFP4 rows are whole blocks


def k3_like_specs(n_layers: int = 4, n_expert: int = 4, seed: int = 0) -> tuple[list, list[TensorSpec]]:
    """A tiny kimi-k3-shaped model: KDA layers 0-2, MLA layer 3, MXFP4 experts, Q8_0 trunk."""
    kvs = [
        kv("general.architecture", V.STRING, "kimi-k3"),
        kv("general.name", V.STRING, "tiny-k3"),
        kv("kimi-k3.block_count", V.UINT32, n_layers),
        kv("kimi-k3.context_length", V.UINT32, 4096),
        kv("kimi-k3.embedding_length", V.UINT32, H),
        kv("kimi-k3.expert_count", V.UINT32, n_expert),
        kv("kimi-k3.expert_used_count", V.UINT32, 2),
        kv("kimi-k3.expert_shared_count", V.UINT32, 1),
        kv("kimi-k3.attention.head_count", V.UINT32, 2),
        kv("kimi-k3.attention.head_count_kv", V.ARRAY,
           [0 if i % 4 != 3 else 1 for i in range(n_layers)], V.UINT32),
        kv("kimi-k3.attention.layer_norm_rms_epsilon", V.FLOAT32, 1e-5),
        kv("tokenizer.ggml.model", V.STRING, "gpt2"),
        kv("tokenizer.ggml.tokens", V.ARRAY, [f"t{i}" for i in range(96)], V.STRING),
    ]
    specs = [quant_spec("token_embd.weight", (H, 96), Q.Q8_0, seed)]
    k = seed
    for i in range(n_layers):
        k += 1
        p = f"blk.{i}."
        specs += [quant_spec(p + "attn_norm.weight", (H,), Q.F32, k),
                  quant_spec(p + "ffn_norm.weight", (H,), Q.F32, k + 1)]
        if i % 4 != 3:
            specs += [quant_spec(p + "attn_q.weight", (H, H), Q.Q8_0, k + 2),
                      quant_spec(p + "ssm_conv1d_q.weight", (4, 1, H), Q.F32, k + 3),
                      quant_spec(p + "ssm_a", (2,), Q.F32, k + 4),
                      quant_spec(p + "attn_output.weight", (H, H), Q.Q8_0, k + 5)]
        else:
            specs += [quant_spec(p + "attn_kv_a_mqa.weight", (H, 96), Q.Q8_0, k + 2),
                      quant_spec(p + "attn_k_b.weight", (32, 64, 2), Q.Q8_0, k + 3),
                      quant_spec(p + "attn_output.weight", (H, H), Q.Q8_0, k + 5)]
        if i == 0:
            specs += [quant_spec(p + "ffn_gate.weight", (H, 128), Q.Q8_0, k + 6),
                      quant_spec(p + "ffn_up.weight", (H, 128), Q.Q8_0, k + 7),
                      quant_spec(p + "ffn_down.weight", (128, H), Q.Q8_0, k + 8)]
        else:
            specs += [quant_spec(p + "ffn_gate_inp.weight", (H, n_expert), Q.F32, k + 6),
                      quant_spec(p + "exp_probs_b.bias", (n_expert,), Q.F32, k + 7),
                      quant_spec(p + "ffn_gate_exps.weight", (H, 96, n_expert), Q.MXFP4, k + 8),
                      quant_spec(p + "ffn_up_exps.weight", (H, 96, n_expert), Q.MXFP4, k + 9),
                      quant_spec(p + "ffn_down_exps.weight", (96, H, n_expert), Q.MXFP4, k + 10),
                      quant_spec(p + "ffn_gate_shexp.weight", (H, 96), Q.Q8_0, k + 11),
                      quant_spec(p + "ffn_down_shexp.weight", (96, H), Q.Q8_0, k + 12)]
    specs += [quant_spec("output_norm.weight", (H,), Q.F32, k + 20),
              quant_spec("output.weight", (H, 96), Q.Q8_0, k + 21)]
    return kvs, specs


