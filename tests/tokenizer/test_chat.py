"""Chat prompts: the file's own template rendered as transformers does, the Kimi format as fallback.

Expected strings for the non-Kimi templates are written by hand from Jinja's semantics under
transformers' settings (trim_blocks, lstrip_blocks, its variables and filters), not produced by
the code under test.
"""

from __future__ import annotations

import jinja2
import pytest
from gguf import GGUFValueType as T
from tokenizer_cases import CONVERSATIONS, with_k2_markers

from k3kit.errors import FormatError, K3Error
from k3kit.gguf.reader import KV, GGUFFile
from k3kit.gguf.writer import write_gguf
from k3kit.mini.tokenizer import CHAT_TEMPLATE, gguf_tokenizer_kv
from k3kit.tokenizer.chat import KIMI_TEMPLATE, ChatTemplate, render_kimi
from k3kit.tokenizer.codec import TextCodec

# ---------------------------------------------------------------- the built-in Kimi format


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_jinja_template_renders_like_python(messages, add_generation_prompt):
    env = jinja2.Environment()

    def raise_exception(msg):
        raise jinja2.TemplateError(msg)

    env.globals["raise_exception"] = raise_exception
    template = env.from_string(KIMI_TEMPLATE)
    rendered = template.render(messages=messages, add_generation_prompt=add_generation_prompt)
    assert rendered == render_kimi(messages, add_generation_prompt=add_generation_prompt)


def test_chat_rendering():
    got = render_kimi(CONVERSATIONS[1][:2])
    assert got == ("<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
                   "<|im_user|>user<|im_middle|>2+2?<|im_end|><|im_assistant|>assistant<|im_middle|>")
    with pytest.raises(K3Error, match="unknown role"):
        render_kimi([{"role": "bot", "content": "x"}])
    with pytest.raises(K3Error, match="content"):
        render_kimi([{"role": "user", "content": None}])


# ---------------------------------------------------------------- the file's template


def _kvs(tok, template: str | None) -> dict[str, KV]:
    """The mini tokenizer's KVs with `template` as tokenizer.chat_template (None: no template)."""
    if tok.token_to_id("<|im_end|>") is not None:     # Kimi-K2's markers (with_k2_markers)
        from k3kit.mini.tokenizer import BOS, EOS, MASK, PAD, PRE
        from k3kit.tokenizer.gguf_kv import tokenizer_kv

        kv = {k.key: k for k in tokenizer_kv(tok, pre=PRE, bos=BOS, eos=EOS, eot="<|im_end|>", pad=PAD,
                                             mask=MASK, add_bos=True, add_eos=False, chat_template=None)}
    else:
        kv = {k.key: k for k in gguf_tokenizer_kv(tok)}
    kv.pop("tokenizer.chat_template", None)
    if template is not None:
        kv["tokenizer.chat_template"] = KV("tokenizer.chat_template", T.STRING, template)
    return kv


def _codec(tok, template: str | None, where: str = "model.gguf") -> TextCodec:
    return TextCodec(_kvs(tok, template), where)


def test_kimi_template_in_gguf_renders_like_fallback(tmp_path, tok):
    tok = with_k2_markers(tok)
    path = write_gguf(tmp_path / "chat.gguf", [KV("general.architecture", T.STRING, "llama"),
                                               *_kvs(tok, KIMI_TEMPLATE).values()], [])
    with_template = TextCodec(GGUFFile.open(path).kv, str(path))
    fallback = _codec(tok, None)
    assert with_template.has_chat_template and not fallback.has_chat_template
    for messages in CONVERSATIONS:
        for gen in (True, False):
            got = with_template.chat.render(messages, add_generation_prompt=gen)
            assert got == fallback.chat.render(messages, add_generation_prompt=gen)
            assert got == render_kimi(messages, add_generation_prompt=gen)
    assert with_template.chat_prompt("hi\n") == fallback.chat_prompt("hi\n") == \
        "<|im_user|>user<|im_middle|>hi\n<|im_end|><|im_assistant|>assistant<|im_middle|>"


