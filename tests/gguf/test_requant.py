"""`k3kit requant` / `k3kit verify` on a synthetic sharded kimi-k3: selection, bytes, checks, errors.

The mini geometry has hidden 256, so the KDA/MLA input projections, the dense and shared
FFN and the latent-MoE down projection take Q4_K, while tensors whose ne0 is 32, 64, 96
or 128 (q_b, k_b/v_b, ssm_f_b, routed_up, down_shexp, MLA output) cannot and are kept.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType
from requant_helpers import copy_source, make_source, run_cli, sha

from k3kit.errors import K3Error
from k3kit.gguf import format as fmt
from k3kit.gguf import quants
from k3kit.gguf.reader import GGUFFile
from k3kit.gguf.requant import Options, preflight, requantize, verify_model
from k3kit.gguf.requant import plan as requant
from k3kit.gguf.requant.verify import ERROR_BOUNDS, verify_shard
from k3kit.gguf.shards import Model


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> list[Path]:
    return make_source(tmp_path_factory.mktemp("src"))


@pytest.fixture(scope="module")
def reference(source, tmp_path_factory) -> Path:
    """One uninterrupted default run (jobs 1): the bytes every other run must reproduce."""
    out = tmp_path_factory.mktemp("ref") / "out"
    requantize(source[0], out, Options(), jobs=1, progress=False)
    return out


def _shard_files(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.name.endswith(".gguf") and not p.name.startswith("."))


def test_output_bytes_are_the_codec_applied_to_the_source(source, reference):
    src, out = Model.open(source[0]), Model.open(_shard_files(reference)[0])
    try:
        assert [p.name for p in out.paths] == [p.name for p in src.paths]
        for sf, of in zip(src.files, out.files, strict=True):  # same layout, shard by shard
            assert [t.name for t in sf.tensors] == [t.name for t in of.tensors]
        n_q4k = n_kept_q8 = 0
        for name, t in src.tensors.items():
            o = out.tensors[name]
            assert o.shape == t.shape
            got = np.asarray(out.view(name))
            if o.ggml_type == Q.Q4_K:
                assert t.ggml_type == Q.Q8_0
                assert fmt.is_trunk_matrix(name, len(t.shape)) and t.shape[0] % 256 == 0
                x = quants.dequantize(np.asarray(src.view(name)), Q.Q8_0, t.n_elements)
                want = quants.quantize(x.reshape(-1, t.shape[0]), Q.Q4_K).reshape(-1)
                assert np.array_equal(got, want), name
                n_q4k += 1
            else:
                assert o.ggml_type == t.ggml_type
                assert np.array_equal(got, np.asarray(src.view(name))), name
                if t.ggml_type == Q.Q8_0:
                    n_kept_q8 += 1
                    assert (t.shape[0] % 256 != 0 or name in ("token_embd.weight", "output.weight")), name
        assert n_q4k == 36 and n_kept_q8 == 15
        experts = [n for n in src.tensors if fmt.is_routed_expert(n)]
        assert experts and all(out.tensors[n].ggml_type == Q.MXFP4 for n in experts)
        # KVs: everything equal but general.file_type, which becomes MOSTLY_Q4_K_S
        assert list(out.kv) == list(src.kv)
        for k, v in src.kv.items():
            if k == "general.file_type":
                assert out.kv[k].value == 14 and out.kv[k].vtype == GGUFValueType.UINT32
            elif isinstance(v.value, np.ndarray):
                assert np.array_equal(out.kv[k].value, v.value)
            else:
                assert out.kv[k].value == v.value, k
        for f in out.files[1:]:  # shards 2+ carry only the split keys, as their sources do
            assert set(f.kv) == {"split.no", "split.count", "split.tensors.count"}
    finally:
        src.close()
        out.close()
    journal = json.loads((reference / requant.JOURNAL_NAME).read_text())
    assert [s["state"] for s in journal["shards"]] == ["verified"] * 3
    for s, p in zip(journal["shards"], _shard_files(reference), strict=True):
        assert s["output"]["sha256"] == sha(p)
        assert s["output"]["size"] == p.stat().st_size == s["planned_bytes"]


def test_dry_run_plans_without_writing(source, reference, tmp_path, capsys):
    out = tmp_path / "out"
    rc, text, _ = run_cli(["requant", source[1], "-o", out, "--dry-run", "--json"], capsys)
    assert rc == 0 and not out.exists()
    r = json.loads(text)
    assert r["dry_run"] and r["target"] == "Q4_K" and r["file_type"] == 14
    real = sum(p.stat().st_size for p in _shard_files(reference))
    assert r["bytes_out"] == real  # the planned size is exact
    assert r["bytes_in"] == sum(p.stat().st_size for p in source)
    q = [g for g in r["by_role"] if g["to"] == "Q4_K"]
    assert {g["role"] for g in q} == {"attention", "dense_ffn", "shared_experts"}
    for g in q:  # Q8_0 (34 B / 32) -> Q4_K (144 B / 256)
        assert g["bytes_after"] * 34 * 256 == g["bytes_before"] * 144 * 32
    kept = {k["name"]: k["reason"] for k in r["kept"]}
    assert kept["blk.3.attn_k_b.weight"] == "ne0 32 not a multiple of 256"
    assert len(kept) == 13
    rc, text, _ = run_cli(["requant", source[0], "-o", out, "--dry-run"], capsys)
    assert rc == 0 and "embeddings_output" in text and "ne0 64 not a multiple of 256" in text


def test_include_exclude_and_other_targets(source, tmp_path):
    out = tmp_path / "a"
    r = requantize(source[0], out, Options(include=(r"^(token_embd|output)\.weight$",),
                                           exclude=(r"^blk\.0\.",)), jobs=1, progress=False)
    m = Model.open(out / source[0].name)
    try:
        assert m.tensors["token_embd.weight"].ggml_type == Q.Q4_K
        assert m.tensors["output.weight"].ggml_type == Q.Q4_K
        assert m.tensors["blk.0.attn_q.weight"].ggml_type == Q.Q8_0
        assert m.tensors["blk.1.attn_q.weight"].ggml_type == Q.Q4_K
    finally:
        m.close()
    # layer 0 (KDA + dense FFN) had 10 Q4_K-able matrices: q, k, v, f_a, beta, g, output, gate, up, down
    assert r.requantized == 36 - 10 + 2
    # F16 target: every trunk matrix fits (block 1); general.file_type MOSTLY_F16
    r = requantize(source[0], tmp_path / "b", Options(to="F16"), jobs=1, progress=False)
    assert r.file_type == 1 and r.requantized == 49 and not r.kept


def test_expert_requant_refused_with_reason(source, tmp_path, capsys):
    rc, _, err = run_cli(["requant", source[0], "-o", tmp_path / "x", "--include", "_exps"], capsys)
    assert rc == 2 and err.count("\n") == 1
    assert "ffn_gate_exps" in err and "quantization-aware training" in err and "--allow-expert-requant" in err
    assert not (tmp_path / "x").exists()
    # allowed: MXFP4 experts -> Q8_0, verified like any other tensor; file_type stays honest
    opts = Options(to="Q8_0", include=("_exps",), allow_expert_requant=True)
    r = requantize(source[0], tmp_path / "y", opts, jobs=1, progress=False)
    assert r.requantized == 9 and r.file_type == 7
    assert all(s["check"]["requantized_ok"] == s["requantized"] for s in r.shards)


def test_parallel_jobs_give_the_same_bytes(source, reference, tmp_path):
    out = tmp_path / "out"
    r = requantize(source[0], out, Options(), jobs=2, progress=False)
    assert [s["status"] for s in r.shards] == ["verified"] * 3
    for a, b in zip(_shard_files(reference), _shard_files(out), strict=True):
        assert a.name == b.name and sha(a) == sha(b)


def test_existing_output_needs_resume(source, reference, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / source[1].name).write_bytes(b"x")
    rc, _, err = run_cli(["requant", source[0], "-o", out], capsys)
    assert rc == 2 and "already holds" in err and (out / source[1].name).read_bytes() == b"x"
    rc, _, err = run_cli(["requant", source[0], "-o", reference], capsys)
    assert rc == 2 and "--resume" in err
    rc, _, err = run_cli(["requant", source[0], "-o", source[0].parent], capsys)
    assert rc == 2 and "input's directory" in err


def test_resume_of_a_finished_run_does_nothing(source, tmp_path):
    out = tmp_path / "out"
    requantize(source[0], out, Options(), jobs=1, progress=False)
    before = {p.name: (sha(p), p.stat().st_mtime_ns) for p in _shard_files(out)}
    r = requantize(source[0], out, Options(), jobs=1, resume=True, progress=False)
    assert len(r.resumed_skipped) == 3
    assert {p.name: (sha(p), p.stat().st_mtime_ns) for p in _shard_files(out)} == before
    with pytest.raises(K3Error, match="same options"):
        requantize(source[0], out, Options(to="Q8_0"), jobs=1, resume=True, progress=False)


def test_verify_command_table_and_tampering(source, reference, tmp_path, capsys):
    rc, text, _ = run_cli(["verify", reference / source[0].name, "--against", source[0].parent], capsys)
    assert rc == 0 and text.count(" OK") == 3 and "all shards verified" in text
    bad = copy_source(_shard_files(reference), tmp_path / "bad")
    m = Model.open(bad[0])
    q4 = next(t for t in m.tensors.values() if t.ggml_type == Q.Q4_K and t.shard == 1)
    kept = next(t for t in m.tensors.values() if t.ggml_type == Q.MXFP4 and t.shard == 2)
    m.close()
    with open(bad[1], "r+b") as f:  # one nibble byte deep inside a requantized tensor
        f.seek(q4.offset + 144 * 3 + 40)
        b = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([b ^ 0x88]))
    with open(bad[2], "r+b") as f:  # one byte of a preserved MXFP4 expert
        f.seek(kept.offset + 1000)
        b = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([b ^ 0x01]))
    rc, text, _ = run_cli(["verify", bad[0], "--against", source[0], "--json"], capsys)
    r = json.loads(text)
    assert rc == 1 and not r["ok"]
    assert [s["ok"] for s in r["shards"]] == [True, False, False]
    assert q4.name in r["shards"][1]["problems"][0]
    want = f"'{kept.name}': preserved bytes differ from the source at byte 1000"
    assert want in r["shards"][2]["problems"][0]


def test_verify_catches_a_valid_but_different_quantization(source, reference, tmp_path):
    """A block re-encoded with another valid Q4_K choice passes the error bound; the exact check does not."""
    out = copy_source(_shard_files(reference), tmp_path / "o")
    f = GGUFFile.open(out[0])
    t = next(t for t in f.tensors if t.ggml_type == Q.Q4_K)
    f.close()
    with open(out[0], "r+b") as fh:
        fh.seek(t.offset)
        block = bytearray(fh.read(144))
        block[16] = (block[16] & 0xF0) | max((block[16] & 0x0F) - 1, 0) if block[16] & 0x0F else block[16] | 1
        fh.seek(t.offset)
        fh.write(block)
    chk = verify_shard(out[0], source[0], exact="all")
    assert not chk.ok and "is not the Q4_K quantization of the source row" in chk.problems[0]
    assert verify_shard(out[0], source[0], exact="none").ok  # one level off stays within the bound


def test_nan_source_scale_fails_cleanly(source, tmp_path, capsys):
    src = copy_source(source, tmp_path / "src")
    f = GGUFFile.open(src[0])
    t = next(t for t in f.tensors if t.name == "blk.0.attn_q.weight")
    f.close()
    with open(src[0], "r+b") as fh:  # fp16 NaN as the scale of block 5
        fh.seek(t.offset + 34 * 5)
        fh.write(np.array([np.nan], dtype=np.float16).tobytes())
    before = [sha(p) for p in src]
    rc, _, err = run_cli(["requant", src[0], "-o", tmp_path / "out", "--jobs", "1"], capsys)
    assert rc == 2 and err.count("\n") == 1
    assert "blk.0.attn_q.weight' row 0 decodes to non-finite values" in err and str(src[0]) in err
    assert [sha(p) for p in src] == before
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.endswith((".gguf", ".partial"))]


def test_verify_flags_non_finite_source(source, reference, tmp_path):
    src = copy_source(source, tmp_path / "src")
    f = GGUFFile.open(src[0])
    t = next(t for t in f.tensors if t.name == "blk.0.attn_q.weight")
    f.close()
    with open(src[0], "r+b") as fh:
        fh.seek(t.offset + 34 * 9)
        fh.write(np.array([np.inf], dtype=np.float16).tobytes())
    chk = verify_shard(reference / src[0].name, src[0])
    # block 9 of a 256-wide row of 8 blocks: row 1
    assert not chk.ok and chk.problems == ["tensor 'blk.0.attn_q.weight': source row 1 has non-finite values"]


def test_truncated_shard_is_refused(source, tmp_path, capsys):
    src = copy_source(source, tmp_path / "src")
    with open(src[2], "r+b") as fh:
        fh.truncate(src[2].stat().st_size - 1000)
    rc, _, err = run_cli(["requant", src[0], "-o", tmp_path / "out", "--delete-source"], capsys)
    assert rc == 2 and err.count("\n") == 1 and src[2].name in err and "past end of file" in err
    assert all(p.exists() for p in src) and not (tmp_path / "out").exists()


def test_preflight_refuses_with_numbers(source, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(requant, "free_bytes", lambda p: 1_000_000)
    rc, _, err = run_cli(["requant", source[0], "-o", tmp_path / "out"], capsys)
    assert rc == 2 and "not enough free space" in err and "1000000 are free" in err
    assert "--delete-source could free" in err
    assert not list((tmp_path / "out").glob("*.gguf"))


def _fake(name, src, out, index, work=0):
    t = requant.TensorPlan("w", (256, 1), Q.Q8_0, Q.Q4_K, work, 0, "attention", "requant")
    return requant.ShardPlan(index, name, Path("/s") / name, Path("/o") / name, [t], [], 32, src, out, 0, "")


def test_preflight_orders_by_saving_and_refuses_when_it_cannot_fit(monkeypatch):
    monkeypatch.setattr(requant, "same_filesystem", lambda a, b: True)
    mb = 1 << 20
    plans = [_fake("a", 100 * mb, 90 * mb, 0, work=1), _fake("b", 100 * mb, 50 * mb, 1, work=3),
             _fake("c", 100 * mb, 70 * mb, 2, work=2)]
    monkeypatch.setattr(requant, "free_bytes", lambda p: 300 << 20)
    order, info = preflight(plans, Path("/o"), delete_source=False)
    assert [p.name for p in order] == ["b", "c", "a"]  # room for all: most requant work first
    monkeypatch.setattr(requant, "free_bytes", lambda p: 60 << 20)
    with pytest.raises(K3Error, match="the outputs need 224395264 bytes, 62914560 are free"):
        preflight(plans, Path("/o"), delete_source=False)
    plans[1], plans[2] = _fake("b", 100 * mb, 70 * mb, 1, work=3), _fake("c", 100 * mb, 50 * mb, 2, work=2)
    order, info = preflight(plans, Path("/o"), delete_source=True)
    assert [p.name for p in order] == ["c", "b", "a"]  # largest saving first: 50 fits, then 70 in 110, ...
    monkeypatch.setattr(requant, "free_bytes", lambda p: 40 << 20)
    with pytest.raises(K3Error, match="even deleting sources shard by shard: shard c needs"):
        preflight(plans, Path("/o"), delete_source=True)


def _mount_tmpfs(d: Path, size: str):
    import subprocess
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=True)


@pytest.fixture
def tiny_tmpfs(tmp_path):
    yield from _mount_tmpfs(tmp_path / "tmpfs", "2m")


@pytest.fixture
def small_tmpfs(tmp_path):
    yield from _mount_tmpfs(tmp_path / "tmpfs", "9m")


def test_delete_source_makes_it_fit_shard_by_shard(source, reference, small_tmpfs, capsys):
    """Sources (3.3 MB) and outputs share a 9 MiB disk: all outputs (2.4 MB + margin) do not fit
    next to the sources, one at a time with each source deleted after its output does."""
    src = copy_source(source, small_tmpfs / "src")
    out = small_tmpfs / "out"
    rc, _, err = run_cli(["requant", src[0], "-o", out, "--jobs", "2"], capsys)
    assert rc == 2 and "not enough free space" in err and "--delete-source could free" in err
    rc, text, _ = run_cli(["requant", src[0], "-o", out, "--jobs", "2", "--delete-source", "--json"], capsys)
    assert rc == 0, text
    r = json.loads(text)
    assert r["disk"]["needed"] < r["disk"]["free"] < r["disk"]["needed_all_at_once"]
    assert r["disk"]["order"] and len(r["deleted_sources"]) == 3 and not any(p.exists() for p in src)
    assert {p.name: sha(p) for p in _shard_files(out)} == {p.name: sha(p) for p in _shard_files(reference)}


def test_full_disk_preflight_and_mid_write(source, tiny_tmpfs, monkeypatch, capsys):
    rc, _, err = run_cli(["requant", source[0], "-o", tiny_tmpfs / "out"], capsys)
    assert rc == 2 and err.count("\n") == 1 and "not enough free space" in err
    # lie about the free space: the writer hits ENOSPC, the error is one line, nothing is left
    monkeypatch.setattr(requant, "free_bytes", lambda p: 1 << 40)
    rc, _, err = run_cli(["requant", source[0], "-o", tiny_tmpfs / "out", "--jobs", "1"], capsys)
    assert rc == 2 and err.count("\n") == 1 and "no space left on device while writing" in err
    left = sorted(p.name for p in (tiny_tmpfs / "out").iterdir())
    assert set(left) <= {requant.JOURNAL_NAME} | {p.name for p in source}  # no partials, no temps
    assert len(left) < 4  # the last shard did not fit
    assert all(p.exists() for p in source)
    journal = json.loads((tiny_tmpfs / "out" / requant.JOURNAL_NAME).read_text())
    for s in journal["shards"]:
        final = tiny_tmpfs / "out" / s["name"]
        assert (s["state"] == "verified") == final.exists()


def test_error_bound_table_covers_every_target():
    for t in requant.TARGETS:
        assert t in ERROR_BOUNDS
    b = ERROR_BOUNDS[Q.Q4_K]
    x = np.random.default_rng(3).standard_t(3, (64, 256)).astype(np.float32)
    y = quants.dequantize(quants.quantize(x, Q.Q4_K).reshape(-1), Q.Q4_K, x.size).reshape(x.shape)
    r = np.maximum(x.max(1), 0) - np.minimum(x.min(1), 0)
    assert (np.abs(x - y).max(1) <= b.frac * r + b.floor).all()
    assert (np.abs(x - y).max(1) > b.frac * r / 4).any()  # the bound is not vacuous


def test_verify_checks_the_journal_hash(source, reference, tmp_path, capsys):
    out = copy_source([*_shard_files(reference), reference / requant.JOURNAL_NAME], tmp_path / "o")
    journal = json.loads(out[-1].read_text())
    journal["shards"][0]["output"]["sha256"] = "0" * 64
    out[-1].write_text(json.dumps(journal))
    rc, text, _ = run_cli(["verify", out[0], "--against", source[0], "--json"], capsys)
    r = json.loads(text)
    assert rc == 1 and [s["ok"] for s in r["shards"]] == [False, True, True]
    assert "differs from the journal's 0000000000000000" in r["shards"][0]["problems"][0]


@pytest.mark.parametrize(("content", "msg"), [
    (b"{not json", "journal is not valid JSON"),
    (b'{"format": "something else"}', "not a k3kit requant journal"),
    (None, "not a k3kit requant journal"),  # a real journal with a bad type name in a plan
])
def test_hostile_journal_is_refused(source, reference, tmp_path, capsys, content, msg):
    out = tmp_path / "o"
    copy_source([*_shard_files(reference), reference / requant.JOURNAL_NAME], out)
    jp = out / requant.JOURNAL_NAME
    if content is None:
        journal = json.loads(jp.read_text())
        journal["shards"][1]["plan"][0][2] = "Q4_K; rm -rf /"
        content = json.dumps(journal).encode()
    jp.write_bytes(content)
    rc, _, err = run_cli(["requant", source[0], "-o", out, "--resume"], capsys)
    assert rc == 2 and err.count("\n") == 1 and msg in err and str(jp) in err


def test_single_file_model(tmp_path):
    from k3kit.gguf import synth
    src = Path(synth.synthesize(tmp_path / "src", "mini", 2, 4, seed=3, progress=False).paths[0])
    r = requantize(src, tmp_path / "out", Options(), jobs=2, progress=False)
    out = tmp_path / "out" / src.name
    assert [s["status"] for s in r.shards] == ["verified"] and out.exists()
    assert verify_model(out, src, exact="all", progress=False).ok


def test_small_chunks_give_the_same_bytes(source, reference, tmp_path, monkeypatch):
    """Mini tensors fit one chunk; with tiny chunks the streaming paths (requant and verify) are exercised."""
    from k3kit.gguf.requant import verify
    monkeypatch.setattr(requant, "CHUNK_ELEMS", 1000)  # < one 256 x 8 row group: one row per chunk
    monkeypatch.setattr(verify, "CHUNK_ELEMS", 3000)
    monkeypatch.setattr(verify, "HASH_CHUNK", 4096)
    r = requantize(source[0], tmp_path / "out", Options(), jobs=1, progress=False)
    ref = json.loads((reference / requant.JOURNAL_NAME).read_text())
    for s, rec in zip(r.shards, ref["shards"], strict=True):
        assert s["sha256"] == rec["output"]["sha256"]
        assert s["check"]["exact_rows"] == rec["check"]["exact_rows"]
        assert s["check"]["max_rel_rmse"] == pytest.approx(rec["check"]["max_rel_rmse"], rel=1e-6)
