"""Fuzz the header parser: any mutation of a valid file parses or raises FormatError, nothing else."""

from __future__ import annotations

import struct

import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from gguf_factories import kv_arr, kv_str, kv_u32, raw_gguf, s, tinfo
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3kit.errors import FormatError
from k3kit.gguf.reader import GGUFFile

BASE = raw_gguf(
    [kv_str("general.architecture", "x"), kv_u32("x.block_count", 2),
     kv_arr("tokenizer.ggml.tokens", V.STRING, 3, s("a") + s("bc") + s("")),
     kv_arr("x.scores", V.FLOAT32, 2, struct.pack("<ff", 1.0, 2.0))],
    [tinfo("a.weight", (32, 2), Q.Q8_0, 0), tinfo("b.weight", (8,), Q.F32, 96)],
    bytes(range(128)),
)
HUGE = st.sampled_from([2**64 - 1, 2**63, 2**62 + 7, 2**40, 2**32, 2**32 - 1, 2**31, 10**9, 65536, 33])

mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, len(BASE) - 1), st.integers(1, 255)),
    st.tuples(st.just("u64"), st.integers(0, len(BASE) - 8), HUGE),
    st.tuples(st.just("u32"), st.integers(0, len(BASE) - 4), HUGE.map(lambda v: v % 2**32)),
    st.tuples(st.just("cut"), st.integers(0, len(BASE) - 1), st.just(0)),
)


def mutate(data: bytes, ops) -> bytes:
    b = bytearray(data)
    for op, pos, val in ops:
        if op == "flip" and pos < len(b):
            b[pos] ^= val
        elif op == "u64" and pos + 8 <= len(b):
            b[pos:pos + 8] = struct.pack("<Q", val)
        elif op == "u32" and pos + 4 <= len(b):
            b[pos:pos + 4] = struct.pack("<I", val)
        elif op == "cut":
            del b[pos:]
    return bytes(b)


@pytest.fixture(scope="module")
def fuzz_path(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("fuzz") / "fuzz.gguf")


def test_base_is_valid(fuzz_path):
    with open(fuzz_path, "wb") as f:
        f.write(BASE)
    g = GGUFFile.open(fuzz_path)
    assert [t.name for t in g.tensors] == ["a.weight", "b.weight"]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(mutation, min_size=1, max_size=4))
def test_mutated_header_parses_or_raises_format_error(fuzz_path, ops):
    data = mutate(BASE, ops)
    with open(fuzz_path, "wb") as f:
        f.write(data)
    try:
        g = GGUFFile.open(fuzz_path)
    except FormatError as e:
        assert str(e).startswith(f"{fuzz_path}: ")
        return
    # A file that parses describes only bytes that exist, without overlap.
    spans = sorted((t.offset, t.offset + t.nbytes) for t in g.tensors)
    for (_, a1), (b0, _) in zip(spans, spans[1:], strict=False):
        assert a1 <= b0
    for t in g.tensors:
        assert t.offset % g.alignment == 0 or (t.offset - g.data_offset) % g.alignment == 0
        assert len(g.view(t)) == t.nbytes <= len(data) - t.offset
    g.close()
