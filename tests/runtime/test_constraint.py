"""Grammar constraints (k3kit.runtime.constraint) on a small byte-level BPE vocabulary built here:
masks, end ids only where the grammar is complete, the stop, masking speculative rows with the
state after the proposals before them (and the matcher unchanged after), the Sampler under a
grammar, speculative decoding under a grammar on a toy target (greedy: plain decoding's tokens),
and compile errors as one line."""

from __future__ import annotations

import json

import pytest
import torch
from toy_target import (
    OracleDraft,
    ToyTarget,
    one_thread,  # noqa: F401  (autouse fixture)
)

pytest.importorskip("llguidance")
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers  # noqa: E402

from k3kit.gguf.synth_vocab import bytes_to_unicode  # noqa: E402
from k3kit.runtime.constraint import (  # noqa: E402
    GrammarError,
    Vocabulary,
    apply_bitmask,
)
from k3kit.runtime.sampling import Sampler, make_sampling  # noqa: E402
from k3kit.runtime.speculative import ScheduleConfig, SpeculativeDecoder  # noqa: E402
from k3kit.runtime.speculative.proposal import chain, propose  # noqa: E402

MERGES = [("{", '"'), ('"', "}"), ("t", "r"), ("tr", "u"), ("tru", "e"), (":", " "), ('"', ":")]
SPECIALS = ["<|end|>", "<|sep|>"]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    b2u = bytes_to_unicode()

    def chars(text: str) -> str:
        return "".join(b2u[b] for b in text.encode())

    vocab = {b2u[b]: b for b in range(256)}
    merges = [(chars(a), chars(b)) for a, b in MERGES]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    t = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return t


@pytest.fixture(scope="module")
def vocab(tok: Tokenizer) -> Vocabulary:
    return Vocabulary(tok.to_str(), tok.get_vocab_size(), [tok.token_to_id("<|end|>")])


def ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def allowed(vocab: Vocabulary, bits: torch.Tensor) -> set[int]:
    row = apply_bitmask(torch.zeros(1, vocab.n_vocab), bits[:1])[0]
    return {int(i) for i in torch.nonzero(row == 0).flatten()}


def token_text(tok: Tokenizer, t: int) -> str:
    return tok.decode([t], skip_special_tokens=False)


def test_mask_allows_what_the_schema_allows_and_end_only_when_complete(tok, vocab):
    c = vocab.json_schema(SCHEMA).constraint()
    end = tok.token_to_id("<|end|>")
    first = allowed(vocab, c.bitmasks())
    assert first and all(token_text(tok, t).startswith("{") for t in first)
    assert ids(tok, '{"')[0] in first and end not in first
    text = '{"ok": true, "n": 2}'
    toks = ids(tok, text)
    for k, t in enumerate(toks):
        now = allowed(vocab, c.bitmasks())
        assert t in now, f"token {k} {token_text(tok, t)!r} of a valid text is masked"
        assert end not in now                              # not complete before the last token
        assert c.consume([t]) == 1
    assert c.stopped and c.ended_at == len(toks)           # nothing can follow the closing brace
    assert allowed(vocab, c.bitmasks()) == {end}
    # a value outside the enum, a missing field, a wrong type: masked where they start
    for bad in ('{"ok": true, "n": 4}', '{"ok": true}', '{"ok": 1'):
        c = vocab.json_schema(SCHEMA).constraint()
        rows = ids(tok, bad)
        k = 0
        while k < len(rows) and rows[k] in allowed(vocab, c.bitmasks()):
            c.consume([rows[k]])
            k += 1
        assert k < len(rows), f"{bad!r} was taken whole"


