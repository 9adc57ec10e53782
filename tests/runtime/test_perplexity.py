"""`k3kit perplexity` and k3kit.runtime.perplexity: llama-perplexity's numbers, logits, KL from a base.

A toy CausalModel whose logits depend on the whole prefix (so chunk resets and the BOS that
replaces each chunk's first token show in the numbers) is held against a hand computation in
plain Python; the CLI runs on a tiny synthetic kimi-k3 GGUF. llama.cpp's --kl-divergence-base
files are written here by a port of perplexity.cpp's writer (log_softmax with uint16 log-probs).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from k3kit.cli import main
from k3kit.errors import K3Error
from k3kit.runtime.perplexity import LlamaBase, NpyBase, chunk_ids, evaluate, open_base, plan_chunks
from k3kit.runtime.protocols import CausalModel

V = 13
BOS = 12


class Toy:
    """Logits after a prefix: a row for its last token + one for (sum of the prefix), scaled by its length."""

    def __init__(self, seed: int = 0, vocab: int = V, context_length: int = 64) -> None:
        self.table = np.random.default_rng(seed).standard_normal((vocab, vocab)) * 2.0
        self.vocab_size, self.context_length = vocab, context_length
        self.reset()

    def reset(self) -> None:
        self.ids: list[int] = []

    @property
    def position(self) -> int:
        return len(self.ids)

    def logits_after(self, prefix: list[int]) -> np.ndarray:
        row = self.table[prefix[-1]] + 0.1 * len(prefix) * self.table[sum(prefix) % self.vocab_size]
        return row.astype(np.float32)

    def forward(self, ids, all_logits: bool = False) -> torch.Tensor:
        rows = []
        for t in ids:
            self.ids.append(int(t))
            rows.append(self.logits_after(self.ids))
        out = torch.from_numpy(np.stack(rows))
        return out if all_logits else out[-1:]


def tokens(n: int, seed: int = 3) -> list[int]:
    return [BOS] + np.random.default_rng(seed).integers(0, V - 1, n - 1).tolist()


def hand_nll(model: Toy, toks: list[int], ctx: int, n_chunks: int, bos: int | None) -> list[float]:
    """llama-perplexity by hand: each chunk from scratch, first token -> BOS, second half scored."""
    out = []
    first = min(ctx // 2, ctx - 2)
    for k in range(n_chunks):
        ids = list(toks[k * ctx:(k + 1) * ctx])
        if bos is not None:
            ids[0] = bos
        for j in range(first, ctx - 1):
            row = [float(x) for x in model.logits_after(ids[:j + 1])]
            lse = max(row) + math.log(sum(math.exp(x - max(row)) for x in row))
            out.append(lse - row[ids[j + 1]])
    return out


def test_toy_is_a_causal_model():
    assert isinstance(Toy(), CausalModel)


@pytest.mark.parametrize("n,ctx,chunks,bos", [(50, 16, None, BOS), (50, 16, 2, BOS), (50, 16, None, None),
                                              (9, None, None, BOS), (2, None, None, BOS), (7, 3, None, None)])
def test_perplexity_equals_hand_computation(n, ctx, chunks, bos):
    toks = tokens(n)
    plan = plan_chunks(len(toks), ctx=ctx, chunks=chunks, bos=bos)
    assert plan.ctx == (ctx or n) and plan.n_chunks == min(chunks or 99, n // plan.ctx)
    r = evaluate(Toy(), toks, plan)
    nll = hand_nll(Toy(), toks, plan.ctx, plan.n_chunks, bos)
    assert r.scored == len(nll) == plan.n_chunks * plan.scored_per_chunk >= 1
    assert r.perplexity == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-6)
    assert r.rows == plan.rows and r.tokens == n


def test_second_half_scored_and_bos_replaces_each_chunks_first_token():
    plan = plan_chunks(50, ctx=16, bos=BOS)
    assert (plan.first, plan.scored_per_chunk, plan.n_chunks) == (8, 7, 3)       # the tail of 2 is not run
    toks = tokens(50)
    assert chunk_ids(toks, plan, 1) == [BOS] + toks[17:32]
    assert plan_chunks(2).first == 0 and plan_chunks(3).first == 1 and plan_chunks(600).ctx == 512


def test_save_logits_rows_are_the_logits_after_each_prefix(tmp_path):
    toks = tokens(40)
    plan = plan_chunks(len(toks), ctx=16, bos=BOS)
    out = tmp_path / "l.npy"
    r = evaluate(Toy(), toks, plan, save_logits=out, batch=5)
    saved = np.load(out)
    assert saved.dtype == np.float32 and saved.shape == (32, V) and r.logits_file == str(out)
    for row in range(32):
        ids = chunk_ids(toks, plan, row // 16)[:row % 16 + 1]
        assert np.array_equal(saved[row], Toy().logits_after(ids))
    assert not list(tmp_path.glob(".l.npy.tmp-*"))


def test_kl_against_own_logits_is_zero(tmp_path):
    toks = tokens(40)
    plan = plan_chunks(len(toks), ctx=20, bos=BOS)
    evaluate(Toy(), toks, plan, save_logits=tmp_path / "base.npy")
    r = evaluate(Toy(), toks, plan, base=NpyBase(tmp_path / "base.npy"))
    assert r.compared == 40 and r.kl_mean == 0.0 and r.kl_max == 0.0
    assert r.top1_agreement == 1.0 and r.mean_abs_dp_top == 0.0 and r.base_perplexity == r.perplexity


def test_non_finite_base_or_model_logits_are_errors(tmp_path):
    toks = tokens(20)
    plan = plan_chunks(len(toks), bos=BOS)
    bad = np.zeros((20, V), np.float32)
    bad[7, 3] = np.nan
    np.save(tmp_path / "nan.npy", bad)
    with pytest.raises(K3Error, match="nan.npy: row 7 is not finite"):
        evaluate(Toy(), toks, plan, base=NpyBase(tmp_path / "nan.npy"))
    broken = Toy()
    broken.table[5, 0] = np.inf
    with pytest.raises(K3Error, match="toy: non-finite logits at position"):
        evaluate(broken, [BOS] + [5] * 19, plan, where="toy")


def test_kl_from_another_model_equals_hand_computation(tmp_path):
    toks = tokens(40)
    plan = plan_chunks(len(toks), ctx=20, bos=BOS)
    evaluate(Toy(seed=0), toks, plan, save_logits=tmp_path / "base.npy")
    r = evaluate(Toy(seed=1), toks, plan, base=NpyBase(tmp_path / "base.npy"))
    base, mine = np.load(tmp_path / "base.npy").astype(np.float64), np.empty((40, V))
    for row in range(40):
        mine[row] = Toy(seed=1).logits_after(chunk_ids(toks, plan, row // 20)[:row % 20 + 1])
    p = np.exp(base - base.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    q = np.exp(mine - mine.max(1, keepdims=True))
    q /= q.sum(1, keepdims=True)
    kl = (p * np.log(p / q)).sum(1)
    top = p.argmax(1)
    assert r.kl_mean == pytest.approx(kl.mean(), rel=1e-9) and r.kl_max == pytest.approx(kl.max(), rel=1e-9)
    assert r.top1_agreement == pytest.approx((top == q.argmax(1)).mean())
    assert r.mean_abs_dp_top == pytest.approx(np.abs(q[np.arange(40), top] - p[np.arange(40), top]).mean())
    assert 0 < r.kl_mean and r.top1_agreement < 1


# ---------------------------------------------------------------- llama.cpp's --kl-divergence-base file


def _llama_log_probs(logits: np.ndarray, n_vocab: int) -> np.ndarray:
    """perplexity.cpp log_softmax(n_vocab, logits, log_prob, tok): one row of nv uint16."""
    x = logits.astype(np.float32)
    mx, mn = np.float32(x.max()), np.float32(x.min())
    mn = np.float32(max(mn, mx - np.float32(16)))
    sum_exp = float(np.exp((x - mx).astype(np.float32), dtype=np.float32).astype(np.float64).sum())
    lse = np.float32(math.log(sum_exp))
    min_log_prob = np.float32(mn - mx - lse)
    scale = np.float32((mx - mn) / np.float32(65535))
    nv = 2 * ((n_vocab + 1) // 2) + 4
    row = np.zeros(nv, np.uint16)
    row[:4] = np.array([scale, min_log_prob], "<f4").view("<u2")
    if scale:
        q = np.rint(np.float32(1 / scale) * (x - mn)).astype(np.int64)
        row[4:4 + n_vocab] = np.where(x > mn, q, 0)
    return row


def llama_header(n_ctx: int, n_vocab: int, n_chunk: int, toks: list[int]) -> bytes:
    return b"_logits_" + struct.pack("<Iii", n_ctx, n_vocab, n_chunk) + \
        np.asarray(toks[:n_ctx * n_chunk], "<i4").tobytes()


def write_llama_base(path: Path, model: Toy, toks: list[int], n_ctx: int, n_chunk: int,
                     bos: int | None) -> None:
    """What `llama-perplexity -c n_ctx --kl-divergence-base path` writes for `model`."""
    plan = plan_chunks(len(toks), ctx=n_ctx, chunks=n_chunk, bos=bos)
    body = [llama_header(n_ctx, V, n_chunk, toks)]
    for k in range(n_chunk):
        ids = chunk_ids(toks, plan, k)
        for j in range(n_ctx // 2, n_ctx - 1):
            body.append(_llama_log_probs(model.logits_after(ids[:j + 1]), V).tobytes())
    path.write_bytes(b"".join(body))


def test_llama_cpp_base_file_is_read_and_summed_as_llama_cpp_does(tmp_path):
    toks = tokens(50)
    write_llama_base(tmp_path / "base.kld", Toy(seed=0), toks, 16, 3, BOS)
    base = open_base(tmp_path / "base.kld")
    assert isinstance(base, LlamaBase) and (base.n_ctx, base.n_chunk, base.n_vocab) == (16, 3, V)
    assert base.tokens.tolist() == toks[:48]
    plan = base.plan(ctx=None, chunks=None, bos=BOS)
    same = evaluate(Toy(seed=0), base.tokens.tolist(), plan, base=base)
    # uint16 log-probs (steps of 16 / 65535) leave a floor of ~1e-5 even against itself
    assert same.compared == 3 * 7 and same.kl_max < 1e-4 and same.top1_agreement == 1.0
    assert same.base_perplexity == pytest.approx(same.perplexity, rel=1e-4)
    other = evaluate(Toy(seed=1), base.tokens.tolist(), plan, base=base)
    # by hand, llama.cpp's sum: log p = scale * q + min_log_prob, terms with log p <= -16 left out
    kl = []
    for k in range(3):
        for i, j in enumerate(range(8, 15)):
            raw = np.asarray(base.logp[k, i])
            scale, mlp = raw[:4].view("<f4")
            lp = scale * raw[4:4 + V].astype(np.float32) + mlp
            row = Toy(seed=1).logits_after(chunk_ids(toks, plan, k)[:j + 1]).astype(np.float64)
            lq = row - row.max() - np.log(np.exp(row - row.max()).sum())
            kl.append(sum(math.exp(a) * (a - b) for a, b in zip(lp, lq, strict=True) if a > -16))
    assert other.kl_mean == pytest.approx(np.mean(kl), rel=1e-5)
    # and close to the exact KL over the same rows from float logits
    evaluate(Toy(seed=0), toks, plan, save_logits=tmp_path / "base.npy")
    exact = evaluate(Toy(seed=1), toks, plan, base=NpyBase(tmp_path / "base.npy")).divergence
    assert exact is not None and other.divergence is not None
    scored = np.isin(exact["rows"] % 16, np.arange(8, 15))
    assert np.allclose(other.divergence["kl"], exact["kl"][scored], rtol=1e-3, atol=1e-6)


def test_llama_cpp_base_checks(tmp_path):
    toks = tokens(50)
    path = tmp_path / "base.kld"
    write_llama_base(path, Toy(), toks, 16, 3, BOS)
    with pytest.raises(K3Error, match="n_ctx 16"):
        LlamaBase(path).plan(ctx=20, chunks=None, bos=BOS)
    assert LlamaBase(path).plan(ctx=16, chunks=2, bos=BOS).n_chunks == 2
    base = LlamaBase(path)
    with pytest.raises(K3Error, match="vocab has 14"):
        evaluate(Toy(vocab=14), toks, base.plan(ctx=None, chunks=None, bos=BOS), base=base)
    cut = tmp_path / "cut.kld"
    cut.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(K3Error, match=f"{cut}: .* bytes, a llama.cpp logits file"):
        open_base(cut)


# ---------------------------------------------------------------- the CLI on a GGUF


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> Path:
    from k3kit.gguf.synth import synthesize
    d = tmp_path_factory.mktemp("ppl")
    return Path(synthesize(d, "mini", 2, 4, vocab=512, seed=1, progress=False, name="m").paths[0])


TEXT = "the quick brown fox jumps over the lazy dog and then some more words to read"


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["perplexity", *argv, "--threads", "1"])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_saves_logits_and_kl_against_them_is_zero(gguf, tmp_path, capsys):
    from k3kit.adapters import load_model
    out = tmp_path / "l.npy"
    rc, stdout, err = _run(capsys, str(gguf), "--text", TEXT, "--save-logits", str(out), "--json")
    assert rc == 0, err
    r = json.loads(stdout)
    saved = np.load(out)
    loaded = load_model(gguf)
    try:
        ids = loaded.codec.encode(TEXT, add_bos=True)
        assert saved.dtype == np.float32
        assert saved.shape == (len(ids), loaded.model.vocab_size) == (r["rows"], 512)
        assert r["tokens"] == r["ctx"] == len(ids) and r["chunks"] == 1
        for i in (0, 5, len(ids) - 1):
            loaded.model.reset()
            want = loaded.model.forward(ids[:i + 1])[-1].numpy()
            assert np.allclose(saved[i], want, atol=1e-4)
    finally:
        loaded.close()
    rc, stdout, err = _run(capsys, str(gguf), "--text", TEXT, "--kl-base", str(out), "--json")
    assert rc == 0, err
    k = json.loads(stdout)
    assert k["kl_mean"] == 0.0 and k["kl_max"] == 0.0 and k["top1_agreement"] == 1.0
    assert k["compared"] == len(ids) and k["perplexity"] == r["perplexity"] == k["base_perplexity"]
    rc, stdout, err = _run(capsys, str(gguf), "--text", TEXT, "--kl-base", str(out))
    assert rc == 0 and "perplexity" in stdout and "top-1 agreement 100.00%" in stdout


def _bad_inputs(tmp_path: Path) -> list[tuple[list[str], str]]:
    np.save(tmp_path / "short.npy", np.zeros((3, 512), np.float32))
    np.save(tmp_path / "vocab.npy", np.zeros((100, 7), np.float32))
    np.save(tmp_path / "ints.npy", np.zeros((10, 512), np.int32))
    np.save(tmp_path / "flat.npy", np.zeros(512, np.float32))
    np.savez(tmp_path / "z.npz", a=np.zeros(3))
    (tmp_path / "junk.npy").write_bytes(b"not an array at all")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    t = ["--text", TEXT]
    return [
        (["--text", ""], "needs at least 2"),
        (["--text", "a"], "needs at least 2"),
        ([*t, "--ctx", "500"], "fewer than --ctx 500"),
        ([*t, "--ctx", "1"], "--ctx 1: must be >= 2"),
        ([*t, "--chunks", "0"], "--chunks 0"),
        ([], "give the text"),
        ([*t, "--kl-base", str(tmp_path / "short.npy")], "3 rows, this run evaluates"),
        ([*t, "--kl-base", str(tmp_path / "vocab.npy")], "over 7 tokens, the model's vocab has 512"),
        ([*t, "--kl-base", str(tmp_path / "ints.npy")], "expected float logits"),
        ([*t, "--kl-base", str(tmp_path / "flat.npy")], "expected float logits"),
        ([*t, "--kl-base", str(tmp_path / "z.npz")], ".npz archive"),
        ([*t, "--kl-base", str(tmp_path / "junk.npy")], "not a .npy of logits"),
        ([*t, "--kl-base", str(tmp_path / "missing.npy")], "no such file"),
        ([*t, "--save-logits", str(tmp_path / "no" / "dir.npy")], "does not exist"),
        (["-f", str(tmp_path / "latin1.txt")], "not UTF-8"),
    ]


def test_cli_bad_inputs_are_one_line_errors(gguf, tmp_path, capsys):
    for argv, msg in _bad_inputs(tmp_path):
        rc, stdout, err = _run(capsys, str(gguf), *argv)
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("k3kit: error: ") and msg in lines[0], \
            (argv, err)


def test_cli_llama_cpp_base_needs_no_text_and_checks_the_texts_tokens(gguf, tmp_path, capsys):
    """A llama.cpp base file made for this GGUF's own logits: KL ~0; another text's tokens are refused."""
    from k3kit.adapters import load_model
    loaded = load_model(gguf)
    try:
        ids = loaded.codec.encode(TEXT, add_bos=True)
        plan = plan_chunks(len(ids), ctx=8)
        body = [llama_header(8, 512, plan.n_chunks, ids)]
        for k in range(plan.n_chunks):
            loaded.model.reset()
            logits = loaded.model.forward(chunk_ids(ids, plan, k), all_logits=True).numpy()
            body += [_llama_log_probs(logits[j], 512).tobytes() for j in range(4, 7)]
    finally:
        loaded.close()
    (tmp_path / "b.kld").write_bytes(b"".join(body))
    rc, stdout, err = _run(capsys, str(gguf), "--kl-base", str(tmp_path / "b.kld"), "--json")
    assert rc == 0, err
    r = json.loads(stdout)
    assert r["base_format"] == "llama.cpp" and r["ctx"] == 8 and r["compared"] == 3 * plan.n_chunks
    assert r["kl_max"] < 1e-5 and r["top1_agreement"] == 1.0
    rc, _, err = _run(capsys, str(gguf), "--kl-base", str(tmp_path / "b.kld"), "--text", "zzz " + TEXT)
    assert rc == 2 and "tokens differ from the text's at position" in err
    rc, _, err = _run(capsys, str(gguf), "--kl-base", str(tmp_path / "b.kld"), "--text", TEXT, "--ctx", "9")
    assert rc == 2 and "n_ctx 8" in err
