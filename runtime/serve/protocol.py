"""OpenAI's request and response shapes: parse a request body into what the engine needs,
refusing (APIError, naming the parameter) anything out of range or not built. A parameter we do
not implement is accepted only at the value that asks for nothing (best_of=1, suffix null, ...).
Sampling knobs follow OpenAI's documented ranges and vLLM's extensions (top_k, min_p,
repetition_penalty, min_tokens, stop_token_ids)."""

import json
import math
from dataclasses import dataclass, field

from ..sampling import MAX_LOGPROBS, SamplingError, SamplingParams
from ..tokenizer import is_text
from .api_error import APIError, bad
from .structured import parse_output_constraint
from .tools import parse_tools

# Parameters we do not build, and the values each may take (what asking for nothing looks like).
NEUTRAL = {"best_of": (None, 1), "suffix": (None, ""), "modalities": (None, ["text"]), "audio": (None,),
           "web_search_options": (None,)}
COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "user", "n",
          "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
          # output constraints (structured.py): OpenAI's response_format, vLLM's structured_outputs and guided_*
          "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
          # vLLM's extensions
          "ignore_eos", "return_token_ids", "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids",
          "cache_salt"}
# OpenAI's, accepted and without effect here (docs/serving.md says so): storage, routing and billing
# hints, the prompt cache's key (prefix caching needs none), a predicted output.
IGNORED = {"store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier", "prediction", "verbosity"}
COMPLETION_FIELDS = COMMON | {"prompt", "echo"}
CHAT_FIELDS = COMMON | IGNORED | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                                  "parallel_tool_calls", "functions", "function_call", "reasoning_effort",
                                  "chat_template_kwargs"}
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
MAX_N = 16  # choices per prompt
# The engine's finish reasons as OpenAI's finish_reason (and vLLM's finished_reason metric label).
FINISH_REASONS = {"eos": "stop", "stop": "stop", "stop_token": "stop", "grammar": "stop", "max_tokens": "length",
                  "context": "length"}


@dataclass
class Generation:
    """What a completions or chat request asks the engine for (prompts are text or token ids)."""

    prompts: list  # of str or list[int]
    max_tokens: int | None  # None: up to the context limit
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage in every chunk
    ignore_eos: bool = False
    return_token_ids: bool = False
    max_tokens_param: str = "max_tokens"  # the name the client used (chat: max_completion_tokens too)
    n: int = 1  # choices per prompt
    echo: bool = False  # completions: the prompt comes back before the completion (with its logprobs if asked)
    cache_salt: str = ""  # vLLM's: prefix caching shares state only among requests of the same salt
    constraint: object = None  # structured.OutputConstraint the output follows (tools' included), or None
    tools: object = None  # chat: tools.ToolUse, or None
    template_kwargs: dict = field(default_factory=dict)  # chat: chat_template_kwargs (reasoning_effort's switch too)


def parse_completion(body: dict) -> Generation:
    _check_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif _is_ids(prompt) and prompt:
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or (_is_ids(p) and p) for p in prompt):
        prompts = list(prompt)
    else:
        raise bad("prompt", "give a string, a list of strings, a list of token ids, or a list of such lists "
                            "(none of them empty).")
    return _generation(body, prompts, _optional_int(body, "max_tokens", 16), logprobs=_optional_int(body, "logprobs", None),
                       echo=_flag(body, "echo"))


def parse_chat(body: dict) -> Generation:
    _check_fields(body, CHAT_FIELDS)
    messages = body.get("messages")
    _check_messages(messages)
    top = _optional_int(body, "top_logprobs", 0)
    if not 0 <= top <= MAX_LOGPROBS:
        raise bad("top_logprobs", f"{top}: give 0 to {MAX_LOGPROBS}.")
    logprobs = top if _flag(body, "logprobs") else None
    if logprobs is None and top:
        raise bad("top_logprobs", "needs \"logprobs\": true.")
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is not None:
        generation = _generation(body, [messages], _optional_int(body, "max_completion_tokens", None),
                                 "max_completion_tokens", logprobs=logprobs)
    else:
        generation = _generation(body, [messages], _optional_int(body, "max_tokens", None), logprobs=logprobs)
    generation.tools = parse_tools(body)
    tool_constraint = generation.tools.constraint() if generation.tools is not None else None
    if tool_constraint is not None:
        if generation.constraint is not None:
            raise bad(generation.constraint.param, f"tool_choice {generation.tools.choice!r} constrains the output to "
                                                   "tool calls already: drop one of them.")
        generation.constraint = tool_constraint
    generation.template_kwargs = _template_kwargs(body)
    return generation


