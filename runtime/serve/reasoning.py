"""Reasoning models' thinking, split from the answer (vLLM's deepseek_r1 reasoning parser): the
output up to "</think>" is `reasoning_content`, the rest `content`.

Whether an output starts inside a thinking block is read from its prompt: the chat template left a
"<think>" open (DeepSeek-R1's always does; V3.1's does with `thinking: true`). Such an output is
reasoning until the model writes "</think>"; one that never does is reasoning only, as vLLM's.
An output that starts with "<think>" itself opens one too. Structured output and tool calls apply
to the content: the grammar starts after the marker (runtime/grammar.py's `after`).
"""

START, END = "<think>", "</think>"


def thinking_prompt(prompt: str) -> bool:
    """Whether a rendered prompt leaves a thinking block open."""
    return prompt.rfind(START) > prompt.rfind(END)


class ReasoningStream:
    """Text as it is generated -> (reasoning delta, content delta), holding back what may be the
    start of a marker split across tokens."""

    def __init__(self, thinking: bool):
        # start: an opening <think> may still come; thinking; ended: </think> seen; answer
        self.state = "thinking" if thinking else "start"
        self.held = ""

    def add(self, text: str) -> tuple[str, str]:
        text, self.held = self.held + text, ""
        reasoning = content = ""
        while text:
            if self.state == "start":
                if START.startswith(text.lstrip()) and text.strip():  # (maybe the opening marker, not whole yet)
                    self.held = text
                    return reasoning, content
                stripped = text.lstrip()
                if stripped.startswith(START):
                    self.state, text = "thinking", stripped[len(START):]
                else:
                    self.state = "answer"
            elif self.state == "thinking":
                before, found, after = text.partition(END)
                if found:
                    reasoning += before
                    self.state, text = "ended", after
                    continue
                keep = partial_suffix(text, END)
                reasoning += text[: len(text) - keep]
                self.held = text[len(text) - keep:]
                return reasoning, content
            elif self.state == "ended":  # (the newlines after </think> are the template's, not the answer's)
                text = text.lstrip("\n")
                if text:
                    self.state = "answer"
            else:
                content += text
                text = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, once the output ended."""
        held, self.held = self.held, ""
        return (held, "") if self.state == "thinking" else ("", held)


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
