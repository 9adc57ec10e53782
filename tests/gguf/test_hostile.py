"""Hostile files: every one must give a one-line error naming the file, exit 2, no big allocation."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from gguf_factories import kv_arr, kv_str, kv_u32, raw_gguf, s, tinfo

from k3kit.cli import main
from k3kit.errors import FormatError
from k3kit.gguf.reader import GGUFFile

ARCH = kv_str("general.architecture", "x")
DATA = bytes(range(256)) * 2  # 512 bytes of tensor data
OK_TENSORS = [tinfo("a", (32,), Q.F32, 0), tinfo("b", (32,), Q.F32, 128)]


def _huge_string_key() -> bytes:
    return struct.pack("<Q", 2**62) + b"key"


HOSTILE: dict[str, tuple[bytes, str]] = {
    "bad_magic": (raw_gguf([ARCH], OK_TENSORS, DATA, magic=b"GGML"),
                  r"bad magic b'GGML' \(not a GGUF file\)"),
    "version_1": (raw_gguf([ARCH], OK_TENSORS, DATA, version=1), "unsupported GGUF version 1"),
    "version_big_endian": (raw_gguf([ARCH], OK_TENSORS, DATA, version=3 << 24), "big-endian"),
    "tensor_count_2^60": (raw_gguf([ARCH], OK_TENSORS, DATA, n_tensors=2**60),
                          r"tensor count 1152921504606846976 is impossible for a \d+-byte file"),
    "kv_count_2^63": (raw_gguf([ARCH], OK_TENSORS, DATA, n_kv=2**63), "key/value count .* is impossible"),
    "kv_count_plausible_but_wrong": (raw_gguf([ARCH], OK_TENSORS, DATA, n_kv=20),
                                     r"key \d+: string length \d+ runs past the end"),
    "key_length_past_eof": (raw_gguf([_huge_string_key() + struct.pack("<II", V.UINT32, 1)], []),
                            "key 0: string length 4611686018427387904 runs past the end of the file"),
    "string_value_past_eof": (raw_gguf([s("k") + struct.pack("<IQ", V.STRING, 10**12) + b"abc"], []),
                              "key 'k': string length 1000000000000 runs past the end"),
    "array_length_absurd": (raw_gguf([kv_arr("k", V.UINT32, 2**61, b"\0" * 16)], []),
                            "array of 2305843009213693952 UINT32 cannot fit"),
    "string_array_absurd": (raw_gguf([kv_arr("k", V.STRING, 2**40, s("a"))], []),
                            "array of 1099511627776 strings cannot fit"),
    "string_in_array_past_eof": (raw_gguf([kv_arr("k", V.STRING, 2, s("a") + struct.pack("<Q", 999))], []),
                                 r"key 'k'\[1\]: string length 999 runs past"),
    "nested_array": (raw_gguf([kv_arr("k", V.ARRAY, 1, b"\0" * 12)], []), "nested arrays"),
    "unknown_value_type": (raw_gguf([s("k") + struct.pack("<II", 77, 0)], []), "unknown value type 77"),
    "duplicate_key": (raw_gguf([kv_u32("k", 1), kv_u32("k", 2)], []), "duplicate key 'k'"),
    "duplicate_tensor": (raw_gguf([ARCH], [tinfo("a", (32,), Q.F32, 0), tinfo("a", (32,), Q.F32, 128)], DATA),
                         "duplicate tensor name 'a'"),
    "overlapping_tensors": (raw_gguf([ARCH], [tinfo("a", (64,), Q.F32, 0), tinfo("b", (32,), Q.F32, 128)],
                                     DATA),
                            "tensors 'a' and 'b' overlap"),
    "tensor_past_eof": (raw_gguf([ARCH], [tinfo("a", (32,), Q.F32, 0), tinfo("b", (32,), Q.F32, 448)], DATA),
                        r"tensor 'b': data \[\d+, \d+\) past end of file"),
    "tensor_offset_2^63": (raw_gguf([ARCH], [tinfo("a", (32,), Q.F32, 2**63)], DATA), "past end of file"),
    "misaligned_offset": (raw_gguf([ARCH], [tinfo("a", (32,), Q.F32, 16)], DATA),
                          "data offset 16 is not a multiple of the alignment 32"),
    "alignment_not_power_of_two": (raw_gguf([kv_u32("general.alignment", 48)], OK_TENSORS, DATA,
                                            alignment=48),
                                   "general.alignment 48 is not a power of two"),
    "alignment_zero": (raw_gguf([kv_u32("general.alignment", 0)], OK_TENSORS, DATA),
                       "general.alignment 0 is not a power of two"),
    "alignment_wrong_type": (raw_gguf([kv_str("general.alignment", "32")], OK_TENSORS, DATA),
                             "general.alignment must be UINT32"),
    "unknown_ggml_type": (raw_gguf([ARCH], [tinfo("a", (32,), 4, 0)], DATA),
                          "tensor 'a': unknown ggml type 4"),
    "ggml_type_huge": (raw_gguf([ARCH], [tinfo("a", (32,), 2**31, 0)], DATA), "unknown ggml type"),
    "five_dims": (raw_gguf([ARCH], [tinfo("a", (32, 1, 1, 1, 1), Q.F32, 0)], DATA), "5 dimensions"),
    "zero_dims": (raw_gguf([ARCH], [tinfo("a", (), Q.F32, 0)], DATA), "0 dimensions"),
    "zero_dim_size": (raw_gguf([ARCH], [tinfo("a", (32, 0), Q.F32, 0)], DATA), "zero dimension"),
    "row_not_whole_blocks": (raw_gguf([ARCH], [tinfo("a", (33,), Q.Q8_0, 0)], DATA),
                             "row of 33 elements is not a multiple of the Q8_0 block size 32"),
    "shape_product_absurd": (raw_gguf([ARCH], [tinfo("a", (2**40, 2**40, 2**40), Q.F32, 0)], DATA),
                             "cannot fit in a"),
    "empty_file": (b"", "too short"),
    "three_bytes": (b"GGU", "too short"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_file_one_line_error(case, tmp_path, capsys):
    data, pattern = HOSTILE[case]
    p = tmp_path / f"{case}.gguf"
    p.write_bytes(data)
    with pytest.raises(FormatError, match=pattern):
        GGUFFile.open(p)
    assert main(["inspect", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"k3kit: error: {p}: ")
    assert "Traceback" not in err


def test_truncated_at_every_header_byte(tmp_path, capsys):
    """Cutting a valid file anywhere inside its header or data is a FormatError, never a crash."""
    full = raw_gguf([ARCH, kv_arr("t", V.STRING, 3, s("ab") + s("") + s("cde")),
                     kv_arr("n", V.INT16, 3, b"\1\0\2\0\3\0")], OK_TENSORS, DATA[:256])
    GGUFFile.open(_write(tmp_path / "full.gguf", full))
    for cut in range(len(full)):
        p = _write(tmp_path / "cut.gguf", full[:cut])
        with pytest.raises(FormatError) as e:
            GGUFFile.open(p)
        assert str(e.value).startswith(f"{p}: ")
    assert main(["inspect", str(_write(tmp_path / "cut.gguf", full[:100]))]) == 2
    assert capsys.readouterr().err.startswith("k3kit: error: ")


def _write(p: Path, data: bytes) -> Path:
    p.write_bytes(data)
    return p


def test_hostile_files_parse_under_a_small_address_space_limit(tmp_path):
    """With RLIMIT_AS barely above the interpreter's own use, no hostile file can allocate its claim."""
    for case, (data, _) in HOSTILE.items():
        (tmp_path / f"{case}.gguf").write_bytes(data)
    script = textwrap.dedent(f"""
        import json, resource, sys
        from pathlib import Path
        from k3kit.errors import FormatError
        from k3kit.gguf.reader import GGUFFile
        from k3kit.gguf.shards import Model
        vm = int([l for l in open('/proc/self/status') if l.startswith('VmSize')][0].split()[1]) * 1024
        limit = vm + (256 << 20)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        out = {{}}
        for p in sorted(Path({str(tmp_path)!r}).glob('*.gguf')):
            try:
                Model.open(p)
                out[p.name] = 'ok'
            except FormatError:
                out[p.name] = 'FormatError'
            except MemoryError:
                out[p.name] = 'MemoryError'
        print(json.dumps(out))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert len(result) == len(HOSTILE)
    assert set(result.values()) == {"FormatError"}, result


def test_cli_subprocess_has_no_traceback(tmp_path):
    p = _write(tmp_path / "bad.gguf", HOSTILE["tensor_count_2^60"][0])
    r = subprocess.run([sys.executable, "-m", "k3kit.cli", "inspect", str(p)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2
    assert r.stderr.startswith(f"k3kit: error: {p}: tensor count") and r.stderr.count("\n") == 1
    assert r.stdout == ""


def test_missing_file_is_exit_2(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope.gguf")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_header_size_cap(tmp_path, monkeypatch):
    """A count that fits the file but would make the header absurdly large is refused."""
    from k3kit.gguf import reader

    monkeypatch.setattr(reader, "MAX_HEADER_BYTES", 4096)
    monkeypatch.setattr(reader, "_INITIAL_READ", 1024)
    p = _write(tmp_path / "big.gguf", raw_gguf([kv_arr("k", V.UINT8, 8000, bytes(8000))], []))
    with pytest.raises(FormatError, match="header would exceed 4096 bytes"):
        GGUFFile.open(p)
    monkeypatch.setattr(reader, "MAX_HEADER_BYTES", 1 << 30)
    assert len(GGUFFile.open(p).kv["k"].value) == 8000
