"""`k3kit draft fix`: a legacy (Lucebox-style `dflash-draft`) GGUF made from our own converted draft
must come back equal to what `draft convert` wrote: same KVs, same tensor names, same bytes."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
from draft_fixture import BACK, LEGACY, make_legacy, write_draft, write_target
from gguf import GGUFValueType

from k3kit.cli import main
from k3kit.convert.draft import convert_draft
from k3kit.convert.draft_fix import LEGACY_TENSORS, fix_draft
from k3kit.errors import K3Error
from k3kit.gguf.reader import GGUFFile
from k3kit.gguf.rewrite import Rules, rewrite
from k3kit.gguf.writer import kv


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("fix")
    target = write_target(root / "target")
    write_draft(root / "draft")
    convert_draft(root / "draft", target, root / "converted.gguf", progress=False)
    return root, target, root / "converted.gguf"


def _kvs(path: Path) -> dict:
    f = GGUFFile.open(path)
    try:
        return {k: (v.vtype, v.item_type, np.asarray(v.value).tolist() if v.vtype == GGUFValueType.ARRAY
                    and v.item_type != GGUFValueType.STRING else v.value) for k, v in f.kv.items()}
    finally:
        f.close()


def _tensors(path: Path) -> list[tuple[str, tuple, int, str]]:
    f = GGUFFile.open(path)
    try:
        return [(t.name, t.shape, int(t.ggml_type), hashlib.sha256(f.view(t).tobytes()).hexdigest())
                for t in f.tensors]
    finally:
        f.close()


def test_legacy_draft_is_fixed_into_the_converted_one(setup, tmp_path, capsys):
    root, target, converted = setup
    legacy = make_legacy(converted, tmp_path / "legacy.gguf")
    lk = _kvs(legacy)
    assert lk["general.architecture"][2] == LEGACY and "tokenizer.ggml.tokens" not in lk
    assert {n for n, *_ in _tensors(legacy)} >= set(BACK.values())

    rc = main(["draft", "fix", str(legacy), "--target", str(target), "-o", str(tmp_path / "fixed.gguf")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "arch dflash-draft -> dflash" in out and "tensor dflash.fc.weight -> fc.weight" in out
    assert "key dflash.dflash.target_layer_ids -> dflash.target_layers" in out

    assert _kvs(tmp_path / "fixed.gguf") == _kvs(converted)            # KVs: keys, types, values
    assert _tensors(tmp_path / "fixed.gguf") == _tensors(converted)    # names, shapes, types, bytes


def test_fix_is_idempotent(setup, tmp_path, capsys):
    _, target, converted = setup
    legacy = make_legacy(converted, tmp_path / "legacy.gguf")
    first = fix_draft(legacy, target, tmp_path / "a.gguf")
    assert first.changed and first.arch == {"from": LEGACY, "to": "dflash"}
    assert sorted(first.tensors_renamed) == sorted([v, k] for k, v in BACK.items())
    second = fix_draft(tmp_path / "a.gguf", target, tmp_path / "b.gguf")
    assert not second.changed and second.arch is None
    assert not (second.kv_added or second.kv_removed or second.kv_changed or second.tensors_renamed)
    assert "nothing to change" in second.summary()
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
    assert main(["draft", "fix", str(tmp_path / "a.gguf"), "--target", str(target), "-o",
                 str(tmp_path / "j.gguf"), "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["changed"] is False and j["tensors_renamed"] == [] and j["legacy_keys"] == []
    # and the converter's own output is already fixed
    third = fix_draft(converted, target, tmp_path / "c.gguf")
    assert not third.changed and (tmp_path / "c.gguf").read_bytes() == converted.read_bytes()


def test_half_fixed_draft(setup, tmp_path):
    """The seed's intermediate state: arch already dflash, mask id under dflash.mask_token_id, no
    tokenizer, no sample_from_anchor."""
    _, target, converted = setup
    half = make_legacy(converted, tmp_path / "half.gguf", half_fixed=True)
    r = fix_draft(half, target, tmp_path / "fixed.gguf")
    assert r.changed and r.arch is None
    assert ["dflash.mask_token_id", "tokenizer.ggml.mask_token_id"] in r.legacy_keys
    assert _kvs(tmp_path / "fixed.gguf") == _kvs(converted)


def test_fix_refuses_what_it_cannot_fix(setup, tmp_path):
    _, target, converted = setup
    with pytest.raises(K3Error, match="'kimi-k3' is not a DFlash draft"):
        fix_draft(target, target, tmp_path / "x.gguf")
    # a tensor llama.cpp's dflash loader does not know
    odd = tmp_path / "odd.gguf"
    rewrite(make_legacy(converted, tmp_path / "l.gguf"), odd,
            Rules(rename_tensors=[(re.compile("^blk.0.ffn_up.weight$"), "blk.0.mlp_up_legacy.weight")]))
    with pytest.raises(K3Error, match=r"blk\.0\.mlp_up_legacy\.weight"):
        fix_draft(odd, target, tmp_path / "y.gguf")
    # conflicting legacy and modern values
    both = tmp_path / "both.gguf"
    rewrite(make_legacy(converted, tmp_path / "l2.gguf"), both,
            Rules(set=[kv(f"{LEGACY}.block_size", GGUFValueType.UINT32, 3)]))
    with pytest.raises(K3Error, match="disagree"):
        fix_draft(both, target, tmp_path / "z.gguf")
    assert not any((tmp_path / n).exists() for n in ("x.gguf", "y.gguf", "z.gguf"))


def test_every_legacy_tensor_name_has_a_dflash_name():
    from k3kit.gguf.format import dflash_expected_tensors
    required, optional = dflash_expected_tensors(1)
    assert set(LEGACY_TENSORS.values()) <= required | optional
