"""DSpark speculative decoding on the shipped mini K3 (GGUF target + shipped drafter GGUF).

* Exactness: greedy DSpark output equals plain autoregressive output token for token, 30
  prompts x 96 tokens, every block size 1..7, fixed and cost-aware verify budgets, confidence
  trimming, every feature-ring storage, and expert caches from all-resident to a few experts.
* ReplaySSM: after every pass the committed KDA recurrent and conv state (and the MLA caches)
  equal those of an AR run over the same committed tokens to 1e-5 relative (float32; never
  bitwise, since a verify batch and single rows sum in different orders; measured worst
  4.5e-7), and no pass needed a full replay.
  The fallbacks (full replay, rebuild from history) give the same state when forced.
* Sampling: with temperature > 0 the joint distribution of the first three tokens matches the
  exact AR distribution enumerated from the target (chi-square, p = 0.001); a broken
  acceptance rule fails the same test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from chi2 import chi2, chi2_critical  # noqa: E402
from engine_models import tiny_gguf  # noqa: E402

import k3kit.runtime.speculative.decoder as decoder_mod  # noqa: E402
from k3kit.adapters import load_model  # noqa: E402
from k3kit.errors import K3Error  # noqa: E402
from k3kit.mini.corpus import build_corpus  # noqa: E402
from k3kit.mini.paths import shipped_draft, shipped_gguf  # noqa: E402
from k3kit.models.kimi_k3.state import KDAState  # noqa: E402
from k3kit.runtime.engine import generate  # noqa: E402
from k3kit.runtime.loader import LoadOptions  # noqa: E402
from k3kit.runtime.sampling import make_sampling  # noqa: E402
from k3kit.runtime.speculative import (  # noqa: E402
    Sampling,
    ScheduleConfig,
    SpeculativeDecoder,
    probs,
    speculative_generate,
)
from k3kit.runtime.speculative.sampling import sample  # noqa: E402
from k3kit.tokenizer.codec import TextCodec  # noqa: E402

N_PROMPTS, PROMPT_LEN, N_TOKENS = 30, 40, 96
STATE_ATOL = 1e-5        # relative; measured worst 4.5e-7 (a verify batch vs single rows: summation order)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here runs torch on one thread (tests/conftest.py)."""


@pytest.fixture(scope="module")
def mini():
    """(target adapter, draft adapter attached to it, prompts as token ids)."""
    target = load_model(shipped_gguf(), LoadOptions(expert_cache_mib=256)).model
    draft = load_model(shipped_draft()).model
    draft.attach(target)
    codec = TextCodec(target.source.raw_kv, str(shipped_gguf()))
    prompts: list[list[int]] = []
    for doc in build_corpus().heldout_docs:      # held-out stdlib files, up to two cuts each
        ids = codec.encode(doc)
        prompts += [ids[s:s + PROMPT_LEN] for s in range(0, len(ids) - PROMPT_LEN, 997)][:2]
        if len(prompts) >= N_PROMPTS:
            break
    assert len(prompts) >= N_PROMPTS
    yield target, draft, prompts[:N_PROMPTS]
    draft.close()
    target.close()


def _cache_sizes(target) -> dict[str, float]:
    """Expert cache budgets (MiB of dequantized experts): everything, a quarter, and room for
    one expert per MoE layer."""
    store = target.store
    one = {il: sum(w.nbytes for w in store.get(il, [0])[0]) for il in store.layers}
    total = sum(one[il] * store.n_experts(il) for il in store.layers)
    mib = float(1 << 20)
    return {"all": total * 1.01 / mib, "quarter": total / 4 / mib, "one_per_layer": sum(one.values()) / mib}


def _spec_step(draft, block: int | None, schedule: ScheduleConfig, ring: str = "f16"):
    draft.set_block_size(block)

    def build(model, sampler):
        return SpeculativeDecoder(model, draft, sampler.sampling, sampler.generator, schedule=schedule,
                                  ring_storage=ring)
    return build


