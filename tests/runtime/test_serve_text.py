"""The server's text pieces on their own: incremental detokenization with stop strings, chat
templates from a checkpoint's files."""

import json

import pytest

from deepinfer.compiler.tokenizer_files import tokenizer_files
from deepinfer.runtime.serve.chat import DEFAULT_TEMPLATE, ChatTemplate
from deepinfer.runtime.serve.text import TextStream
from deepinfer.runtime.tokenizer import ByteTokenizer

TEXT = "héllo 😀 wörld, 日本 ok"


def pieces(stop: list[str], min_tokens: int = 0) -> list[str]:
    tokenizer = ByteTokenizer(320)
    stream = TextStream(tokenizer, stop, min_tokens)
    out = [stream.add(t) for t in tokenizer.encode(TEXT)]
    return out + [stream.finish()]


def test_multi_byte_characters_come_out_whole_and_once():
    out = pieces([])
    assert "".join(out) == TEXT
    assert not any("\ufffd" in p for p in out)
    assert "😀" in out  # its 4 bytes (4 tokens) came out as one piece


@pytest.mark.parametrize("stop, expected", [
    (["😀 w"], "héllo "),  # a stop string across a 4-byte character and two more tokens
    (["ld, 日"], "héllo 😀 wör"),
    (["never", "ok"], "héllo 😀 wörld, 日本 "),
    (["o"], "héll"),
    (["xyz"], TEXT),
])
def test_stop_strings_are_cut_and_held_back_until_decided(stop, expected):
    out = pieces(stop)
    assert "".join(out) == expected
    sent = ""
    for piece in out[:-1]:  # nothing of a stop string is ever sent, even partly
        sent += piece
        assert expected.startswith(sent)


def test_stop_strings_are_not_looked_for_before_min_tokens():
    """As vLLM: a stop string ending within the first min_tokens tokens does not stop; one ending
    after does (bytes are tokens: TEXT's first "o" is token 6, the next is in "ok")."""
    assert "".join(pieces(["o"], min_tokens=6)) == "héll"
    assert "".join(pieces(["o"], min_tokens=7)) == "héllo 😀 wörld, 日本 "


def test_the_chat_template_comes_from_the_checkpoint(tmp_path):
    template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": template}],
         "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    spec = json.loads(tokenizer_files(str(tmp_path))["chat_template.json"])
    assert spec == {"template": template, "bos_token": "<s>", "eos_token": "</s>"}
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")  # a separate file wins
    text = tokenizer_files(str(tmp_path))["chat_template.json"].decode()
    assert ChatTemplate.of_json(text, "chat_template.json").render([{"role": "user", "content": "hi"}]) == "hi!"


def test_the_default_template_and_a_template_that_refuses():
    assert ChatTemplate(DEFAULT_TEMPLATE).render([{"role": "user", "content": "hi"}]) == "user: hi\nassistant:"
    strict = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok")
    with pytest.raises(ValueError, match="user first"):
        strict.render([{"role": "system", "content": "x"}])
    with pytest.raises(Exception, match="not allowed|unsafe|access"):  # the sandbox
        ChatTemplate("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}").render([])
