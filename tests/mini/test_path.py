"""`k3kit mini path`: absolute paths of the shipped artifacts, found through importlib.resources;
a missing artifact is a one-line error and exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3kit.cli import main
from k3kit.errors import K3Error
from k3kit.mini import paths


def _fake_assets(root: Path, gguf: bool = True, hf: bool = True, draft: bool = False) -> Path:
    d = root / "assets" / paths.MODEL_DIR
    d.mkdir(parents=True)
    if gguf:
        (d / paths.GGUF_NAME).write_bytes(b"GGUF")
    if hf:
        (d / paths.HF_NAME).mkdir()
        (d / paths.HF_NAME / "config.json").write_text("{}")
    if draft:
        (root / "assets" / paths.DRAFT_DIR).mkdir()
        (root / "assets" / paths.DRAFT_DIR / paths.DRAFT_GGUF_NAME).write_bytes(b"GGUF")
    return root / "assets"


def test_paths_printed_are_absolute_and_exist(tmp_path, monkeypatch, capsys):
    assets = _fake_assets(tmp_path, draft=True)
    monkeypatch.setattr(paths, "assets_dir", lambda: assets)
    for argv, want in ((["mini", "path"], assets / paths.MODEL_DIR / paths.GGUF_NAME),
                       (["mini", "path", "--hf"], assets / paths.MODEL_DIR / paths.HF_NAME),
                       (["mini", "path", "--draft"], assets / paths.DRAFT_DIR / paths.DRAFT_GGUF_NAME)):
        assert main(argv) == 0
        out = capsys.readouterr().out.strip()
        assert Path(out).is_absolute() and Path(out) == want.resolve()


@pytest.mark.parametrize("argv,what", [(["mini", "path", "--draft"], "drafter"),
                                       (["mini", "path"], "GGUF"), (["mini", "path", "--hf"], "HF")])
def test_missing_artifacts_are_user_errors(tmp_path, monkeypatch, capsys, argv, what):
    assets = _fake_assets(tmp_path, gguf=False, hf=False)
    monkeypatch.setattr(paths, "assets_dir", lambda: assets)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3kit: error: ") and what in err and len(err.strip().splitlines()) == 1


def test_hf_and_draft_are_exclusive(capsys):
    with pytest.raises(SystemExit) as e:
        main(["mini", "path", "--hf", "--draft"])
    assert e.value.code == 2


def test_the_real_assets_dir_is_inside_the_package():
    d = paths.assets_dir()
    assert d.parts[-2:] == ("mini", "assets")
    assert (d.parent / "train.py").is_file()


def test_shipped_mini_k3_if_present():
    """The shipped model: GGUF + HF folder with tokenizer; its card states the held-out numbers."""
    d = paths.assets_dir() / paths.MODEL_DIR
    if not (d / paths.HF_NAME).is_dir():
        pytest.skip("no shipped mini K3 in this tree")
    hf = paths.shipped_hf()
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["architectures"] == ["KimiK3ForConditionalGeneration"]
    assert (hf / "tokenizer.json").is_file() and (hf / "tokenizer_config.json").is_file()
    summary = json.loads((d / "summary.json").read_text())
    assert summary["heldout_ppl"] < summary["unigram_ppl"] / 4
    assert f"{summary['heldout_ppl']:.2f}" in (d / "MODEL_CARD.md").read_text()


@pytest.mark.parametrize("path, name", [(paths.shipped_gguf, "mini-k3"),
                                        (paths.shipped_draft, "mini-k3-draft")])
def test_shipped_ggufs_are_named_for_the_model(path, name):
    """general.name is what `k3kit serve` reports as the model id: the model's name, not `hf` (the
    checkpoint directory they were converted from)."""
    from k3kit.gguf.reader import GGUFFile
    assert GGUFFile.open(path()).kv["general.name"].value == name


def test_shipped_mini_declares_an_agent_context():
    """The shipped mini and its drafter declare the context the training settings give (>= 16384
    tokens: a long system prompt and several turns fit), as UINT32 like every GGUF context_length;
    the HF checkpoint and tokenizer say the same, and `k3kit serve` takes it as its --ctx bound."""
    from k3kit.gguf.reader import GGUFFile, GGUFValueType
    from k3kit.mini.train import CONTEXT_LENGTH, mini_config
    from k3kit.serve.server import serve_context

    target = GGUFFile.open(paths.shipped_gguf()).kv["kimi-k3.context_length"]
    draft = GGUFFile.open(paths.shipped_draft()).kv["dflash.context_length"]
    assert target.vtype == draft.vtype == GGUFValueType.UINT32
    ctx = target.value
    assert ctx >= 16384 and draft.value == ctx == CONTEXT_LENGTH == mini_config().max_position_embeddings
    hf = paths.shipped_hf()
    assert json.loads((hf / "config.json").read_text())["text_config"]["max_position_embeddings"] == ctx
    assert json.loads((hf / "tokenizer_config.json").read_text())["model_max_length"] == ctx
    draft_hf = paths.shipped_draft().parent / "hf" / "config.json"
    assert json.loads(draft_hf.read_text())["max_position_embeddings"] == ctx

    assert serve_context(ctx, None) == ctx
    assert serve_context(ctx, 16384) == 16384 and serve_context(ctx, 4096) == 4096
    with pytest.raises(K3Error, match=rf"--ctx {ctx + 1}: must be in \[1, {ctx}\]"):
        serve_context(ctx, ctx + 1)
