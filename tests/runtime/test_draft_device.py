"""`--draft-device`: the drafter placed apart from the target.

This machine has no GPU, so what runs here is: the CPU placement asked for explicitly gives the
same tokens and the same drafting as the default; bad devices are one-line errors that come
before anything is loaded; and the rows cross where they should, shown with torch's "meta"
device (tensors with shapes and no data): a draft placed there holds its weights and builds its
context K/V there from the target's features, and what it hands back lands on the target's side.
A real second device (CUDA) is not exercised by these tests.
"""

from __future__ import annotations

import json

import pytest
import torch

from k3kit.adapters import load_model
from k3kit.adapters.session import load_draft, open_session
from k3kit.cli import main
from k3kit.errors import K3Error
from k3kit.mini.paths import shipped_draft, shipped_gguf
from k3kit.runtime.loader import LoadOptions
from k3kit.runtime.speculative.feature_ring import FeatureRing

PROMPT = "import os\nimport sys\n\ndef main("
SPEC_KEYS = ("target_passes", "draft_steps", "committed_per_pass", "acceptance_histogram", "verify_rows")


def _generate(capsys, *extra: str) -> dict:
    rc = main(["generate", "--prompt", PROMPT, "--max-tokens", "24", "--json", *extra])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out)


def test_draft_on_cpu_asked_for_gives_the_same_tokens_and_drafting(capsys):
    """A fixed verify budget: `auto` widths and whether a pass drafts follow measured times, which
    differ run to run (the tokens do not)."""
    plain = _generate(capsys)
    default = _generate(capsys, "--draft", "default", "--verify-budget", "6")
    placed = _generate(capsys, "--draft", "default", "--draft-device", "cpu", "--verify-budget", "6")
    assert _generate(capsys, "--draft", "default", "--draft-device", "cpu")["token_ids"] == plain["token_ids"]
    assert placed["token_ids"] == default["token_ids"] == plain["token_ids"]
    assert {k: placed["stats"][k] for k in SPEC_KEYS} == {k: default["stats"][k] for k in SPEC_KEYS}
    assert placed["stats"]["draft_steps"] > 0


@pytest.mark.parametrize("extra, msg", [
    (["--draft", "default", "--draft-device", "gpu"], "--draft-device 'gpu': expected cpu, cuda or cuda:N"),
    (["--draft", "default", "--draft-device", "meta"], "--draft-device 'meta': expected cpu, cuda or cuda:N"),
    (["--draft", "default", "--draft-device", "cuda:x"], "--draft-device 'cuda:x'"),
    (["--draft-device", "cpu"], "--draft-device needs --draft"),
])
def test_bad_draft_device_is_one_line(capsys, extra, msg):
    assert main(["generate", "--prompt", "x", "--max-tokens", "2", *extra]) == 2
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine accepts the device")
def test_cuda_draft_device_without_cuda_is_one_line(capsys):
    assert main(["generate", "--prompt", "x", "--draft", "default", "--draft-device", "cuda:1"]) == 2
    err = capsys.readouterr().err
    assert "--draft-device 'cuda:1': CUDA is not available" in err and len(err.strip().splitlines()) == 1


def test_bad_draft_device_fails_before_the_target_loads(tmp_path):
    with pytest.raises(K3Error, match="--draft-device 'gpu'"):
        open_session(tmp_path / "missing.gguf", draft=shipped_draft(), draft_device="gpu")


def test_serve_has_the_flag(capsys):
    assert main(["serve", "--draft-device", "cpu", "--port", "0"]) == 2
    assert "--draft-device needs --draft" in capsys.readouterr().err


@pytest.fixture()
def target():
    t = load_model(shipped_gguf(), LoadOptions(expert_cache_mib=0))
    yield t
    t.close()


def test_placed_draft_holds_weights_and_context_on_its_device(target):
    """A float draft: "meta" holds shapes only, and a quantized matrix's product on a device
    without its kernels dequantizes its bytes there, which needs data."""
    draft = load_draft(shipped_draft(), LoadOptions(trunk="float"), target, device=torch.device("meta"))
    try:
        m = draft.model
        assert {p.device.type for p in m.draft.parameters()} == {"meta"}
        assert m.draft.rope_inv_freq.device.type == "meta"
        assert m.device.type == "meta" and m.home.type == "cpu"     # the target's side
        ring = FeatureRing(m.feature_width, storage="f32")
        ring.append(torch.randn(5, m.feature_width))                 # target features, on the CPU
        m.sync(ring)
        assert m.context_span == (0, 5)
        for k, v in m.context():
            assert k.device.type == v.device.type == "meta" and k.shape[0] == v.shape[0] == 5
    finally:
        draft.close()


def test_what_the_draft_hands_back_lands_on_the_targets_side(target):
    """The other direction: a draft on the CPU whose target side is (pretended to be) "meta"."""
    draft = load_draft(shipped_draft(), LoadOptions(), target)
    try:
        m = draft.model
        assert m.device.type == m.home.type == "cpu"
        ids = torch.tensor([3, 5])
        w1 = m.markov_embed(ids)
        hidden = torch.randn(2, m.cfg.hidden_size)
        m.home = torch.device("meta")
        assert m.markov_embed(ids).device.type == "meta"
        assert m.confidence(hidden, w1).device.type == "meta"
        assert m.markov_bias(w1).device.type == "meta"
    finally:
        draft.close()
