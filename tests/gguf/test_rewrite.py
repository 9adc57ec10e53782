"""rewrite: metadata changes only; tensor bytes identical; outputs atomic; inputs protected."""

from __future__ import annotations

import errno
import json

import gguf
import numpy as np
import pytest
from gguf import GGUFValueType as V

from k3kit.cli import main
from k3kit.gguf import writer
from k3kit.gguf.reader import KV
from k3kit.gguf.shards import Model


def _val(k: KV):
    return k.value.tolist() if isinstance(k.value, np.ndarray) else k.value


def _kvs(m: Model) -> list[tuple]:
    return [(k.key, k.vtype, k.item_type, _val(k)) for k in m.kv.values()]


def _same_tensors(a: Model, b: Model, rename=lambda n: n) -> None:
    assert [rename(n) for n in a.tensors] == list(b.tensors)
    for name, t in a.tensors.items():
        u = b.tensors[rename(name)]
        assert (t.shape, t.ggml_type) == (u.shape, u.ggml_type)
        assert np.array_equal(a.view(name), b.view(rename(name))), name


def _run(args, capsys) -> tuple[int, str, str]:
    code = main(["rewrite", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_no_rules_round_trip_keeps_everything(k3_sharded, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    code, out, _ = _run([k3_sharded[2], "-o", tmp_path / "out" / "copy.gguf", "--json"], capsys)
    assert code == 0
    res = json.loads(out)
    assert res["kv_added"] == res["kv_removed"] == res["kv_changed"] == res["kv_moved"] == []
    a, b = Model.open(k3_sharded[0]), Model.open(res["output"][0])
    assert [p.name for p in b.paths] == [p.name.replace("k3s", "copy") for p in a.paths]
    assert [[t.name for t in f.tensors] for f in a.files] == [[t.name for t in f.tensors] for f in b.files]
    assert _kvs(a) == _kvs(b)
    _same_tensors(a, b)
    for p in b.paths:
        gguf.GGUFReader(p)  # the peer reads every output shard
    assert res["bytes_copied"] == sum(t.nbytes for t in a.tensors.values())


def test_arch_rename_moves_every_key(k3_model, tmp_path, capsys):
    out = tmp_path / "renamed.gguf"
    code, stdout, _ = _run([k3_model, "-o", out, "--arch", "kimi-k9", "--json"], capsys)
    assert code == 0
    a, b = Model.open(k3_model), Model.open(out)
    old = [k for k in a.kv if k.startswith("kimi-k3.")]
    assert len(old) > 5
    assert not any(k.startswith("kimi-k3.") for k in b.kv)
    for k in old:
        assert _val(b.kv["kimi-k9" + k[len("kimi-k3"):]]) == _val(a.kv[k])
    assert b.arch == "kimi-k9" and list(b.kv) == [k.replace("kimi-k3.", "kimi-k9.") for k in a.kv]
    res = json.loads(stdout)
    assert res["arch"] == {"from": "kimi-k3", "to": "kimi-k9"} and len(res["kv_moved"]) == len(old)
    assert res["kv_changed"] == ["general.architecture"]
    _same_tensors(a, b)


def test_set_delete_copy_and_tensor_rename(k3_model, tmp_path, capsys):
    donor = tmp_path / "donor.gguf"
    writer.write_gguf(donor, [writer.kv("tokenizer.ggml.pre", V.STRING, "kimi-k2"),
                              writer.kv("tokenizer.ggml.bos_token_id", V.UINT32, 7),
                              writer.kv("other.thing", V.UINT8, 1)], [])
    out = tmp_path / "o.gguf"
    code, stdout, err = _run([k3_model, "-o", out, "--json",
                              "--set", "kimi-k3.block_count=u32:5",
                              "--set", "x.flag=bool:true", "--set", "x.list=arr[i32]:1,-2,3",
                              "--set", "x.names=arr[str]:a,b", "--set", "x.f=f64:0.25",
                              "--set", "x.s=str:a=b:c",
                              "--delete", "general.name", "--delete", "tokenizer.ggml.model",
                              "--copy-kv-from", donor, "--keys", "tokenizer.*",
                              "--rename-tensor", r"^blk\.(\d+)\.ffn_(gate|up|down)_exps=blk.\1.moe_\2"],
                             capsys)
    assert code == 0, err
    a, b = Model.open(k3_model), Model.open(out)
    kv = b.kv
    assert (kv["kimi-k3.block_count"].vtype, kv["kimi-k3.block_count"].value) == (V.UINT32, 5)
    assert kv["x.flag"].value is True and kv["x.list"].item_type == V.INT32
    assert _val(kv["x.list"]) == [1, -2, 3]
    assert kv["x.names"].value == ["a", "b"] and kv["x.f"].value == 0.25 and kv["x.s"].value == "a=b:c"
    assert "general.name" not in kv and "tokenizer.ggml.model" not in kv and "other.thing" not in kv
    assert kv["tokenizer.ggml.pre"].value == "kimi-k2" and kv["tokenizer.ggml.bos_token_id"].value == 7
    res = json.loads(stdout)
    assert res["kv_changed"] == ["kimi-k3.block_count"]
    assert sorted(res["kv_removed"]) == ["general.name", "tokenizer.ggml.model"]
    assert set(res["kv_added"]) == {"x.flag", "x.list", "x.names", "x.f", "x.s", "tokenizer.ggml.pre",
                                    "tokenizer.ggml.bos_token_id"}
    assert len(res["tensors_renamed"]) == 9
    ren = {a_: b_ for a_, b_ in res["tensors_renamed"]}
    assert ren["blk.2.ffn_down_exps.weight"] == "blk.2.moe_down.weight"
    _same_tensors(a, b, lambda n: ren.get(n, n))


def test_rules_file_equals_flags(k3_model, tmp_path, capsys):
    rules = tmp_path / "rules.toml"
    rules.write_text(
        'arch = "k3x"\n'
        'delete = ["general.name"]\n'
        '[set]\n"k3x.block_count" = "u32:9"\n"x.arr" = { type = "arr[f32]", value = [0.5, 1.5] }\n'
        '[[rename_tensor]]\npattern = "^output\\\\."\nreplace = "lm_head."\n'
    )
    assert _run([k3_model, "-o", tmp_path / "r.gguf", "--rules", rules], capsys)[0] == 0
    assert _run([k3_model, "-o", tmp_path / "f.gguf", "--arch", "k3x", "--delete", "general.name",
                 "--set", "k3x.block_count=u32:9", "--set", "x.arr=arr[f32]:0.5,1.5",
                 "--rename-tensor", r"^output\.=lm_head."], capsys)[0] == 0
    r, f = Model.open(tmp_path / "r.gguf"), Model.open(tmp_path / "f.gguf")
    assert _kvs(r) == _kvs(f)
    assert "lm_head.weight" in r.tensors and r.kv["k3x.block_count"].value == 9
    _same_tensors(r, f)


def test_resplit_and_merge(k3_sharded, tmp_path, capsys):
    assert _run([k3_sharded[0], "-o", tmp_path / "one.gguf", "--split-max-size", "1T"], capsys)[0] == 0
    one = Model.open(tmp_path / "one.gguf")
    assert one.paths == [tmp_path / "one.gguf"]
    _same_tensors(Model.open(k3_sharded[0]), one)
    code = _run([tmp_path / "one.gguf", "-o", tmp_path / "many.gguf", "--split-max-size", "30K"], capsys)[0]
    assert code == 0
    many = Model.open(tmp_path / "many-00001-of-00010.gguf")
    assert len(many.paths) == 10
    for f in many.files:
        assert sum(-(-t.nbytes // 32) * 32 for t in f.tensors) <= 30_000 or len(f.tensors) == 1
    _same_tensors(one, many)
    assert _kvs(one) == _kvs(many)


@pytest.mark.parametrize("sharded", [False, True])
def test_refuses_to_overwrite_input_without_in_place(k3_model, k3_sharded, capsys, sharded):
    src = k3_sharded[1] if sharded else k3_model
    target = k3_sharded[0] if sharded else k3_model
    before = target.read_bytes()
    code, _, err = _run([src, "-o", target, "--arch", "zzz"], capsys)
    assert code == 2 and "would overwrite the input (use --in-place)" in err and err.count("\n") == 1
    assert target.read_bytes() == before


def test_refuses_hardlinked_output(k3_model, tmp_path, capsys):
    link = tmp_path / "link.gguf"
    link.hardlink_to(k3_model)
    code, _, err = _run([k3_model, "-o", link], capsys)
    assert code == 2 and "overwrite the input" in err


@pytest.mark.parametrize("sharded", [False, True])
def test_in_place(k3_model, k3_sharded, tmp_path, capsys, sharded):
    src = k3_sharded[2] if sharded else k3_model
    keep = tmp_path / "orig"
    keep.mkdir()
    originals = k3_sharded if sharded else [k3_model]
    for p in originals:
        (keep / p.name).write_bytes(p.read_bytes())
    assert _run([src, "--in-place", "--set", "x.new=u8:1"], capsys)[0] == 0
    a, b = Model.open(keep / originals[0].name), Model.open(src)
    assert b.paths == originals and b.kv["x.new"].value == 1
    _same_tensors(a, b)
    assert sorted(p.name for p in src.parent.iterdir() if p.name.startswith(".")) == []


def test_in_place_reshard_removes_stale_shards(k3_sharded, capsys):
    code, out, _ = _run([k3_sharded[0], "--in-place", "--split-max-size", "1T", "--json"], capsys)
    assert code == 0
    res = json.loads(out)
    merged = k3_sharded[0].with_name("k3s.gguf")
    assert res["output"] == [str(merged)]
    assert sorted(res["stale_shards_removed"]) == sorted(map(str, k3_sharded))
    assert not any(p.exists() for p in k3_sharded)
    assert len(Model.open(merged).tensors) == 50


def test_failure_mid_write_leaves_no_output(k3_sharded, tmp_path, capsys, monkeypatch):
    real = writer._copy_range
    calls = {"n": 0}

    def flaky(src, fd, progress):
        calls["n"] += 1
        if calls["n"] == 30:
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out"))
        return real(src, fd, progress)

    monkeypatch.setattr(writer, "_copy_range", flaky)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code, _, err = _run([k3_sharded[0], "-o", out_dir / "x.gguf"], capsys)
    assert code == 2 and "No space left on device" in err
    assert list(out_dir.iterdir()) == []


@pytest.mark.parametrize("args,msg", [
    (["--set", "k=u99:1"], "unknown type 'u99'"),
    (["--set", "k=u8:300"], "out of range"),
    (["--set", "k=u8:abc"], "invalid literal"),
    (["--set", "k"], "expected KEY=TYPE:VALUE"),
    (["--set", "k=u8"], "TYPE:VALUE"),
    (["--set", "split.no=u16:1"], "managed by the writer"),
    (["--set", "k=arr[x]:1"], "unknown array element type"),
    (["--delete", "no.such.key"], "no such key"),
    (["--rename-tensor", "(=x"], "bad regex"),
    (["--rename-tensor", r"^blk\.\d+\.=blk.0."], "would both be named"),
    (["--rename-tensor", "^=" + "x" * 70], "64 bytes or longer"),
    (["--copy-kv-from", "other.gguf"], "one --keys per --copy-kv-from"),
    (["--split-max-size", "lots"], "expected a size"),
])
def test_bad_arguments_are_one_line_errors(k3_model, tmp_path, capsys, args, msg):
    out = tmp_path / "o.gguf"
    code, _, err = _run([k3_model, "-o", out, *args], capsys)
    assert code == 2 and msg in err and err.count("\n") == 1 and err.startswith("k3kit: error: ")
    assert not out.exists()


def test_bad_rules_file(k3_model, tmp_path, capsys):
    rules = tmp_path / "r.toml"
    rules.write_text("arch = [1\n")
    code, _, err = _run([k3_model, "-o", tmp_path / "o.gguf", "--rules", rules], capsys)
    assert code == 2 and f"{rules}: not valid TOML" in err
    rules.write_text('colour = "blue"\n')
    code, _, err = _run([k3_model, "-o", tmp_path / "o.gguf", "--rules", rules], capsys)
    assert code == 2 and "unknown rules key" in err


def test_copy_kv_glob_without_match(k3_model, tmp_path, capsys):
    code, _, err = _run([k3_model, "-o", tmp_path / "o.gguf", "--copy-kv-from", k3_model, "--keys", "nope.*"],
                        capsys)
    assert code == 2 and "no key matches 'nope.*'" in err


def test_human_report(k3_model, tmp_path, capsys):
    code, out, _ = _run([k3_model, "-o", tmp_path / "h.gguf", "--arch", "k4", "--delete", "general.name"],
                        capsys)
    assert code == 0
    assert "arch: kimi-k3 -> k4" in out and "KV removed: general.name" in out and "copied unchanged" in out


def test_parse_size():
    from k3kit.gguf.rewrite import parse_size

    assert parse_size("2G") == 2_000_000_000 and parse_size("500M") == 500_000_000
    assert parse_size("4GiB") == 4 << 30 and parse_size("1.5K") == 1500 and parse_size("123") == 123


def test_in_place_with_other_output_keeps_the_input(k3_model, tmp_path, capsys):
    out = tmp_path / "elsewhere.gguf"
    assert _run([k3_model, "-o", out, "--in-place"], capsys)[0] == 0
    assert k3_model.exists() and out.exists()


def test_rewrite_of_gguf_py_file(gguf_py_file, tmp_path, capsys):
    out = tmp_path / "py2.gguf"
    assert _run([gguf_py_file, "-o", out, "--arch", "llama2"], capsys)[0] == 0
    a, b = gguf.GGUFReader(gguf_py_file), gguf.GGUFReader(out)
    assert b.fields["llama2.block_count"].contents() == a.fields["llama.block_count"].contents() == 2
    assert b.fields["tokenizer.ggml.tokens"].contents() == ["a", "b", "c"]
    for ta, tb in zip(a.tensors, b.tensors, strict=True):
        assert ta.name == tb.name and np.array_equal(ta.data, tb.data)