def test_masked_rows_follow_the_proposals_and_leave_the_matcher_as_it_was(tok, vocab):
    grammar = vocab.json_schema(SCHEMA)
    c = grammar.constraint()
    c.consume(ids(tok, '{"ok'))
    before = c.bitmasks().clone()
    props = ids(tok, '": false, "n": 1}')
    bits = c.bitmasks(props).clone()
    assert torch.equal(c.bitmasks(), before)               # rolled back
    assert c.consumed == len(ids(tok, '{"ok')) and not c.stopped
    ref = grammar.constraint()
    ref.consume(ids(tok, '{"ok'))
    for k in range(len(props) + 1):                        # row k: the state after props[:k]
        assert torch.equal(bits[k], ref.bitmasks()[0]), k
        if k < len(props):
            ref.consume([props[k]])
    # a proposal the grammar forbids: its row forbids it and the rows after repeat that row
    bad = ids(tok, '": 7, "n"')
    k = bad.index(ids(tok, "7")[0])
    bits = c.bitmasks(bad).clone()
    assert all(bad[j] in allowed(vocab, bits[j:j + 1]) for j in range(k))
    assert bad[k] not in allowed(vocab, bits[k:k + 1])
    assert all(torch.equal(bits[j], bits[k]) for j in range(k + 1, len(bad) + 1))
    assert torch.equal(c.bitmasks(), before)
    logits = torch.randn(len(props) + 1, vocab.n_vocab + 5, generator=torch.Generator().manual_seed(0))
    masked = c.mask(logits, props)
    assert masked.shape == logits.shape and torch.isinf(masked[:, vocab.n_vocab:]).all()
    fin = torch.isfinite(masked)
    assert torch.equal(masked[fin], logits[fin])           # allowed logits are untouched


def test_a_verify_reuses_the_walks_masks_and_gets_the_same_rows(tok, vocab, monkeypatch):
    grammar = vocab.json_schema(SCHEMA)
    c = grammar.constraint()
    c.consume(ids(tok, '{"ok'))
    props = ids(tok, '": true, "n": 2}')
    fresh = c.bitmasks(props).clone()
    fills: list[int] = []
    real = c._fill
    monkeypatch.setattr(c, "_fill", lambda bits, k: (fills.append(k), real(bits, k)))
    walk = c.walk()
    row = torch.zeros(vocab.n_vocab)
    for t in props[:4]:                     # a draft walks four of the proposals
        walk.mask(row)
        walk.step(t)
    walk.close()
    n_walk = len(fills)
    assert torch.equal(c.bitmasks(props), fresh)
    assert len(fills) - n_walk == len(props) + 1 - 4        # rows 0-3 came from the walk
    # other proposals reuse only the rows of the prefix they share with the walk
    other = ids(tok, '": false, "n": 1}')
    shared = next(k for k in range(len(other)) if other[k] != props[k])
    assert shared < 4
    fills.clear()
    got = c.bitmasks(other).clone()
    assert len(fills) == len(other) + 1 - (shared + 1)
    walked, c._walked = c._walked, None
    assert torch.equal(got, c.bitmasks(other))
    c._walked = walked
    c.consume(ids(tok, '"'))                                 # a consume makes the walk stale
    fills.clear()
    c.bitmasks(props[1:])
    assert len(fills) == len(props)


def test_consume_keeps_tokens_up_to_the_one_that_completes_the_grammar(tok, vocab):
    c = vocab.json_schema({"enum": ["yes", "no"]}).constraint()
    toks = ids(tok, '"no"') + ids(tok, ' more')
    assert c.consume(toks) == len(ids(tok, '"no"')) and c.ended_at == len(ids(tok, '"no"'))
    with pytest.raises(ValueError, match="does not follow the grammar"):
        vocab.json_schema({"enum": ["yes", "no"]}).constraint().consume(ids(tok, '"maybe"'))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampler_under_a_grammar_writes_valid_json_from_any_logits(tok, vocab, temperature):
    """Random logits, a bias towards a forbidden token, penalties: the picks follow the grammar, end
    with it, and a seed repeats them."""
    def run(seed: int) -> tuple[list[int], int | None]:
        forbidden = ids(tok, "x")[0]
        s = make_sampling(temperature, seed=seed, top_k=50, logit_bias={forbidden: 100.0},
                          frequency_penalty=0.5)
        sampler = Sampler(s, [], vocab.json_schema(SCHEMA).constraint())
        g = torch.Generator().manual_seed(seed)
        out: list[int] = []
        while sampler.ended_at is None and len(out) < 200:
            out.append(sampler(torch.randn(vocab.n_vocab, generator=g) * 4))
        return out, sampler.ended_at

    for seed in range(3):
        out, end = run(seed)
        assert end == len(out), "the grammar never completed"
        value = json.loads(tok.decode(out))
        assert isinstance(value["ok"], bool) and value["n"] in (1, 2, 3) and set(value) == {"ok", "n"}
        assert run(seed)[0] == out