def test_shipped_mini_speaks_kimi_k3():
    """`k3kit generate --chat` on the shipped mini: the file carries Kimi-K3's template, its markers are
    single control tokens, a reply ends at <|end_of_msg|>, and the prompt opens the think channel."""
    from k3kit.mini.paths import shipped_gguf

    path = shipped_gguf()
    codec = TextCodec(GGUFFile.open(path).kv, str(path))
    assert codec.has_chat_template and codec.chat.source == CHAT_TEMPLATE
    for user in ("Write a Python function that adds two numbers.", "héllo 中文\n<b>&</b>", ""):
        prompt = codec.chat_prompt(user)
        assert prompt.endswith(f'<|open|>message role="user"<|sep|>{user}<|close|>message<|sep|>'
                               '<|end_of_msg|>'
                               '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
        assert prompt.startswith('<|open|>message role="system" type="thinking-effort"<|sep|>')
    ids = codec.encode('<|open|>x<|sep|><|close|>x<|sep|><|end_of_msg|>', add_bos=False)
    assert len(ids) == 7 and ids[-1] in codec.stop_ids()


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
          " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")

# The same format laid out on lines: only trim_blocks + lstrip_blocks make it render the same.
CHATML_LINES = """\
{% for message in messages %}
  {% if message['role'] == 'system' %}
<|im_start|>system
{{ message['content'] }}<|im_end|>
  {% else %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
  {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""


@pytest.mark.parametrize("template", [CHATML, CHATML_LINES], ids=["one-line", "lines"])
def test_chatml_renders_as_transformers(tok, template):
    codec = _codec(tok, template)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "<b>&</b>\n"}]
    want = ("<|im_start|>system\nBe brief.<|im_end|>\n"
            "<|im_start|>user\n2+2?<|im_end|>\n"
            "<|im_start|>assistant\n4<|im_end|>\n"
            "<|im_start|>user\n<b>&</b>\n<|im_end|>\n")
    assert codec.chat.render(messages, add_generation_prompt=False) == want
    assert codec.chat.render(messages) == want + "<|im_start|>assistant\n"
    assert codec.chat_prompt("Hi") == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_template_variables(tok):
    template = ("{{ bos_token }}|{{ eos_token }}|{{ tools is none }}|{{ documents is none }}"
                "|{% if tools %}{{ tools | tojson }}{% endif %}|{{ messages | tojson }}|{{ extra }}")
    chat = _codec(tok, template).chat
    msgs = [{"role": "user", "content": "é <b>&</b> 'q'"}]
    assert chat.render(msgs) == ('[BOS]|[EOS]|True|True||[{"role": "user", "content": "é <b>&</b> \'q\'"}]|')
    tools = [{"type": "function", "function": {"name": "f<x>"}}]
    assert chat.render(msgs, tools=tools, extra=7) == (
        '[BOS]|[EOS]|False|True|[{"type": "function", "function": {"name": "f<x>"}}]'
        '|[{"role": "user", "content": "é <b>&</b> \'q\'"}]|7')


def test_template_functions_and_extensions(tok):
    import datetime

    template = ("{{ strftime_now('%Y') }}|"
                "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
                "{% if m.role == 'system' %}{% continue %}{% endif %}{{ m.role }};{% endfor %}|"
                "{% generation %}{{ messages[-1].content }}{% endgeneration %}")
    got = _codec(tok, template).chat.render(CONVERSATIONS[1])
    year = got.split("|")[0]
    assert year in {str(datetime.datetime.now().year), str(datetime.datetime.now().year - 1)}
    assert got[len(year):] == "|user;|And 3+3?\n"


def test_raise_exception_is_one_line_k3error(tok):
    template = ("{% if messages[0]['role'] != 'user' %}"
                "{{ raise_exception('Conversations must start with a user message.\nSee the model card.') }}"
                "{% endif %}ok")
    codec = _codec(tok, template, "files/model.gguf")
    assert codec.chat.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(K3Error) as e:
        codec.chat.render([{"role": "assistant", "content": "x"}])
    msg = str(e.value)
    assert "\n" not in msg
    assert msg == ("files/model.gguf: tokenizer.chat_template: Conversations must start with a user message. "
                   "See the model card.")
    with pytest.raises(K3Error, match=r"^model\.gguf: tokenizer\.chat_template: unknown role: bot$"):
        _codec(tok, KIMI_TEMPLATE).chat.render([{"role": "bot", "content": "x"}])


@pytest.mark.parametrize("template,match", [
    ("{% for m in messages %}{{ m.content }}", r"does not compile \(line 1: .*endfor"),
    ("{{ messages[0].content }\n}", r"does not compile \(line 1"),
    ("{% if %}", r"does not compile"),
    ("{{ undefined_thing.attr }}", r"'undefined_thing' is undefined"),
    ("{{ 1 / 0 }}", r"failed: ZeroDivisionError"),
    ("{% for i in range(10**9) %}{% endfor %}", r"failed: OverflowError"),
])
def test_broken_templates_are_one_line_k3errors(tok, template, match):
    codec = _codec(tok, template, "bad.gguf")     # the codec loads: the template compiles on first use
    assert codec.encode("x")
    with pytest.raises(K3Error, match=f"^bad\\.gguf: tokenizer\\.chat_template.*{match}") as e:
        codec.chat_prompt("x")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os }}",
    "{{ raise_exception.__globals__['__builtins__'] }}",
    "{{ messages.append({'role': 'user', 'content': 'x'}) }}",
    "{% set _ = messages[0].update({'content': 'changed'}) %}",
    "{{ messages[0].pop('content') }}",
])
def test_sandbox_refuses_internals_and_mutation(tok, template):
    with pytest.raises(K3Error, match=r"^sandbox\.gguf: tokenizer\.chat_template: .*unsafe"):
        _codec(tok, template, "sandbox.gguf").chat_prompt("x")


def test_sandbox_hides_dunder_attributes(tok):
    # An unsafe attribute reads as undefined (it renders as nothing); using it raises, as above.
    assert _codec(tok, "[{{ ''.__class__ }}][{{ messages.__class__ }}]").chat_prompt("x") == "[][]"


def test_fallback_needs_the_kimi_tokens():
    chat = ChatTemplate(None, where="plain.gguf", vocab=["a", "<|im_user|>"])
    with pytest.raises(K3Error, match=r"^plain\.gguf: has no tokenizer\.chat_template.*<\|im_assistant\|>"):
        chat.render([{"role": "user", "content": "x"}])
    kimi = ChatTemplate(None, where="kimi.gguf", vocab=["<|im_user|>", "<|im_assistant|>", "<|im_end|>"])
    assert kimi.render([{"role": "user", "content": "x"}]) == render_kimi([{"role": "user", "content": "x"}])
    with pytest.raises(K3Error, match="no tools"):
        kimi.render([{"role": "user", "content": "x"}], tools=[{"type": "function"}])


def test_messages_must_be_objects(tok):
    chat = _codec(tok, CHATML).chat
    for bad in ("hello", [{"role": "user", "content": "x"}, "y"]):
        with pytest.raises(K3Error, match="list of"):
            chat.render(bad)


def test_template_kv_must_be_a_string(tok):
    kv = _kvs(tok, None)
    kv["tokenizer.chat_template"] = KV("tokenizer.chat_template", T.UINT32, 3)
    with pytest.raises(FormatError, match=r"bad\.gguf: tokenizer\.chat_template is UINT32, expected STRING"):
        TextCodec(kv, "bad.gguf")
