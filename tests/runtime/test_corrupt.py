"""A corrupt trunk gives one line naming the file and the tensor, never garbage text.

A synthetic mini K3 file (`k3kit synth --geometry mini`) is corrupted the ways a bad download
or a bad converter would: a Q8_0 block scale set to NaN (in a matrix, and in token_embd), an
MXFP4 block exponent of 0xFF over a large nibble (the block decodes to inf), and tensors of a
type the engine has no dequantizer for (I32 instead of F32, Q8_1). `k3kit generate` must exit
with code 2 and print exactly one line on stderr that names the file, the tensor and (for a
corrupt block) the block, with no traceback and no generated text, with the quantized trunk
(the default: the check runs before the tensor's first product) and with `--trunk float`
(checked at load, where the tensor is dequantized).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from k3kit.cli import main
from k3kit.gguf import quants
from k3kit.gguf.reader import GGUFFile
from k3kit.gguf.synth import synthesize
from k3kit.gguf.writer import FileRange, TensorSpec, write_gguf

MATRIX = "blk.1.attn_q_a.weight"      # a Q8_0 trunk matrix every forward multiplies by
NAN_F16 = bytes([0x00, 0x7E])


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corrupt")
    return Path(synthesize(d, "mini", 2, 4, progress=False, name="mini").paths[0])


def _patched(src: Path, dst: Path, name: str, at: int, data: bytes) -> Path:
    """A copy of `src` with `data` written at byte `at` of tensor `name`'s data."""
    info = next(t for t in GGUFFile.open(src).tensors if t.name == name)
    assert at + len(data) <= info.nbytes
    shutil.copyfile(src, dst)
    with open(dst, "r+b") as f:
        f.seek(info.offset + at)
        f.write(data)
    return dst


def _retyped(src: Path, dst: Path, name: str, qtype: T, raw: np.ndarray | None = None) -> Path:
    """A copy of `src` whose tensor `name` has type `qtype` (bytes `raw`, or its own if they fit)."""
    f = GGUFFile.open(src)
    specs = []
    for t in f.tensors:
        if t.name == name:
            data = raw if raw is not None else np.fromfile(src, np.uint8, t.nbytes, offset=t.offset)
            specs.append(TensorSpec(t.name, t.shape, qtype, data.size, data))
        else:
            specs.append(TensorSpec(t.name, t.shape, t.ggml_type, t.nbytes,
                                    FileRange(src, t.offset, t.nbytes)))
    return write_gguf(dst, f.kv.values(), specs, alignment=f.alignment)


def _generate(path: Path, capsys, *extra: str) -> tuple[int, str, list[str]]:
    rc = main(["generate", str(path), "--prompt", "ab", "--max-tokens", "4", "--threads", "1", *extra])
    out, err = capsys.readouterr()
    return rc, out, err.strip().splitlines()


def _one_line(rc: int, out: str, err: list[str], *parts: str) -> str:
    assert rc == 2 and out == "", (rc, out, err)
    assert len(err) == 1 and err[0].startswith("k3kit: error: "), err
    assert all(p in err[0] for p in parts), (err[0], parts)
    return err[0]


def test_clean_file_generates(clean, capsys):
    rc, out, err = _generate(clean, capsys)
    assert rc == 0 and out.strip(), err


def test_nan_scale_in_a_matrix_through_the_cli_process(clean, tmp_path):
    """The headline case in its own process: what a user sees, exit code and all."""
    bad = _patched(clean, tmp_path / "nan.gguf", MATRIX, 5 * 34, NAN_F16)     # block 5's f16 d
    r = subprocess.run([sys.executable, "-m", "k3kit.cli", "generate", str(bad), "--prompt", "ab",
                        "--max-tokens", "4", "--threads", "1"], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = r.stderr.strip().splitlines()
    _one_line(r.returncode, r.stdout, lines, str(bad), f"tensor '{MATRIX}'", "Q8_0 block 5 ",
              "non-finite scale")
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("trunk", ["quantized", "float"])
def test_nan_scale_in_a_matrix(clean, tmp_path, capsys, trunk):
    bad = _patched(clean, tmp_path / "nan.gguf", MATRIX, 3 * 34, NAN_F16)
    _one_line(*_generate(bad, capsys, "--trunk", trunk), str(bad), f"tensor '{MATRIX}'",
              "Q8_0 block 3 ", "non-finite scale")


@pytest.mark.parametrize("trunk", ["quantized", "float"])
def test_nan_scale_in_token_embd(clean, tmp_path, capsys, trunk):
    """Every row's first block broken, so whichever token the prompt has hits one: the quantized
    embedding checks the rows it looks up and names the block within the whole tensor."""
    info = next(t for t in GGUFFile.open(clean).tensors if t.name == "token_embd.weight")
    row_bytes = info.nbytes // info.shape[1]
    bad = tmp_path / "embd.gguf"
    shutil.copyfile(clean, bad)
    with open(bad, "r+b") as f:
        for r in range(info.shape[1]):
            f.seek(info.offset + r * row_bytes)
            f.write(NAN_F16)
    line = _one_line(*_generate(bad, capsys, "--trunk", trunk), str(bad), "tensor 'token_embd.weight'",
                     "non-finite scale")
    block = int(line.split(" block ")[1].split()[0])
    assert block % (row_bytes // 34) == 0                   # the first block of some row


def test_mxfp4_exponent_ff_in_a_matrix(clean, tmp_path, capsys):
    """An MXFP4 trunk matrix whose block 9 has e8m0 = 0xFF and a nibble of 12: inf."""
    name = "blk.0.attn_q.weight"
    n = 256 * 256
    blocks = quants.random_blocks(T.MXFP4, n // 32, np.random.default_rng(0), (1e-3, 1e-2))
    fine = _retyped(clean, tmp_path / "mxfp4.gguf", name, T.MXFP4, blocks.reshape(-1))
    rc, out, err = _generate(fine, capsys)
    assert rc == 0 and out.strip(), err                     # valid MXFP4 trunk: runs
    blocks[9, 0], blocks[9, 1] = 0xFF, 0x77
    bad = _retyped(clean, tmp_path / "mxfp4-bad.gguf", name, T.MXFP4, blocks.reshape(-1))
    _one_line(*_generate(bad, capsys), str(bad), f"tensor '{name}'", "MXFP4 block 9 ", "non-finite scale")


@pytest.mark.parametrize("trunk", ["quantized", "float"])
def test_type_without_a_dequantizer(clean, tmp_path, capsys, trunk):
    """I32 for an F32 norm (same bytes) and Q8_1 for a Q8_0 matrix: refused at load."""
    bad = _retyped(clean, tmp_path / "i32.gguf", "blk.0.attn_norm.weight", T.I32)
    _one_line(*_generate(bad, capsys, "--trunk", trunk), str(bad), "tensor 'blk.0.attn_norm.weight'",
              "I32", "cannot dequantize")
    elems, nbytes = GGML_QUANT_SIZES[T.Q8_1]
    raw = np.zeros(256 * 64 // elems * nbytes, np.uint8)
    bad = _retyped(clean, tmp_path / "q81.gguf", MATRIX, T.Q8_1, raw)
    _one_line(*_generate(bad, capsys, "--trunk", trunk), str(bad), f"tensor '{MATRIX}'", "Q8_1",
              "cannot dequantize")