def test_lark_special_tokens_and_gbnf(tok, vocab):
    c = vocab.lark('start: "a" <|sep|> /[0-9]+/ "!"').constraint()
    sep = tok.token_to_id("<|sep|>")
    assert c.consume(ids(tok, "a") + [sep] + ids(tok, "42!")) == 5 and c.stopped
    assert vocab.special("<|sep|>") and not vocab.special("<|nope|>") and not vocab.special("a")
    c = vocab.gbnf('root ::= "yes" | "no"').constraint()
    assert c.consume(ids(tok, "no")) == len(ids(tok, "no")) and c.stopped


@pytest.mark.parametrize("build, text, message", [
    ("json_schema", {"type": "objectx"}, "objectx"),
    ("json_schema", {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}, "nowhere"),
    ("lark", "start: foo", 'unknown name: "foo"'),
    ("lark", "start: <|missing|>", "missing"),
    ("gbnf", "root ::= foo", "foo"),
])
def test_bad_grammars_fail_with_one_line(vocab, build, text, message):
    with pytest.raises(GrammarError) as e:
        getattr(vocab, build)(text)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_apply_bitmask_keeps_the_device_and_masks_past_the_vocabulary():
    bits = torch.tensor([[0b101, 0], [-1, 1]], dtype=torch.int32)     # 64 tokens
    rows = torch.zeros(2, 70)
    out = apply_bitmask(rows, bits)
    assert out.device == rows.device and out.dtype == rows.dtype
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == list(range(33))


class GrammarOracle(OracleDraft):
    """OracleDraft whose truth is the target's greedy continuation under the sequence's grammar
    (from a copy of its matcher), so that proposals can pass the grammar."""

    constraint = None

    def draft_block(self, anchor, position):
        real = self.target.greedy_continuation
        c = self.constraint
        matcher = c.matcher.deep_copy()

        def constrained(anchor: int, n: int) -> list[int]:
            other, out, t = self.target.clone(), [], anchor
            for _ in range(n):
                row = other.verify([t], capture=False).logits[-1:]
                other.commit(1)
                bits = torch.zeros(1, c.vocab.words, dtype=torch.int32)
                matcher.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * 4)
                t = int(torch.argmax(apply_bitmask(row, bits)[0]))
                if not matcher.try_consume_tokens([t]):
                    break
                out.append(t)
            return out + [0] * (n - len(out))

        self.target.greedy_continuation = constrained
        try:
            return super().draft_block(anchor, position)
        finally:
            self.target.greedy_continuation = real


