"""`--draft` takes a legacy `dflash-draft` file as is, as the seed's llama.cpp alias patch does: the
architecture read as dflash, the tokenizer the target's, the mask id from the legacy key.

The legacy file is the shipped mini drafter rewritten into the Lucebox converter's form
(draft_fixture.make_legacy: arch dflash-draft, keys one level down, legacy tensor names, no
tokenizer); the seed's half-fixed state (arch dflash, mask id under dflash.mask_token_id) too.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from draft_fixture import LEGACY, make_legacy
from gguf import GGUFValueType

from k3kit.adapters import ADAPTERS, load_model
from k3kit.cli import main
from k3kit.convert.draft_fix import LEGACY_ARCHES, LEGACY_TENSORS
from k3kit.gguf.reader import GGUFFile
from k3kit.gguf.rewrite import Rules, rewrite
from k3kit.gguf.writer import kv
from k3kit.mini.paths import shipped_draft

PROMPT = "import os\nimport sys\n\ndef main("
SPEC_KEYS = ("target_passes", "draft_steps", "committed_per_pass", "acceptance_histogram", "verify_rows")


@pytest.fixture(scope="module")
def legacy(tmp_path_factory) -> Path:
    return make_legacy(Path(shipped_draft()), tmp_path_factory.mktemp("legacy") / "legacy.gguf")


def _arch(path: Path) -> str:
    f = GGUFFile.open(path)
    try:
        return str(f.kv["general.architecture"].value)
    finally:
        f.close()


def test_every_legacy_arch_has_the_dflash_adapter():
    assert all(ADAPTERS[a] == ADAPTERS["dflash"] for a in LEGACY_ARCHES)


def test_legacy_draft_loads_as_the_modern_one(legacy, tmp_path):
    assert _arch(legacy) == LEGACY
    half = make_legacy(Path(shipped_draft()), tmp_path / "half.gguf", half_fixed=True)
    with load_model(shipped_draft()) as modern:
        for path in (legacy, half):
            with load_model(path) as old:
                assert old.model.cfg == modern.model.cfg, path
                a, b = dict(old.model.draft.named_parameters()), dict(modern.model.draft.named_parameters())
                assert a.keys() == b.keys()
                assert all(torch.equal(a[n], b[n]) for n in a), path


def test_mask_id_comes_from_the_legacy_key(legacy, tmp_path):
    moved = tmp_path / "mask.gguf"
    rewrite(legacy, moved, Rules(set=[kv(f"{LEGACY}.dflash.mask_token_id", GGUFValueType.UINT32, 17)]))
    with load_model(moved) as d, load_model(shipped_draft()) as modern:
        assert d.model.cfg.mask_token_id == 17 != modern.model.cfg.mask_token_id


def _generate(*extra: str) -> dict:
    cmd = [sys.executable, "-m", "k3kit.cli", "generate", "--prompt", PROMPT, "--max-tokens", "32", "--json"]
    r = subprocess.run([*cmd, *extra], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_generate_with_the_legacy_file_equals_the_modern_one(legacy):
    """A fixed verify budget: `auto` widths and whether a pass drafts follow measured times, which
    differ between two runs on a busy machine; the proposals are what must match."""
    modern = _generate("--draft", str(shipped_draft()), "--verify-budget", "6")
    old = _generate("--draft", str(legacy), "--verify-budget", "6")
    assert old["token_ids"] == modern["token_ids"] and old["text"] == modern["text"]
    # the same proposals, not only the same (target-decided) tokens
    assert {k: old["stats"][k] for k in SPEC_KEYS} == {k: modern["stats"][k] for k in SPEC_KEYS}
    assert old["stats"]["draft_steps"] > 0


def test_legacy_draft_without_a_mask_id_is_one_line(legacy, tmp_path, capsys):
    bad = tmp_path / "nomask.gguf"
    rewrite(legacy, bad, Rules(delete=[f"{LEGACY}.dflash.mask_token_id"]))
    assert main(["generate", "--prompt", "x", "--max-tokens", "2", "--draft", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "nomask.gguf: no mask token id" in err and len(err.strip().splitlines()) == 1, err


def test_legacy_draft_with_modern_tensor_names_takes_its_vocabulary_from_the_markov_table(legacy, tmp_path):
    """A legacy file whose tensors already carry the modern names and whose metadata has no
    vocab_size: the vocabulary is the Markov table's width, and it loads as the modern drafter."""
    modern_names = tmp_path / "modern-names.gguf"
    renames = [(re.compile("^" + re.escape(old) + "$"), new) for old, new in LEGACY_TENSORS.items()]
    rewrite(legacy, modern_names, Rules(rename_tensors=renames, delete=[f"{LEGACY}.vocab_size"]))
    f = GGUFFile.open(modern_names)
    try:
        names = {t.name for t in f.tensors}
        assert f"{LEGACY}.vocab_size" not in f.kv and "markov_w1.weight" in names
        assert not names & set(LEGACY_TENSORS)
    finally:
        f.close()
    with load_model(shipped_draft()) as modern, load_model(modern_names) as old:
        assert old.model.cfg == modern.model.cfg
        a, b = dict(old.model.draft.named_parameters()), dict(modern.model.draft.named_parameters())
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