def test_greedy_dspark_equals_ar_on_the_mini_model(mini):
    target, draft, prompts = mini
    caches = _cache_sizes(target)
    greedy = make_sampling(0.0, seed=0)
    budgets = [None, 1, 2, 4, "full"]
    rings = ["f16", "bf16", "q8", "f32"]
    seen_blocks, seen_budgets, seen_caches = set(), set(), set()
    committed, passes, full_replays, fast = 0, 0, 0, 0
    for i, p in enumerate(prompts):
        target.reset_expert_cache(caches["all"])
        ar = generate(target, p, max_tokens=N_TOKENS, sampling=greedy)
        block = 1 + i % 7
        budget = budgets[i % 5]
        cache = list(caches)[i % 3]
        sched = ScheduleConfig(budget=block + 1 if budget == "full" else budget,
                               threshold=0.3 if i % 4 == 3 else 0.0)
        target.reset_expert_cache(caches[cache])
        before = target.counters()
        sp = generate(target, p, max_tokens=N_TOKENS, sampling=greedy,
                      step=_spec_step(draft, block, sched, rings[i % 4]))
        assert sp.token_ids == ar.token_ids, (i, block, budget, cache)
        s = sp.stats.speculative
        assert s["verify_rows"] <= s["target_passes"] * (block + 1)
        after = target.counters()
        full_replays += after["replay_full_replays"] - before["replay_full_replays"]
        fast += after["replay_fast_commits"] - before["replay_fast_commits"]
        committed += len(sp.token_ids) - 1
        passes += s["target_passes"]
        seen_blocks.add(block)
        seen_budgets.add(budget)
        seen_caches.add(cache)
        if cache == "one_per_layer":
            assert sp.stats.expert_misses > 0 and sp.stats.payload_bytes > 0
    assert seen_blocks == set(range(1, 8)) and len(seen_budgets) == 5 and len(seen_caches) == 3
    # every verified block commits by ReplaySSM's fast path (one-row passes commit as plain steps)
    assert full_replays == 0 and fast > passes / 2
    assert committed / passes > 1.5          # the drafter really drafts: passes commit several tokens
    draft.set_block_size(None)


def _kda_and_mla(adapter) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
    out = []
    for il, layer in enumerate(adapter.state.layers):
        if isinstance(layer, KDAState):
            out.append((f"kda{il}", layer.S, layer.conv))
        else:
            kv, pe = layer.view()
            out.append((f"mla{il}", kv[:, :adapter.position], pe[:, :adapter.position]))
    return out


def _assert_same_state(a, b, where: str) -> None:
    assert a.position == b.position, where
    for (name, x1, x2), (_, y1, y2) in zip(_kda_and_mla(a), _kda_and_mla(b), strict=True):
        for x, y in ((x1, y1), (x2, y2)):
            assert x.shape == y.shape, (where, name)
            err = (x - y).abs().max().item() if x.numel() else 0.0
            assert err <= STATE_ATOL * max(1.0, y.abs().max().item()), (where, name, err)


def test_replay_ssm_commits_what_ar_would_have(mini):
    target, draft, prompts = mini
    ar = load_model(shipped_gguf(), LoadOptions(expert_cache_mib=256)).model
    target.reset_expert_cache(256)
    try:
        for p in prompts[:3]:
            target.reset()
            ar.reset()
            gen = torch.Generator().manual_seed(0)
            dec = SpeculativeDecoder(target, draft, Sampling(), gen, schedule=ScheduleConfig(budget=8))
            last = dec.prefill(p)[-1]
            ar.forward(p)
            _assert_same_state(target, ar, "prefill")
            tokens = [int(torch.argmax(last))]
            fast0 = target.replay_fast_commits
            while len(tokens) < 64:
                anchor = tokens[-1]
                new = dec.step(anchor, 64 - len(tokens))
                for t in [anchor, *new[:-1]]:            # what this pass committed, one row at a time
                    ar.forward([t])
                _assert_same_state(target, ar, f"after {len(tokens)} tokens")
                tokens += new
            st = dec.finish()
            assert st.target_counters["replay_full_replays"] == 0
            assert st.target_counters["replay_failed_fallbacks"] == 0
            # one fast commit per verified block (a one-row pass commits as a plain step)
            assert target.replay_fast_commits - fast0 == sum(w > 1 for w in st.verify_rows)
            assert max(st.committed_per_pass) > 1
    finally:
        ar.close()


