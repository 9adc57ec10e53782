"""The draft's block step (k3kit.models.dflash.block_step) against DSparkDraft.forward: the same
hidden rows, bit for bit, over the context a DSpark generation left; and what it leaves to forward."""

from __future__ import annotations

import pytest
import torch

from k3kit.adapters.session import open_session
from k3kit.mini.paths import shipped_draft, shipped_gguf
from k3kit.models.dflash import block_step
from k3kit.runtime.engine import generate
from k3kit.runtime.loader import LoadOptions
from k3kit.runtime.sampling import make_sampling
from k3kit.runtime.speculative import ScheduleConfig, SpeculativeDecoder


@pytest.fixture(scope="module")
def session():
    with open_session(shipped_gguf(), LoadOptions(expert_cache_mib=1024), draft=shipped_draft()) as s:
        yield s


def _decode(s, prompt: str, n: int) -> list[int]:
    sampling = make_sampling(0.0, seed=0)

    def spec(model, sampler):
        return SpeculativeDecoder(model, s.draft_model, sampler.sampling, sampler.generator,
                                  schedule=ScheduleConfig())
    s.model.reset()
    return generate(s.model, s.codec.encode(prompt), max_tokens=n, sampling=sampling, step=spec).token_ids


@pytest.mark.parametrize("threads", [1, 2])
def test_a_block_has_the_forward_bits(session, threads):
    torch.set_num_threads(threads)
    try:
        drafter = session.draft_model
        step = drafter.block_step()
        assert step is not None, drafter.block_step_note
        calls = []
        run = step.run
        step.run = lambda *a: calls.append(1) or run(*a)  # type: ignore[method-assign]
        try:
            with torch.no_grad():
                _decode(session, "def fibonacci(n):\n    if n < 2:", 24)
                assert calls                                   # the generation drafted through it
                ctx = drafter.context()
                assert ctx is not None and ctx[0][0].shape[0] > 0
                b, position = drafter.block_size, drafter.context_span[1]
                for anchor in (5, 77, 1000):
                    pos = torch.arange(position, position + b)
                    x = drafter.draft.block_embed([anchor], b)[0]
                    ref = drafter.draft(None, pos, ctx, span=(position, position + b), x=x)
                    got = run(x, pos, ctx, (position, position + b))
                    assert got is not None and torch.equal(got, ref)
                    got0 = run(x, pos, None, (position, position + b))          # no context rows
                    ref0 = drafter.draft(None, pos, None, span=(position, position + b), x=x)
                    assert torch.equal(got0, ref0)
        finally:
            del step.run
    finally:
        torch.set_num_threads(1)


@pytest.mark.parametrize("threads", [1, 2])
def test_context_rows_have_the_module_bits(session, threads):
    """A sync's context K/V through the block step equals DSparkDraft.context_kv's, bit for bit:
    a step's few new rows and a prompt chunk's many, from the ring's float16 taps."""
    torch.set_num_threads(threads)
    try:
        drafter = session.draft_model
        step = drafter.block_step()
        assert step is not None and step.fc is not None, "the shipped drafter's fc is native"
        g = torch.Generator().manual_seed(threads)
        width = drafter.draft.fc.in_features
        with torch.no_grad():
            for n, start in ((1, 0), (6, 40), (200, 1000)):
                taps = (torch.randn(n, width, generator=g) * 3).to(torch.float16)
                pos = torch.arange(start, start + n)
                got = step.context_kv(taps, pos, (start, start + n))
                ref = drafter.draft.context_kv(taps, pos, span=(start, start + n))
                assert got is not None and len(got) == len(ref)
                for (k, v), (rk, rv) in zip(got, ref, strict=True):
                    assert torch.equal(k, rk) and torch.equal(v, rv)
            with torch.enable_grad():
                assert step.context_kv(taps, pos, (start, start + n)) is None
            handle = drafter.draft.fc.register_forward_hook(lambda m, i, o: o)
            try:
                assert step.context_kv(taps, pos, (start, start + n)) is None      # forward's calls
            finally:
                handle.remove()
    finally:
        torch.set_num_threads(1)


def test_what_the_block_step_leaves_to_forward(session, monkeypatch, one_thread):
    drafter = session.draft_model
    step = drafter.block_step()
    assert step is not None
    b = drafter.block_size
    x = drafter.draft.block_embed([3], b)[0]
    pos = torch.arange(10, 10 + b)
    with torch.enable_grad():
        assert step.run(x, pos, None, (10, 10 + b)) is None
    with torch.no_grad():
        handle = drafter.draft.norm.register_forward_hook(lambda m, i, o: o)
        try:
            assert step.run(x, pos, None, (10, 10 + b)) is None                 # a hook: forward's calls
        finally:
            handle.remove()
        assert step.run(x, pos, None, (10, 10 + b)) is not None
        with step.lock:
            assert step.run(x, pos, None, (10, 10 + b)) is None
    monkeypatch.setattr(block_step, "ENABLED", False)
    assert block_step.BlockStep.build(drafter.draft) == (None, "turned off")


def test_dspark_with_and_without_the_steps_gives_the_same_tokens(session, monkeypatch, one_thread):
    with torch.no_grad():
        fast = _decode(session, "import os\nimport", 40)
        drafter = session.draft_model
        monkeypatch.setattr(drafter, "_block_step", None)
        monkeypatch.setattr(session.model, "_row_steps", {False: None, True: None})
        slow = _decode(session, "import os\nimport", 40)
    assert fast == slow


def test_loading_the_target_and_its_drafter_does_not_import_dynamo():
    """Building the models on the meta device (nn.Embedding's init, a rope table) went through
    torch._refs, whose first use imports torch._dynamo: 1.5 s of every `generate --draft`."""
    import subprocess
    import sys
    code = ("import sys\nfrom k3kit.adapters.session import open_session\n"
            "from k3kit.runtime.loader import LoadOptions\nfrom k3kit.mini import paths\n"
            "with open_session(paths.shipped_gguf(), LoadOptions(), draft=paths.shipped_draft()):\n"
            "    pass\nprint('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"
