"""Texts and conversations the tokenizer tests share (tests/mini/test_tokenizer.py uses them too)."""

from __future__ import annotations

VOCAB = 512

HAND_PICKED = [
    "def foo(x):\n    return x + 1234567  # it's 'ok'\n",
    "1 12 123 1234 12345 1234567 0.5 3.14159 1e-10 10_000",
    "HelloWorld camelCase snake_case CONSTANT_VALUE __init__",
    "it's IT'S they're we've I'm you'll he'd 'tis rock'n'roll o'clock",
    "café naïve Ångström Ελληνικά русский עברית العربية",
    "中文测试，你好世界！日本語のテキスト한국어 텍스트",
    "emoji 😀🚀 👍🏽 family 👨‍👩‍👧",
    "tabs\tand\t\ttabs   spaces    trailing   \n\n\nlines\r\nwindows\r\n \n  \n",
    "   leading spaces and trailing   ",
    "<|im_end|>[BOS] text <|im_user|>user<|im_middle|>hi<|im_end|>",
    '<|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>[EOS]',
    "\u3000ideographic\u00a0nbsp\u2028ls",
    "",
    " ",
    "\n",
    "a",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?\n"}],
    [{"role": "user", "content": "call it"}, {"role": "assistant", "content": "{\"f\": 1}"},
     {"role": "tool", "content": "result <b>&</b> 'quoted'"}],
    [],
]


K2_MARKERS = ("<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>")


def with_k2_markers(tok):
    """The mini tokenizer with its five chat-marker ids named as Kimi-K2's (the format k3kit's
    built-in template renders for files without one)."""
    import json

    from tokenizers import Tokenizer

    from k3kit.mini.tokenizer import CHAT_TOKENS, finish_tokenizer

    data = json.loads(tok.to_str())
    rename = dict(zip(CHAT_TOKENS, K2_MARKERS, strict=False))
    data["model"]["vocab"] = {rename.get(t, t): i for t, i in data["model"]["vocab"].items()}
    for added in data["added_tokens"]:
        added["content"] = rename.get(added["content"], added["content"])
    return finish_tokenizer(Tokenizer.from_str(json.dumps(data)))