def test_replay_fallbacks_reach_the_same_state(mini, monkeypatch):
    target, _, prompts = mini
    ar = load_model(shipped_gguf(), LoadOptions(expert_cache_mib=256)).model
    try:
        p, rows = prompts[0][:20], prompts[1][:6]
        ar.forward(p + rows[:4])
        # a capture that does not fit the state (a KDA layer's rows lost): full replay
        target.reset()
        target.forward(p)
        target.verify(rows)
        kda_layer = next(il for il, s in enumerate(target.state.layers) if isinstance(s, KDAState))
        del target._pending.captured.kda[kda_layer]
        full0 = target.replay_full_replays
        target.commit(4)
        assert target.replay_full_replays == full0 + 1
        _assert_same_state(target, ar, "full replay")
        # the full replay fails as well: the state is rebuilt from the committed history
        target.reset()
        target.forward(p)
        target.verify(rows)
        target._pending.captured.start_pos += 1
        real = target.model.forward
        calls = []

        def failing_once(*args, **kw):
            if not calls:
                calls.append(1)
                raise RuntimeError("simulated failure")
            return real(*args, **kw)

        monkeypatch.setattr(target.model, "forward", failing_once)
        failed0 = target.replay_failed_fallbacks
        target.commit(4)
        monkeypatch.undo()
        assert target.replay_failed_fallbacks == failed0 + 1
        _assert_same_state(target, ar, "rebuild")
        assert target.history == p + rows[:4]
    finally:
        ar.close()


def _exact_first3(target, prompt: list[int], s: Sampling) -> dict:
    """P(t1, t2, t3) of plain sampling, enumerated over the top-k support with real forwards."""
    def dist(ids: list[int]) -> torch.Tensor:
        target.reset()
        return probs(target.forward(ids)[-1], s)

    out = {}
    p0 = dist(prompt)
    for a in torch.nonzero(p0).flatten().tolist():
        p1 = dist(prompt + [a])
        for b in torch.nonzero(p1).flatten().tolist():
            p2 = dist(prompt + [a, b])
            for c in torch.nonzero(p2).flatten().tolist():
                out[(a, b, c)] = (p0[a] * p1[b] * p2[c]).item()
    return out


def _sample_first3(target, draft, prompt: list[int], s: Sampling, n: int) -> tuple[dict, list[int]]:
    counts: dict = {}
    hist = [0] * (draft.n_proposals + 1)
    for seed in range(n):
        target.reset()
        r = speculative_generate(target, draft, prompt, 3, Sampling(s.temperature, s.top_k, s.top_p, seed),
                                 schedule=ScheduleConfig(budget=3), ring_capacity=64)
        counts[tuple(r.tokens)] = counts.get(tuple(r.tokens), 0) + 1
        hist = [a + b for a, b in zip(hist, r.stats.acceptance_histogram, strict=True)]
    return counts, hist


