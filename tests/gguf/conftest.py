"""Fixtures for the GGUF tests: small files from k3kit's writer and from gguf-py's GGUFWriter.

The factory functions live in gguf_factories.py so test modules can import them by a name
no other test directory uses.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf_factories import every_kv_type, f32_spec, k3_like_specs, quant_spec

from k3kit.gguf.writer import write_gguf, write_model


@pytest.fixture
def small_gguf(tmp_path: Path) -> Path:
    """One file: every KV type, an F32 and a Q8_0 tensor, written by k3kit."""
    p = tmp_path / "small.gguf"
    write_gguf(p, every_kv_type(), [f32_spec("a.weight", 3, 32), quant_spec("b.weight", (64, 2), Q.Q8_0)])
    return p


@pytest.fixture
def k3_model(tmp_path: Path) -> Path:
    kvs, specs = k3_like_specs()
    return write_model(tmp_path / "k3.gguf", kvs, specs)[0]


@pytest.fixture
def k3_sharded(tmp_path: Path) -> list[Path]:
    kvs, specs = k3_like_specs()
    return write_model(tmp_path / "k3s.gguf", kvs, specs, max_shard_bytes=60_000)


@pytest.fixture
def gguf_py_file(tmp_path: Path) -> Path:
    """A file written by gguf-py's GGUFWriter (the other writer k3kit must read)."""
    p = tmp_path / "py.gguf"
    w = gguf.GGUFWriter(p, "llama")
    w.add_block_count(2)
    w.add_array("llama.some_array", [1, 2, 3])
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_token_list(["a", "b", "c"])
    w.add_tensor("x.weight", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.add_tensor("y.weight", np.ones((3, 32), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return p
