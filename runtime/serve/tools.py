"""Function tools, as OpenAI's chat API spells them: the request's `tools`, `tool_choice` and
`parallel_tool_calls`, and the model's output read back as `tool_calls`.

`required` and a named function constrain the output to JSON (vLLM's way, whatever the template):
a named function's output is its arguments, valid against its `parameters` schema; `required` is
an array of {"name", "parameters"} calls of the given functions (one call unless
parallel_tool_calls). `auto` leaves the model free and reads tool calls out of its text where the
chat template defines a markup for them (MARKUPS: DeepSeek-V3's and V3.1's special tokens, or
<tool_call>{json}</tool_call> tags); `none` reads nothing.
"""

import json
import re
import uuid
from dataclasses import dataclass

from .api_error import bad
from .structured import OutputConstraint

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}

# The tool-call markups the chat templates we know define, each a regex over the output text (with
# special tokens) whose groups are (name, arguments), and what starts it (text before it is content).
MARKUPS = {
    "deepseek_v3": ("<｜tool▁calls▁begin｜>", re.compile(
        r"<｜tool▁call▁begin｜>(?:function<｜tool▁sep｜>)?([^\n<]+?)(?:\n```json\n|<｜tool▁sep｜>)(.*?)(?:\n```)?<｜tool▁call▁end｜>",
        re.S)),
    "tags": ("<tool_call>", re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)),
}


@dataclass(frozen=True)
class ToolUse:
    tools: list  # the request's function tools, as given
    choice: str  # "none" | "auto" | "required" | "function" (a named one)
    name: str = ""  # the named function's
    parallel: bool = True

    def constraint(self) -> OutputConstraint | None:
        """The JSON the output must be: `required`'s array of calls, a named function's arguments."""
        if self.choice == "function":
            return OutputConstraint("json", _parameters(self._tool(self.name)), "tool_choice")
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]}, "parameters": _parameters(t)},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
        array = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        return OutputConstraint("json", {**array, "maxItems": 1} if not self.parallel else array, "tools")

    def calls(self, text: str, markup: str | None) -> tuple[str | None, list[dict]]:
        """(the content left, OpenAI's tool_calls) of an output; (text, []) when it holds none."""
        if self.choice == "function":
            return (None, [call(self.name, text)]) if isinstance(_json(text), dict) else (text, [])
        if self.choice == "required":
            calls = _json(text)
            if not isinstance(calls, list) or not calls:
                return text, []
            return None, [call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]
        if self.choice == "auto" and markup is not None:
            left, calls = parse_markup(text, markup, {t["function"]["name"] for t in self.tools})
            return left, calls if self.parallel else calls[:1]  # (parallel_tool_calls false: the first)
        return text, []

    def _tool(self, name: str) -> dict:
        return next(t for t in self.tools if t["function"]["name"] == name)


def parse_tools(body: dict) -> ToolUse | None:
    """The request's tools (None: it gave none and asks for none)."""
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise bad(legacy, "deprecated by OpenAI and not served here: give \"tools\" and \"tool_choice\" instead.")
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", f"{parallel!r}: give true or false.")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise bad("tool_choice", f"{choice!r} needs \"tools\".")
        return None
    if not isinstance(tools, list) or len(tools) > 128:
        raise bad("tools", "give a list of at most 128 {\"type\": \"function\", \"function\": {...}} objects.")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad(where, "only {\"type\": \"function\", \"function\": {\"name\", \"description\", \"parameters\"}} "
                             "tools are served.")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise bad(f"{where}.function.name", f"{name!r}: give 1 to 64 letters, digits, _ or -.")
        if name in names:
            raise bad(f"{where}.function.name", f"{name!r} is given twice.")
        names.add(name)
        if not isinstance(function.get("parameters", {}), dict):
            raise bad(f"{where}.function.parameters", "give a JSON schema object.")
    if choice is None or choice in ("none", "auto", "required"):
        return ToolUse(tools, choice or "auto", parallel=parallel)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise bad("tool_choice", f"function {name!r} is not among the request's tools ({', '.join(sorted(names))}).")
        return ToolUse(tools, "function", name, parallel)
    raise bad("tool_choice", "give \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}.")


def template_markup(source: str) -> str | None:
    """The tool-call markup a chat template defines (None: it defines none)."""
    return next((name for name, (start, _) in MARKUPS.items() if start in source), None)


def parse_markup(text: str, markup: str, names: set[str]) -> tuple[str | None, list[dict]]:
    """(the text before the markup, or None when empty; the calls of known functions with JSON
    arguments) -- or (text, []) when the markup holds no such call."""
    start, pattern = MARKUPS[markup]
    head, found, rest = text.partition(start)
    calls = []
    for match in pattern.finditer(found + rest):
        if markup == "tags":
            tagged = _json(match.group(1))
            name, arguments = (tagged.get("name"), tagged.get("arguments")) if isinstance(tagged, dict) else (None, None)
        else:
            name, arguments = match.group(1).strip(), _json(match.group(2))
        if name in names and isinstance(arguments, dict):
            calls.append(call(name, json.dumps(arguments, ensure_ascii=False)))
    if not calls:
        return text, []
    return head.strip() or None, calls


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or EMPTY_PARAMETERS


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def call(name: str, arguments: str) -> dict:
    """OpenAI's tool call of `name` with `arguments` (JSON text), under a new id."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": arguments}}