def test_sampled_dspark_has_the_ar_distribution(mini, monkeypatch):
    target, draft, prompts = mini
    draft.set_block_size(None)
    prompt = prompts[2][:16]
    s = Sampling(temperature=1.0, top_k=4)
    exact = _exact_first3(target, prompt, s)
    assert abs(sum(exact.values()) - 1) < 1e-6
    n = 400
    counts, hist = _sample_first3(target, draft, prompt, s, n)
    stat, df = chi2(counts, exact, n)
    assert stat < chi2_critical(df), (stat, df)
    assert hist[0] > 0 and sum(hist[1:]) > 0       # both rejections and acceptances happened

    # teeth: accepting every proposal is visibly not the target's distribution
    def accept_all(proposals, q, p, gen):
        return len(proposals), sample(p[len(proposals)], gen)

    monkeypatch.setattr(decoder_mod, "accept_sampled", accept_all)
    bad, _ = _sample_first3(target, draft, prompt, s, n)
    stat, df = chi2(bad, exact, n)
    assert stat > chi2_critical(df), (stat, df)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3kit.cli", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_cli_draft_json_equals_plain_and_reports_speculative_stats():
    args = ["generate", "--prompt", "import os\nimport sys\n\ndef main(", "--max-tokens", "40", "--json"]
    plain = _cli(*args)
    assert plain.returncode == 0, plain.stderr
    spec = _cli(*args, "--draft", "default", "--block-size", "5", "--verify-budget", "auto")
    assert spec.returncode == 0, spec.stderr
    a, b = json.loads(plain.stdout), json.loads(spec.stdout)
    assert b["token_ids"] == a["token_ids"] and b["text"] == a["text"]
    s = b["stats"]
    for key in ("target_passes", "draft_steps", "committed_per_pass", "acceptance_histogram", "verify_rows",
                "replay_fast_commits", "replay_full_replays", "replay_failed_fallbacks"):
        assert key in s, key
    assert "target_passes" not in a["stats"]
    n = s["generated_tokens"]
    assert len(s["acceptance_histogram"]) == 6 and sum(s["acceptance_histogram"]) == s["target_passes"]
    assert s["committed_per_pass"] == pytest.approx((n - 1) / s["target_passes"])
    assert s["target_passes"] <= s["verify_rows"] <= 6 * s["target_passes"]
    # verified blocks commit by ReplaySSM's fast path, one-row passes as plain steps
    assert 0 < s["replay_fast_commits"] <= s["target_passes"] and s["replay_full_replays"] == 0
    # streamed with --stats: same text, the speculative line on stderr
    st = _cli(*args[:-1], "--stats", "--draft", "default", "--verify-budget", "3")
    assert st.returncode == 0, st.stderr
    assert st.stdout == a["text"] + "\n"
    assert "tokens committed per pass" in st.stderr and "0 full replays" in st.stderr


def test_cli_draft_errors_are_one_line(tmp_path, capsys):
    from k3kit.cli import main

    base = ["generate", "--prompt", "x", "--max-tokens", "4"]
    cases = [
        (["--block-size", "3"], "--block-size needs --draft"),
        (["--draft", "default", "--block-size", "9"], "--block-size 9 must be in 1..7"),
        (["--draft", "default", "--verify-budget", "wide"], "--verify-budget"),
        (["--draft", "default", "--confidence-threshold", "2"], "--confidence-threshold"),
        (["--draft", str(shipped_gguf())], "is not a draft"),
        (["--draft", str(tmp_path / "missing.gguf")], "missing.gguf"),
    ]
    for extra, msg in cases:
        assert main([*base, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1, (extra, err)


def test_draft_that_does_not_fit_the_target_is_refused(tmp_path):
    """A draft made for another target (other depth or width) is refused, naming the draft file."""
    path, _ = tiny_gguf(tmp_path)
    target = load_model(path, LoadOptions(expert_cache_mib=0)).model
    draft = load_model(shipped_draft()).model
    try:
        want = r"mini-k3-draft\.gguf: draft (taps target layers|reads target features)"
        with pytest.raises(K3Error, match=want):
            draft.attach(target)
    finally:
        draft.close()
        target.close()


def test_verify_rows_have_the_bits_of_ar_rows(mini):
    """A verify block's logits are, row for row, the bits of one-row AR steps over the same tokens
    (attention runs a block's rows as decode rows; in ggml's arithmetic one last bit can move an
    int8 rounding of a later product, which is what made the block and AR part before)."""
    target, _, prompts = mini
    ar = load_model(shipped_gguf(), LoadOptions(expert_cache_mib=256)).model
    try:
        # AR's own continuations (a draft that is right), prompts' tokens (one that is wrong), and
        # the shipped drafter's second block after prompts[2], where they used to part at row 1
        blocks = [(2, [606, 329, 390, 62, 198, 738, 329, 390])]
        for i, p in enumerate(prompts[:8]):
            ar.reset()
            rows = [int(torch.argmax(ar.forward(p)[-1]))]
            for _ in range(7):
                rows.append(int(torch.argmax(ar.forward([rows[-1]])[-1])))
            blocks += [(i, rows), (i, prompts[i + 1][:8])]
        for i, rows in blocks:
            target.reset()
            ar.reset()
            target.forward(prompts[i])
            ar.forward(prompts[i])
            block = target.verify(rows, capture=False).logits
            target.commit(0)
            single = torch.stack([ar.forward([r], all_logits=True)[-1] for r in rows])
            assert torch.equal(block, single), (i, rows)
    finally:
        ar.close()
