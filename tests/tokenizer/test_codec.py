"""encode() and TextCodec: ids as llama.cpp gives them, bytes per token, stops, streamed text."""

from __future__ import annotations

from gguf import GGUFValueType as T

from k3kit.gguf.reader import KV
from k3kit.mini.tokenizer import BOS, END_OF_MSG, EOS, gguf_tokenizer_kv, special_token_ids
from k3kit.tokenizer.codec import TextCodec, encode


def test_special_tokens_in_text(tok):
    ids = special_token_ids(tok)
    text = f"a{END_OF_MSG}b{BOS}"
    got = encode(tok, text)
    assert ids["end_of_msg"] in got and ids["bos"] in got
    plain = encode(tok, text, special=False)
    assert not set(plain) & set(ids.values())
    assert tok.decode(plain, skip_special_tokens=False) == text
    assert encode(tok, "x", add_bos=True)[0] == ids["bos"]
    assert encode(tok, "x", add_bos=False) == encode(tok, "x", add_bos=True)[1:]


def _codec(tok, **changes) -> TextCodec:
    kv = {k.key: k for k in gguf_tokenizer_kv(tok)}
    kv.update(changes)
    return TextCodec(kv, "codec.gguf")


def test_codec_encode_decode_and_stops(tok):
    codec = _codec(tok)
    ids = special_token_ids(tok)
    assert codec.n_vocab == tok.get_vocab_size()
    assert codec.add_bos and codec.encode("x") == [ids["bos"], *encode(tok, "x")]
    assert codec.encode("x", add_bos=False) == encode(tok, "x")
    assert codec.encode(END_OF_MSG, add_bos=False, special=False) == encode(tok, END_OF_MSG, special=False)
    assert codec.stop_ids() == {ids["eos"], ids["end_of_msg"]}
    text = "def f(x):\n    return 'é中😀'\n"
    assert codec.decode_bytes(encode(tok, text)) == text.encode()
    assert codec.decode_bytes([ids["bos"], ids["eos"]]) == b""     # control tokens render as nothing
    key = "tokenizer.ggml.add_bos_token"
    no_bos = _codec(tok, **{key: KV(key, T.BOOL, False)})
    assert no_bos.encode("x") == encode(tok, "x")
    assert codec.chat.tokens == {"bos_token": BOS, "eos_token": EOS}


def test_stream_prints_split_characters_once(tok):
    codec = _codec(tok)
    text = "a 😀 中文 é"
    ids = encode(tok, text)
    stream = codec.streamer()
    pieces = [stream.push(t) for t in ids] + [stream.flush()]
    assert "".join(pieces) == stream.text == text
    assert all("\ufffd" not in p for p in pieces)