def _template_kwargs(body: dict) -> dict:
    """chat_template_kwargs, and reasoning_effort as the `thinking` switch DeepSeek's templates read
    (templates without it ignore it; an explicit chat_template_kwargs.thinking wins)."""
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or len(json.dumps(kwargs)) > 65536:
        raise bad("chat_template_kwargs", "give an object (of at most 64 KiB as JSON).")
    reserved = set(kwargs) & {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}
    if reserved:
        raise bad("chat_template_kwargs", f"{sorted(reserved)[0]!r} is set by the server, not by the request.")
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise bad("reasoning_effort", f"{effort!r}: give one of {', '.join(REASONING_EFFORTS)}.")
    if effort is not None and "thinking" not in kwargs:
        kwargs = {**kwargs, "thinking": effort not in ("none", "minimal")}
    return kwargs


def _check_messages(messages):
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "give a non-empty list of {\"role\", \"content\"} objects.")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad(f"messages[{i}]", "each message is an object with a string \"role\".")
        content = message.get("content")
        calls = message.get("tool_calls")
        if calls is not None:
            if message["role"] != "assistant" or not isinstance(calls, list) or not all(_is_call(c) for c in calls):
                raise bad(f"messages[{i}].tool_calls", "an assistant's list of {\"id\", \"type\": \"function\", "
                                                       "\"function\": {\"name\", \"arguments\": string}}.")
        if isinstance(content, list):  # content parts: only text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise bad(f"messages[{i}].content", "only text content parts ({\"type\": \"text\", \"text\": ...}) are supported.")
        elif content is None and message["role"] == "assistant":
            pass  # (one that made tool calls, or said nothing)
        elif not isinstance(content, str):
            raise bad(f"messages[{i}].content", "give a string or a list of text parts.")


def _is_call(call) -> bool:
    function = call.get("function") if isinstance(call, dict) else None
    return isinstance(function, dict) and isinstance(function.get("name"), str) and isinstance(function.get("arguments"), str)


def message_text(message: dict) -> dict:
    """A chat message with its content parts joined into one string (what templates expect)."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(part["text"] for part in content)
    return {**message, "content": content}


def _generation(body: dict, prompts: list, max_tokens: int | None, max_tokens_param: str = "max_tokens",
                logprobs: int | None = None, echo: bool = False) -> Generation:
    """`logprobs`: top logprobs per generated token (None: none); `echo`: completions' echo."""
    scored = echo and logprobs is not None  # the prompt's own logprobs come back
    if max_tokens is not None and max_tokens < (0 if scored else 1):
        raise bad(max_tokens_param, f"{max_tokens} is not a number of tokens to generate: give 1 or more "
                                    "(0 only with echo and logprobs: the prompt scored).")
    temperature = _number(body, "temperature", 1.0)
    if not 0 <= temperature <= 2:
        raise bad("temperature", f"{temperature} is outside [0, 2].")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise bad("top_p", f"{top_p} is outside (0, 1].")
    seed = body.get("seed")
    if seed is None:
        import secrets

        seed = secrets.randbits(63)
    elif not _is_int(seed) or not 0 <= seed < 1 << 63:
        raise bad("seed", f"{seed!r}: give an integer in [0, 2**63).")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop", "give a non-empty string or a list of at most 4 of them.")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise bad("stream_options", "give {\"include_usage\": true|false} and, as vLLM, \"continuous_usage_stats\": true|false.")
    include_usage = _flag(options, "include_usage", "stream_options.include_usage")
    continuous = _flag(options, "continuous_usage_stats", "stream_options.continuous_usage_stats")
    n = _optional_int(body, "n", 1)
    if not 1 <= n <= MAX_N:
        raise bad("n", f"{n}: give 1 to {MAX_N} choices.")
    min_tokens = _optional_int(body, "min_tokens", 0)
    if min_tokens < 0 or max_tokens is not None and min_tokens > max_tokens:
        raise bad("min_tokens", f"{min_tokens}: give 0 up to {max_tokens_param} ({max_tokens}).")
    sampling = SamplingParams(
        temperature, top_p, seed, top_k=_top_k(body), min_p=_number(body, "min_p", 0.0),
        presence_penalty=_number(body, "presence_penalty", 0.0), frequency_penalty=_number(body, "frequency_penalty", 0.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0), logit_bias=_logit_bias(body.get("logit_bias")),
        min_tokens=min_tokens, stop_token_ids=tuple(_token_list(body, "stop_token_ids")), logprobs=logprobs,
        prompt_logprobs=logprobs if scored else None)
    try:
        sampling.check()  # the ranges (the vocabulary and the bundle's score programs are checked once it is loaded)
    except SamplingError as err:
        raise APIError(400, str(err), param=err.param) from None
    salt = body.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= 1024):
        raise bad("cache_salt", "give a non-empty string of at most 1024 characters (requests of one salt share cached prompts).")
    return Generation(prompts, max_tokens, sampling, stop,
                      stream=_flag(body, "stream"), include_usage=include_usage, continuous_usage=include_usage and continuous,
                      ignore_eos=_flag(body, "ignore_eos"), return_token_ids=_flag(body, "return_token_ids"),
                      max_tokens_param=max_tokens_param, n=n, echo=echo, cache_salt=salt or "",
                      constraint=parse_output_constraint(body))


