"""The one-row decode step (k3kit.models.kimi_k3.row_step) against K3Model.forward: the same
logits and the same state, bit for bit, step after step; and what it leaves to forward."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "convert"))
from engine_models import prompts  # noqa: E402
from k3_checkpoint import write_checkpoint  # noqa: E402

from k3kit.adapters import load_model  # noqa: E402
from k3kit.convert.target import convert_target  # noqa: E402
from k3kit.mini.paths import shipped_gguf  # noqa: E402
from k3kit.models.kimi_k3 import row_step  # noqa: E402
from k3kit.models.kimi_k3.state import K3State, KDAState  # noqa: E402
from k3kit.runtime.loader import LoadOptions  # noqa: E402


def _same_state(a: K3State, b: K3State) -> None:
    assert a.pos == b.pos
    for il, (x, y) in enumerate(zip(a.layers, b.layers, strict=True)):
        if isinstance(x, KDAState):
            assert isinstance(y, KDAState)
            assert torch.equal(x.S, y.S) and torch.equal(x.conv, y.conv), f"layer {il}"
        else:
            assert x.length == y.length and torch.equal(x.keys(), y.keys()), f"layer {il}"


@torch.no_grad()
def _check_steps(adapter, prompt: list[int], n: int, verify_at: int = -1) -> list[int]:
    """Greedy decode `n` tokens through the adapter (its row step), each step checked against
    K3Model.forward on a copy of the state before it; at step `verify_at`, a verify of 3 rows
    and a commit of 1 first (speculative MLA rows for the next row to drop)."""
    out = adapter.forward(prompt)
    tok = int(out[-1].argmax())
    made = []
    for i in range(n):
        if i == verify_at:  # `tok` committed by a verify pass, the next row any token
            adapter.verify(
                [tok, (tok + 1) % adapter.vocab_size, (tok + 2) % adapter.vocab_size], capture=False
            )
            adapter.commit(1)
            made.append(tok)
            tok = (tok + 5) % adapter.vocab_size
        ref_state = adapter.state.clone()
        ref = adapter.model(torch.tensor([[tok]]), ref_state, experts=adapter.experts, logits="last").logits[
            0
        ]
        got = adapter.forward([tok])
        assert got.shape == ref.shape and torch.equal(got, ref), f"step {i}"
        _same_state(adapter.state, ref_state)
        made.append(tok)
        tok = int(got[-1].argmax())
    return made


@torch.no_grad()
def _check_verify(adapter, block: list[int], taps: tuple[int, ...], mode: str, n_commit: int) -> None:
    """A verify pass through the row step against forward(speculative=True) on a copy of the state:
    logits, features, the rows kept for the commit and the state; then the commit of `n_commit`."""
    adapter.set_taps(taps, mode)
    ref_state = adapter.state.clone()
    ref = adapter.model(
        torch.tensor([block]),
        ref_state,
        experts=adapter.experts,
        capture_layers=taps,
        capture_mode=mode,
        speculative=True,
        logits="all",
    )
    got = adapter.verify(block, capture=True)
    assert torch.equal(got.logits, ref.logits[0])
    assert torch.equal(got.taps, torch.cat([ref.layer_inputs[il][0] for il in taps], dim=-1))
    pending = adapter._pending.captured
    assert set(pending.kda) == set(ref.captured.kda) and pending.start_pos == ref.captured.start_pos
    for il, rows in ref.captured.kda.items():
        for name in ("conv_in", "k", "v", "g", "beta", "final"):
            assert torch.equal(getattr(pending.kda[il], name), getattr(rows, name)), (il, name)
    _same_state(adapter.state, ref_state)
    adapter.commit(n_commit)


@torch.no_grad()
def _check_segment(adapter, sid: int, ids: list[int], verify: bool, capture: bool) -> None:
    """A serving pass of one sequence (verify_batch: the row step in forward_segments' arithmetic)
    against forward_segments on a copy of its state."""
    state = adapter._state_of(sid)
    ref_state = state.clone()
    ref = adapter.model.forward_segments(
        [(torch.tensor(ids), ref_state)], experts=adapter.experts, speculative=[verify and len(ids) > 1],
        capture=[capture], capture_layers=adapter.tap_layers, capture_mode=adapter.capture_mode)[0]
    got = adapter.verify_batch([(sid, ids)], verify={sid} if verify else (),
                               capture={sid} if capture else ())[0]
    assert torch.equal(got.logits, ref.logits)
    if capture:
        assert torch.equal(got.taps, ref.taps)
    _same_state(state, ref_state)
    if verify and len(ids) > 1:
        pending = adapter._seq_pending[sid].captured
        for il, rows in ref.captured.kda.items():
            for name in ("conv_in", "k", "v", "g", "beta", "final"):
                assert torch.equal(getattr(pending.kda[il], name), getattr(rows, name)), (il, name)


def test_a_serving_pass_of_one_sequence_has_forward_segments_bits(variants, one_thread):
    for path in (shipped_gguf(), variants["full"], variants["plain"]):
        adapter = load_model(path, LoadOptions(expert_cache_mib=1024)).model
        try:
            adapter.set_taps((0, 2, adapter.num_layers), "mixed")
            calls: list[int] = []
            step = adapter.row_step(segments=True)
            assert step is not None and step is not adapter.row_step()
            one, rows = step._run_one, step._run
            step._run_one = lambda *a, f=one, c=calls: c.append(1) or f(*a)  # type: ignore[method-assign]
            step._run = lambda *a, f=rows, c=calls: c.append(1) or f(*a)  # type: ignore[method-assign]
            sid = adapter.open_sequence()
            ids = prompts(1, 90, seed=8, lo=12, hi=12)[0]
            _check_segment(adapter, sid, ids, verify=False, capture=True)         # a prompt's chunk
            for t in ids[:4]:
                _check_segment(adapter, sid, [t], verify=False, capture=False)    # decode rows
            _check_segment(adapter, sid, ids[3:9], verify=True, capture=True)     # a verify block
            adapter.commit_sequence(sid, 4)
            _check_segment(adapter, sid, [ids[0]], verify=True, capture=True)     # a one-row block
            _check_segment(adapter, sid, ids[:3], verify=True, capture=False)
            adapter.commit_sequence(sid, 3)
            _check_segment(adapter, sid, [ids[5]], verify=False, capture=False)
            assert len(calls) == 9
        finally:
            adapter.close()


@torch.no_grad()
def _check_pass(adapter, ids: dict[int, list[int]], verify: set[int], capture: set[int]) -> None:
    """A serving pass of several sequences (verify_batch: the row step's `run_segments`) against
    forward_segments on copies of their states: logits, tap features, the rows a verify block
    keeps for its commit, and the states."""
    sids = list(ids)
    states = [adapter._state_of(s) for s in sids]
    copies = [st.clone() for st in states]
    spec = [s in verify and len(ids[s]) > 1 for s in sids]
    ref = adapter.model.forward_segments(
        [(torch.tensor(ids[s]), c) for s, c in zip(sids, copies, strict=True)], experts=adapter.experts,
        speculative=spec, capture=[s in capture for s in sids], capture_layers=adapter.tap_layers,
        capture_mode=adapter.capture_mode)
    got = adapter.verify_batch([(s, ids[s]) for s in sids], verify=verify, capture=capture)
    for s, g, r, st, c, sp in zip(sids, got, ref, states, copies, spec, strict=True):
        assert torch.equal(g.logits, r.logits), f"sequence {s}"
        if s in capture:
            assert torch.equal(g.taps, r.taps), f"sequence {s}"
        else:
            assert g.taps is None
        _same_state(st, c)
        if sp:
            pending = adapter._seq_pending[s].captured
            for il, rows in r.captured.kda.items():
                for name in ("conv_in", "k", "v", "g", "beta", "final"):
                    assert torch.equal(getattr(pending.kda[il], name), getattr(rows, name)), (s, il, name)


def test_a_serving_pass_of_several_sequences_has_forward_segments_bits(variants, one_thread):
    """Sequences at different positions in one pass through `RowStep.run_segments`: decoding rows
    (the KDA states stepped as one batch, MLA's head products over all rows), verify blocks and
    prompt chunks, mixed; the bits of forward_segments pass after pass, commits between."""
    for path in (shipped_gguf(), variants["full"], variants["plain"]):
        adapter = load_model(path, LoadOptions(expert_cache_mib=1024)).model
        try:
            adapter.set_taps((0, 2, adapter.num_layers), "mixed")
            step = adapter.row_step(segments=True)
            assert step is not None
            calls: list[int] = []
            run = step._run_segments
            step._run_segments = lambda *a, f=run, c=calls: c.append(1) or f(*a)  # type: ignore[method-assign]
            sids = [adapter.open_sequence() for _ in range(4)]
            texts = prompts(4, 90, seed=3, lo=9, hi=14)
            adapter.verify_batch([(sids[0], texts[0][:5])])                       # one sequence: segment()
            _check_pass(adapter, {sids[1]: texts[1][:6], sids[2]: texts[2][:9], sids[3]: texts[3][:4]},
                        set(), {sids[2]})                                            # prompt chunks
            toks = {sid: 7 + 11 * i for i, sid in enumerate(sids)}
            for n in range(6):
                live = sids[: 2 + n % 3]
                _check_pass(adapter, {s: [toks[s]] for s in live}, verify={live[0]} if n % 2 else set(),
                            capture=set(live[1:]) if n % 2 else set(live))          # decoding rows
                for s in live:          # a one-row verify block was committed by its pass
                    toks[s] = (toks[s] * 31 + 5) % adapter.vocab_size
            blocks = {sids[0]: [toks[sids[0]], 5, 9, 11], sids[1]: [toks[sids[1]]], sids[2]: [3, 4, 8],
                      sids[3]: [toks[sids[3]]]}
            _check_pass(adapter, blocks, verify={sids[0], sids[2]}, capture={sids[0], sids[1], sids[2]})
            adapter.commit_sequence(sids[0], 2)
            adapter.commit_sequence(sids[2], 3)
            _check_pass(adapter, {s: [toks[s]] for s in sids}, set(), set(sids))   # after the commits
            _check_pass(adapter, {sids[0]: [1, 2], sids[1]: texts[1][6:9], sids[3]: [6]}, {sids[0]}, set())
            adapter.commit_sequence(sids[0], 1)
            _check_pass(adapter, {s: [toks[s]] for s in sids}, set(), set())
            assert len(calls) == 11
        finally:
            adapter.close()


@pytest.mark.parametrize("threads", [1, 2])
def test_the_mini_decodes_the_same_bits_through_the_row_step(threads):
    torch.set_num_threads(threads)
    try:
        adapter = load_model(shipped_gguf(), LoadOptions(expert_cache_mib=1024)).model
        try:
            assert adapter.row_step() is not None, adapter.row_step_note
            calls: list[str] = []
            step = adapter.row_step()
            one, rows = step._run_one, step._run
            step._run_one = lambda *a: calls.append("one") or one(*a)  # type: ignore[method-assign]
            step._run = lambda *a: calls.append("rows") or rows(*a)  # type: ignore[method-assign]
            _check_steps(adapter, prompts(1, 4000, seed=3, lo=6, hi=12)[0], 24, verify_at=9)
            assert calls.count("one") >= 20 and "rows" in calls  # decode rows, the prompt and the verify
            block = prompts(1, 4000, seed=5, lo=9, hi=9)[0]
            _check_verify(adapter, block, (1, 3, 6), "raw", 9)  # every row accepted: rows.final
            _check_verify(adapter, block[:5], (0, 2, 4), "mixed", 2)
            _check_verify(adapter, block[:1], (1, 3, 6), "raw", 1)      # a plain pass of a DSpark decode
            _check_verify(adapter, block[1:2], (0, 6), "mixed", 0)
            _check_steps(adapter, [block[0]], 4)  # decoding on after the commits
        finally:
            adapter.close()
    finally:
        torch.set_num_threads(1)


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    """Q8_0 tiny K3s: every feature on (ff 32: SiTU runs per expert), and one with the options
    off (no q LoRA, softplus decay, no attn-res, no shared expert, no latent projections)."""
    out = {}
    for name, over in (
        ("full", {}),
        (
            "plain",
            dict(
                q_lora_rank=None,
                gate_lower_bound=None,
                attn_res_block_size=0,
                num_shared_experts=0,
                expert_latent_size=0,
                routed_expert_norm=False,
                routed_scaling_factor=1.0,
                moe_renormalize=False,
            ),
        ),
    ):
        d = tmp_path_factory.mktemp(f"row-{name}")
        write_checkpoint(d / "hf", seed=4, **over)
        path = d / "tiny.gguf"
        convert_target(d / "hf", path, "Q8_0")
        out[name] = path
    return out


@pytest.mark.parametrize("name", ["full", "plain"])
def test_tiny_models_decode_the_same_bits(variants, name, one_thread):
    adapter = load_model(variants[name], LoadOptions(expert_cache_mib=64)).model
    try:
        assert adapter.row_step() is not None, adapter.row_step_note
        _check_steps(adapter, prompts(1, 90, seed=1, lo=5, hi=9)[0], 16, verify_at=5)
        _check_verify(
            adapter, prompts(1, 90, seed=6, lo=20, hi=20)[0], (0, 2, 4), "mixed", 7
        )  # > ROWWISE_MAX
        _check_verify(adapter, [3, 4, 5], (1,), "raw", 3)
        _check_verify(adapter, [6], (0, 4), "mixed", 1)
    finally:
        adapter.close()


def test_experts_read_from_the_file_run_in_the_module(variants, one_thread):
    """No expert cache: take_resident never holds them all, each MoE layer runs run_experts."""
    adapter = load_model(variants["full"], LoadOptions(expert_cache_mib=0)).model
    try:
        assert adapter.row_step() is not None
        _check_steps(adapter, prompts(1, 90, seed=2, lo=4, hi=6)[0], 8)
    finally:
        adapter.close()


def test_what_the_row_step_leaves_to_forward(variants, one_thread, tmp_path):
    adapter = load_model(variants["full"], LoadOptions(expert_cache_mib=64)).model
    try:
        step = adapter.row_step()
        assert step is not None
        adapter.forward([1, 2, 3])
        pos = adapter.state.pos
        with torch.enable_grad():  # a gradient: forward's autograd graph
            assert step.run([5], adapter.state, adapter.experts) is None
        torch.set_grad_enabled(False)
        with step.lock:  # another thread inside: nothing done
            assert step.run([5], adapter.state, adapter.experts) is None
        assert step.run([adapter.vocab_size + 7], adapter.state, adapter.experts) is None
        adapter.model.set_ggml_q8_inputs(True)  # llama.cpp parity rounding: forward's hooks
        assert step.run([5], adapter.state, adapter.experts) is None
        adapter.model.set_ggml_q8_inputs(False)
        assert adapter.state.pos == pos
        assert step.run([5], adapter.state, adapter.experts) is not None and adapter.state.pos == pos + 1
        done = []

        def other() -> None:
            with torch.no_grad():
                done.append(step.run([6], adapter.state, adapter.experts))

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert done and done[0] is not None  # the lock was let go
    finally:
        torch.set_grad_enabled(True)
        adapter.close()
    f32 = tmp_path / "f32"
    write_checkpoint(f32 / "hf", seed=4)
    convert_target(f32 / "hf", f32 / "tiny.gguf", "F32")
    adapter = load_model(f32 / "tiny.gguf", LoadOptions(expert_cache_mib=64)).model
    try:
        assert adapter.row_step() is None and "quantized" in adapter.row_step_note  # F32 products: torch
    finally:
        adapter.close()


def test_turned_off_the_adapter_runs_forward(monkeypatch, variants, one_thread):
    monkeypatch.setattr(row_step, "ENABLED", False)
    adapter = load_model(variants["plain"], LoadOptions(expert_cache_mib=64)).model
    try:
        assert adapter.row_step() is None and adapter.row_step_note == "turned off"
        assert adapter.forward([1, 2]).shape == (1, adapter.vocab_size)
    finally:
        adapter.close()
