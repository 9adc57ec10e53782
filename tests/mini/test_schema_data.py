"""The drafter's structured-output rounds (k3kit.mini.draft.schema_data) on the shipped mini K3:
requests rendered as `k3kit serve` renders them, answers that follow their schemas, labels that
are the grammar-masked target's own picks, anchors that stay inside each answer."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from k3kit.mini import paths, tokenizer
from k3kit.mini.draft.schema_data import allowed_rows, chat_prompt, pad_rows, random_schema, schema_sequences
from k3kit.mini.draft.train import (
    DraftTrainSettings,
    block_allowed,
    load_target,
    make_schema_round,
    sample_blocks,
    train_draft_model,
)
from k3kit.runtime.constraint import Vocabulary
from k3kit.tokenizer.codec import TextCodec


@pytest.fixture(scope="module")
def mini():
    torch.set_num_threads(1)
    target, tok = load_target(paths.shipped_hf())
    codec = TextCodec({kv.key: kv for kv in tokenizer.gguf_tokenizer_kv(tok)}, "mini")
    vocab = Vocabulary(codec.tokenizer.to_str(), codec.n_vocab, codec.stop_ids())
    return target, tok, codec, vocab


def test_random_schemas_are_valid_and_varied():
    r = random.Random(0)
    schemas = [random_schema(r) for _ in range(50)]
    for s in schemas:
        jsonschema.Draft202012Validator.check_schema(s)
        assert 2 <= len(s["properties"]) <= 6 and set(s["required"]) <= set(s["properties"])
    assert len({json.dumps(s, sort_keys=True) for s in schemas}) == 50
    # the benchmark's schema (benchmarks/bench_grammar.py) is held out: its "point" object never occurs
    assert not any("point" in s["properties"] for s in schemas)


def test_the_prompt_is_the_served_one(mini):
    _, _, codec, _ = mini
    schema = random_schema(random.Random(1))
    text = chat_prompt(codec, "Tell me about a city as JSON.", schema)
    # the schema in the template's response-format system message, the answer's channel open
    assert 'type="response-format"' in text and "response_format=json_schema" in text
    shown = text.split("```json\n")[1].split("\n```")[0]
    assert json.loads(shown) == schema
    assert text.endswith('<|open|>message role="assistant"<|sep|><|open|>response<|sep|>')
    assert "response_format=json_object" in chat_prompt(codec, "Any JSON.", None)


def test_answers_follow_their_schemas_and_labels_are_the_masked_picks(mini):
    target, _, codec, vocab = mini
    complete = 0
    for q in schema_sequences(target, codec, vocab, 6, 96, seed=5):
        answer = q.ids[q.prompt_len:]
        assert 0 < len(answer) <= 96
        if len(answer) == 96:
            continue                # cut at the cap: a training sequence needs no end
        # an answer ends where the grammar does, as the server's would
        if answer[-1] in vocab.stop_ids:
            answer = answer[:-1]
        assert isinstance(json.loads(codec.decode_bytes(answer).decode()), dict)
        complete += 1
    assert complete >= 3
    # the picks are the argmax of the target's logits under the grammar, position by position
    s = DraftTrainSettings(steps=1, seqs=3, schema_len=96, seed=2)
    rd = make_schema_round(target, codec, vocab, s, (0, 2, 3, 4), r=0)
    assert rd.spans is not None and rd.feats.shape[:2] == rd.seqs.shape
    for i, (lo, hi) in enumerate(rd.spans):
        assert rd.seqs[i, lo - 1] != 0 and hi >= lo
        length = hi + 1 + s.block_size
        assert (rd.greedy[i, lo - 1:length - 1] == rd.seqs[i, lo:length]).all()
        assert (rd.seqs[i, length:] == 0).all() and (rd.feats[i, length:] == 0).all()
    g = torch.Generator().manual_seed(0)
    ids, labels, anchor, seq = sample_blocks(rd, 8, s.block_size, 4094, g)
    for n in range(anchor.numel()):
        lo, hi = rd.spans[int(seq[n])]
        assert lo <= int(anchor[n]) <= hi
        assert int(ids[n, 0]) == int(rd.seqs[seq[n], anchor[n]])
    # every label is among the tokens its row's grammar state allows; those are few
    allowed = block_allowed(rd, anchor, seq, s.block_size, vocab.n_vocab)
    assert allowed is not None and allowed.shape == (*labels.shape, vocab.n_vocab)
    assert allowed.gather(2, labels[..., None]).all()
    assert float(allowed.float().mean()) < 0.5


def test_a_sequence_replays_as_the_masked_target(mini):
    target, _, codec, vocab = mini
    schema = random_schema(random.Random(9))
    from k3kit.mini.draft.schema_data import constrained_answer
    prompt = codec.encode(chat_prompt(codec, "Fill in the fields for a task.", schema))
    answer, bits = constrained_answer(target, vocab, prompt, schema, 96)
    allowed = allowed_rows(bits, vocab.n_vocab)
    assert allowed.shape == (len(answer), vocab.n_vocab)
    assert all(bool(allowed[k, t]) for k, t in enumerate(answer))
    assert int(allowed[0].sum()) < vocab.n_vocab // 10       # a JSON value starts with few tokens
    text = codec.decode_bytes([t for t in answer if t not in vocab.stop_ids]).decode()
    jsonschema.validate(json.loads(text), schema)
    # one pass over the whole sequence, masked row by row with a fresh matcher: the same picks
    with torch.no_grad():
        logits = target(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1:-1].float()
    c = vocab.json_schema(schema).constraint()
    for k, t in enumerate(answer):
        masked = c.mask(logits[k:k + 1])[0]
        assert int(masked.argmax()) == t
        assert torch.equal(torch.isfinite(masked), allowed[k])    # the bits are the grammar's own
        c.consume([t])


def test_training_takes_schema_rounds(mini):
    target, tok, codec, vocab = mini
    mask = tok.token_to_id(tokenizer.MASK)
    stream = torch.randint(0, 4000, (3000,), generator=torch.Generator().manual_seed(0))
    seen: list[str] = []
    s = DraftTrainSettings(steps=4, seqs=2, prompt_len=8, gen_len=16, anchors=4, reuse=2, schema_every=2,
                           eval_prompts=0, log_every=1, layers=1, heads=2, kv_heads=2, intermediate=64)
    res = train_draft_model(target, stream, [], mask, s, log=seen.append, schema=(codec, vocab))
    assert res.steps == 4 and all(h.loss == h.loss for h in res.history)
    with pytest.raises(Exception, match="schema_every"):
        DraftTrainSettings(steps=1, schema_every=-1).validate()


def test_pad_rows():
    out = pad_rows([torch.ones(2, 3), torch.ones(4, 3)], value=-1)
    assert out.shape == (2, 4, 3) and (out[0, 2:] == -1).all() and (out[1] == 1).all()


def test_the_card_says_what_the_schema_rounds_were():
    from k3kit._io import read_json
    from k3kit.mini.draft.card import render_card
    summary = read_json(paths.shipped_draft().parent / "draft_summary.json", "summary")
    summary["settings"] = {**summary["settings"], "schema_every": 0}
    assert "JSON schemas" not in render_card(summary)
    summary["settings"] = {**summary["settings"], "schema_every": 2, "schema_len": 96}
    text = render_card(summary)
    assert "every second round instead: " in text and "up to 96 tokens" in text