def _top_k(body: dict) -> int:
    """vLLM's top_k: -1 or 0 (or absent) keeps every token."""
    top_k = _optional_int(body, "top_k", 0)
    if top_k < -1:
        raise bad("top_k", f"{top_k}: give a number of tokens, or -1 / 0 for all.")
    return max(top_k, 0)


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias in [-100, 100]} (the ids are checked against the vocabulary later)."""
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > 1024:
        raise bad("logit_bias", "give an object of at most 1024 {\"token id\": bias}.")
    bias = []
    for key, b in value.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 9 or key != str(int(key)):
            raise bad("logit_bias", f"key {key[:20]!r} is not a token id (decimal digits without leading zeros: \"05\" and "
                                    "\"5\" would name one token twice).")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise bad("logit_bias", f"bias {b!r} of token {key}: give a number in [-100, 100].")
        bias.append((int(key), float(b)))
    return tuple(bias)


def _token_list(body: dict, name: str) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if not _is_ids(value) or len(value) > 256 or not all(0 <= t < 1 << 31 for t in value):
        raise bad(name, "give a list of at most 256 token ids.")
    return value


def not_unicode(body) -> str | None:
    """The path of the first string (or key) in a parsed JSON body that is not Unicode text: JSON's
    escapes can spell a lone surrogate ("\\ud800"), which no tokenizer or encoder takes."""
    stack = [("", body)]
    while stack:
        path, value = stack.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        if isinstance(value, str) and not is_text(value):
            return path or "body"
        for key, item in items:
            where = f"{path}[{key}]" if isinstance(value, list) else f"{path}.{key}" if path else key
            if isinstance(key, str) and not is_text(key):
                return f"{path or 'body'} key {key.encode('utf-8', 'backslashreplace').decode()[:40]!r}"
            stack.append((where, item))
    return None


def _check_fields(body: dict, allowed: set):
    for name, value in body.items():
        if name in NEUTRAL:
            if not any(value == v and type(value) is type(v) for v in NEUTRAL[name]):
                raise bad(name, f"{json.dumps(value)[:80]} is not supported by this server (only "
                                f"{' or '.join(json.dumps(v) for v in NEUTRAL[name])}).")
        elif name not in allowed:
            raise bad(name, "unknown or unsupported parameter.")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_ids(value) -> bool:
    return isinstance(value, list) and all(_is_int(t) for t in value)


def _optional_int(body: dict, name: str, default):
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise bad(name, f"{value!r}: give an integer.")
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 1 << 64:  # (JSON integers have no limit)
        raise bad(name, f"an integer of {value.bit_length()} bits, past any float: give a finite number.")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(name, f"{value!r}: give a finite number.")
    return float(value)


def _flag(body: dict, name: str, param: str | None = None, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(param or name, f"{value!r}: give true or false.")
    return value


def parse_tokenize(body: dict) -> tuple[str | None, list | None, bool]:
    """vLLM's /tokenize: (prompt text, or chat messages rendered as a chat request's; add_special_tokens)."""
    _check_fields(body, {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt"})
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise bad("prompt", "give a \"prompt\" string or chat \"messages\", one of them.")
    if prompt is not None and not isinstance(prompt, str):
        raise bad("prompt", "give a string.")
    if messages is not None:
        _check_messages(messages)
    if body.get("add_generation_prompt", True) is not True:
        raise bad("add_generation_prompt", "only true (messages are rendered as a chat request's) is supported.")
    return prompt, messages, _flag(body, "add_special_tokens", default=True)


def parse_detokenize(body: dict, vocab_size: int) -> list[int]:
    """vLLM's /detokenize: the token ids, each in the vocabulary."""
    _check_fields(body, {"model", "tokens"})
    tokens = body.get("tokens")
    if not _is_ids(tokens) or not all(0 <= t < vocab_size for t in tokens):
        raise bad("tokens", f"give a list of token ids in [0, {vocab_size}).")
    return tokens
