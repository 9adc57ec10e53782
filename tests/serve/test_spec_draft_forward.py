"""The server drafting for many sequences in one draft forward (shipped mini K3 + its drafter)."""

from __future__ import annotations

from scheduling import ar_tokens, serve_and_close, serve_together

from k3kit.runtime.sampling import make_sampling
from k3kit.runtime.speculative.schedule import DraftGuard
from k3kit.serve.batch import BatchScheduler
from k3kit.serve.scheduler import GenerationRequest


def _requests(codec):
    texts = ["import os", "def add(a, b):", "class Foo:", "x = [", "import os", "import os"]
    samp = [(0.0, 1), (0.0, 1), (0.0, 1), (0.0, 1), (1.0, 7), (0.8, 8)]
    return [GenerationRequest(prompt_ids=tuple(codec.encode(t)), max_tokens=16,
                              sampling=make_sampling(temp, 1.0, 0, seed))
            for t, (temp, seed) in zip(texts, samp, strict=True)]


def test_one_draft_forward_per_pass_keeps_every_output(spec_session, monkeypatch, spec_factory):
    """Four greedy and two seeded sampled requests served together: the drafts of several sequences
    run as one forward; the greedy outputs are the AR outputs, and the sampled ones are exactly what
    the same requests get when every sequence drafts by itself (the serial draft step)."""
    import k3kit.serve.batch as batch

    model, codec, draft = spec_session.model, spec_session.codec, spec_session.draft_model
    reqs = _requests(codec)
    ref = ar_tokens(spec_session, reqs[:4])

    sizes: list[int] = []
    real = draft.draft_blocks
    monkeypatch.setattr(draft, "draft_blocks", lambda c, a, p: sizes.append(len(a)) or real(c, a, p))
    sp = BatchScheduler(model, codec, max_batch=64, max_queue=16, step_factory=spec_factory,
                        guard=DraftGuard(judge=False))      # drafts whatever the machine's pass times
    try:
        together = serve_together(sp, reqs)
        assert sp.stats().spec_accepted > 0
    finally:
        sp.close()
    assert together[:4] == ref and max(sizes) >= 4

    monkeypatch.setattr(batch, "batchable", lambda decs: False)           # the sampled blocks' path
    monkeypatch.setattr("k3kit.runtime.speculative.decoder.batchable", lambda decs: False)
    sizes.clear()
    sp = BatchScheduler(model, codec, max_batch=64, max_queue=16, step_factory=spec_factory)
    alone, _ = serve_and_close(sp, reqs)
    assert not sizes and alone[:4] == ref
    assert alone[4:] == together[4:] and alone[4] != alone[5]
    assert model.sequences == 0 and draft.contexts == 0
