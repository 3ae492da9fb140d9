"""A chat choice's text as OpenAI's message, without a server: the thinking split from the answer
however the text is cut into deltas, DeepSeek's and the tags' tool-call markups read back, and
streamed deltas that add up to the whole message."""

import json

import pytest

from deepinfer.runtime.serve.chat_output import ChatOutput, Shape
from deepinfer.runtime.serve.reasoning import ReasoningStream, thinking_prompt
from deepinfer.runtime.serve.tools import ToolUse, parse_markup

ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
DEEPSEEK_V3 = ("Let me add.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n"
               '{"a": 1, "b": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
DEEPSEEK_V31 = '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{"a": 1, "b": 2}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'


def pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 100])
def test_thinking_is_split_from_the_answer_however_the_deltas_fall(size):
    for thinking, text, expected in [(True, "a plan</think>\n\nthe answer", ("a plan", "the answer")),
                                     (False, "<think>hm</think>yes", ("hm", "yes")),
                                     (False, "no thinking <think> here", ("", "no thinking <think> here")),
                                     (True, "never ends </thi", ("never ends </thi", ""))]:
        stream, reasoning, content = ReasoningStream(thinking), "", ""
        for piece in pieces(text, size):
            r, c = stream.add(piece)
            reasoning, content = reasoning + r, content + c
        r, c = stream.finish()
        assert (reasoning + r, content + c) == expected, (text, size)


def test_a_prompt_leaves_thinking_open_or_not():
    assert thinking_prompt("# assistant:\n<think>\n") and not thinking_prompt("<think>x</think># assistant:\n")


@pytest.mark.parametrize("text,markup,head", [(DEEPSEEK_V3, "deepseek_v3", "Let me add."), (DEEPSEEK_V31, "deepseek_v3", None),
                                              ('ok <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>', "tags", "ok")])
def test_tool_call_markups_are_read_back(text, markup, head):
    left, calls = parse_markup(text, markup, {"add"})
    assert left == head and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("add", {"a": 1, "b": 2})]
    assert parse_markup(text, markup, {"other"}) == (text, [])  # (an unknown function is no call)


@pytest.mark.parametrize("choice", ["auto", "required", "function"])
def test_streamed_deltas_add_up_to_the_whole_message(choice):
    text = {"auto": 'Sure. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>',
            "required": '[{"name":"add","parameters":{"a":1}}]', "function": '{"a":1}'}[choice]
    shape = Shape(chat=True, tools=ToolUse([ADD], choice, "add" if choice == "function" else ""), markup="tags")
    output = ChatOutput(shape)
    output.add(text)
    whole, finish = output.message("stop")
    stream, content, arguments = ChatOutput(shape), "", ""
    deltas = [stream.add(piece) for piece in pieces(text, 3)]
    last, streamed_finish = stream.finish("stop")
    for delta in deltas + [last]:
        content += delta.get("content", "")
        arguments += "".join(c["function"].get("arguments", "") for c in delta.get("tool_calls", []))
    assert finish == streamed_finish == "tool_calls"
    assert content.strip() == (whole["content"] or "") and arguments == whole["tool_calls"][0]["function"]["arguments"]


def test_auto_keeps_one_call_without_parallel_tool_calls():
    two = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
    for parallel, count in ((True, 2), (False, 1)):
        _, calls = ToolUse([ADD], "auto", parallel=parallel).calls(two, "tags")
        assert len(calls) == count and json.loads(calls[0]["function"]["arguments"]) == {"a": 1}