def _decode(target: ToyTarget, vocab: Vocabulary, grammar, temperature: float, seed: int,
            draft: OracleDraft | None) -> tuple[list[int], int]:
    """Tokens of one constrained generation (plain, or speculative with `draft`), and the passes."""
    target.reset()
    end = vocab.stop_ids[0]
    s = make_sampling(temperature, seed=seed)
    sampler = Sampler(s, [5, 9], grammar.constraint())
    dec = None
    if draft is not None:
        draft.constraint = sampler.constraint
        dec = SpeculativeDecoder(target, draft, s, sampler.generator, schedule=ScheduleConfig(budget=5),
                                 stop_ids=[end], constraint=sampler.constraint)
        last = dec.prefill([5, 9])[-1]
    else:
        last = target.verify([5, 9], capture=False).logits[-1]
        target.commit(2)
    tokens, passes = [sampler(last)], 0
    while sampler.ended_at is None and len(tokens) < 120:
        passes += 1
        if dec is not None:
            tokens += dec.step(tokens[-1], 120 - len(tokens))
        else:
            row = target.verify([tokens[-1]], capture=False).logits[-1]
            target.commit(1)
            tokens.append(sampler(row))
    return tokens, passes


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_speculative_decoding_under_a_grammar(tok, vocab, temperature):
    """Greedy: the speculative decoder's tokens are plain decoding's under the grammar, token for
    token, in fewer passes (with the grammar oracle: under half of plain decoding's); sampled:
    every output follows the grammar and a seed repeats it. The plain oracle's rows peak at the
    target's continuation without the grammar (masked, what is left of them is noise: the target
    rejects most of it); the grammar oracle's peak at the continuation under it, wrong with
    probability 0.2."""
    grammar = vocab.json_schema({"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                                        "maximum": 999}},
                                 "required": ["a"], "additionalProperties": False})
    target = ToyTarget(vocab=vocab.n_vocab, seed=3, logit_scale=6.0)
    fewer = 0
    for seed in range(3):
        plain, plain_passes = _decode(target, vocab, grammar, temperature, seed, None)
        for kind in (OracleDraft, GrammarOracle):
            spec, spec_passes = _decode(target, vocab, grammar, temperature, seed, kind(target, 5, 0.8, seed))
            assert set(json.loads(tok.decode(spec))) == {"a"}
            if temperature == 0:
                assert spec == plain
            else:
                again = _decode(target, vocab, grammar, temperature, seed, kind(target, 5, 0.8, seed))[0]
                assert again == spec
            fewer += kind is GrammarOracle and spec_passes < plain_passes / 2
    if temperature == 0:
        assert fewer == 3


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_draft_proposes_under_the_grammar_and_leaves_it_as_it_was(tok, vocab, temperature):
    """A draft block chained under a grammar: every proposal is allowed after the ones before it
    (the rows are masked as it goes), q is the masked distribution, and the matcher is back where
    it was; `chain` proposes what `propose` does."""
    grammar = vocab.json_schema(SCHEMA)
    target = ToyTarget(vocab=vocab.n_vocab, seed=5)
    s = make_sampling(temperature, seed=3)
    c = grammar.constraint()
    c.consume(ids(tok, '{"ok": tr'))
    before = c.bitmasks().clone()
    draft = OracleDraft(target, 6, p_good=0.5, seed=1)
    draft.sync(type("Ring", (), {"length": 0})())
    props = propose(draft, 7, 0, s, torch.Generator().manual_seed(9), c)
    assert torch.equal(c.bitmasks(), before) and c.consumed == len(ids(tok, '{"ok": tr'))
    check = grammar.constraint()
    check.consume(ids(tok, '{"ok": tr'))
    for t in props.tokens:
        if check.stopped:
            break
        assert t in allowed(vocab, check.bitmasks()), tok.decode(props.tokens)
        check.consume([t])
    if props.q is not None:
        for k, t in enumerate(props.tokens[:3]):
            assert props.q[k, t] > 0 and abs(float(props.q[k].sum()) - 1) < 1e-9
    draft = OracleDraft(target, 6, p_good=0.5, seed=1)
    draft.sync(type("Ring", (), {"length": 0})())
    block = draft.draft_block(7, 0)
    again = chain(draft, [block], [7], [s], [torch.Generator().manual_seed(9)], [c])[0]
    assert again.tokens == props.tokens and torch.equal(c.bitmasks(), before)
