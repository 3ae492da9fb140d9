"""One chat choice's generated text as OpenAI's assistant message: `reasoning_content` (the
thinking, with a reasoning parser), `content`, and `tool_calls` read out of the text (tools.py),
whole or as stream deltas. A named function's arguments stream as tool-call deltas as they are
generated; other content that may turn out to be tool calls is held back -- all of it for
`required`, from the template's markup on for `auto` -- and its calls come in the last delta.
Tool calls end a choice with finish_reason "tool_calls"."""

from dataclasses import dataclass

from .reasoning import ReasoningStream, partial_suffix
from .tools import MARKUPS, ToolUse, call


@dataclass(frozen=True)
class Shape:
    """What shapes a request's answer beyond its text."""

    chat: bool
    tools: ToolUse | None = None
    markup: str | None = None  # the chat template's tool-call markup (tools.MARKUPS)
    reasoning: bool = False  # split the thinking into reasoning_content (the server's --reasoning-parser)
    thinking: bool = False  # the prompt left a thinking block open

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the text is decoded with special tokens: DeepSeek's tool-call markup is made of them."""
        return self.markup == "deepseek_v3" and self.tools is not None and self.tools.choice == "auto"


class ChatOutput:
    def __init__(self, shape: Shape):
        self.tools, self.markup = shape.tools, shape.markup
        self.thinking = ReasoningStream(shape.thinking) if shape.reasoning else None
        choice = self.tools.choice if self.tools is not None else "none"
        self.held_from = {"required": "", "function": "", "auto": MARKUPS[self.markup][0] if self.markup else None}.get(choice)
        self.reasoning = self.content = ""
        self.sent = 0  # characters of content already streamed
        self.call: dict | None = None  # a named function's call, once its first delta went out

    def add(self, text: str) -> dict:
        """New text -> the delta that may be streamed now."""
        reasoning, content = self.thinking.add(text) if self.thinking else ("", text)
        self.reasoning += reasoning
        self.content += content
        if self.tools is not None and self.tools.choice == "function":
            return self._arguments(reasoning)
        return _delta(reasoning, self._streamable())

    def _arguments(self, reasoning: str) -> dict:
        """A named function's new argument text as a tool-call delta (the first names the call)."""
        piece, self.sent = self.content[self.sent:], len(self.content)
        delta = _delta(reasoning, "")
        if piece and self.call is None:
            self.call = call(self.tools.name, "")
            delta["tool_calls"] = [{"index": 0, **self.call, "function": {"name": self.tools.name, "arguments": piece}}]
        elif piece:
            delta["tool_calls"] = [{"index": 0, "function": {"arguments": piece}}]
        return delta

    def finish(self, finish_reason: str) -> tuple[dict, str]:
        """Once the choice ended: the last delta (with any tool calls) and the finish_reason."""
        reasoning, _, calls = self._end()
        if self.tools is not None and self.tools.choice == "function":
            delta = self._arguments(reasoning)
        elif calls:  # (the text before the markup went out already)
            delta = {**_delta(reasoning, ""), "tool_calls": [{"index": j, **c} for j, c in enumerate(calls)]}
        else:
            delta, self.sent = _delta(reasoning, self.content[self.sent:]), len(self.content)
        return delta, _finish(finish_reason, calls)

    def message(self, finish_reason: str) -> tuple[dict, str]:
        """The whole message and the finish_reason, once the choice ended."""
        _, left, calls = self._end()
        message = {"role": "assistant", "content": left if calls else self.content or (None if self.thinking else "")}
        if calls:
            message["tool_calls"] = calls
        if self.thinking:
            message["reasoning_content"] = self.reasoning or None
        return message, _finish(finish_reason, calls)

    def _end(self) -> tuple[str, str | None, list[dict]]:
        """The thinking's last piece, then the content left and the tool calls of the whole text."""
        reasoning, content = self.thinking.finish() if self.thinking else ("", "")
        self.reasoning += reasoning
        self.content += content
        if self.tools is None:
            return reasoning, self.content, []
        return (reasoning, *self.tools.calls(self.content, self.markup))

    def _streamable(self) -> str:
        end = len(self.content)
        if self.held_from == "":
            end = 0
        elif self.held_from:
            found = self.content.find(self.held_from)
            end = found if found >= 0 else end - partial_suffix(self.content, self.held_from)
        end = max(end, self.sent)
        out, self.sent = self.content[self.sent:end], end
        return out


def _delta(reasoning: str, content: str) -> dict:
    delta = {}
    if reasoning:
        delta["reasoning_content"] = reasoning
    if content:
        delta["content"] = content
    return delta


def _finish(finish_reason: str, calls: list) -> str:
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason
