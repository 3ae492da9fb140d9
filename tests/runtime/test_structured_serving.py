"""What agents send, through the official openai client, to deepinfer-serve on the trained tiny model
with MTP speculation (k = 3): JSON schemas (response_format, structured_outputs and the older
guided_* names), regexes and choices, tools with every tool_choice and an agent's loop (a call, its
result sent back, the answer), a reasoning model's thinking; streamed and whole alike; and the 400s
that bad schemas and unknown fields get. Every constrained answer is checked by jsonschema or re."""

import json
import re

import jsonschema
import openai
import pytest

from deepinfer.compiler.build import compile_recipe
from deepinfer.compiler.recipe import load_recipe
from tests.conftest import ROOT
from tests.runtime.serving import API_KEY, Served
from tests.runtime.test_grammar import SCHEMA

MODEL = "tiny-code"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 10},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                                   "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                                  "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, cache_dir):
    """recipes/tiny-code.yaml (its MTP module drafting 3 tokens) through the export backend."""
    out = tmp_path_factory.mktemp("structured") / MODEL
    compile_recipe(load_recipe(ROOT / "recipes" / "tiny-code.yaml", backend="export", output=out), cache_dir=cache_dir,
                   progress=False)
    served = Served(out, "--reasoning-parser", "deepseek_r1")
    yield served
    code, stderr = served.stop()
    assert code == 0, stderr


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def streamed(client, **request) -> tuple[dict, str]:
    """A streamed chat answer put together: ({"content", "reasoning_content", "tool_calls"}, finish_reason)."""
    message, calls, finish = {"content": "", "reasoning_content": ""}, {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **request):
        for choice in chunk.choices:
            delta = choice.delta
            message["content"] += delta.content or ""
            message["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
            for call in delta.tool_calls or []:
                whole = calls.setdefault(call.index, {"id": call.id, "name": call.function.name, "arguments": ""})
                whole["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, finish


@pytest.mark.parametrize("temperature,seeds", [(0.0, [0]), (0.9, [1, 2, 3])])
def test_json_schema_answers_validate_streamed_or_not(client, temperature, seeds):
    response_format = {"type": "json_schema", "json_schema": {"name": "module", "schema": SCHEMA, "strict": True}}
    for seed in seeds:
        reply = client.chat.completions.create(model=MODEL, messages=ASK, response_format=response_format,
                                               temperature=temperature, seed=seed, max_tokens=200)
        text = reply.choices[0].message.content
        assert reply.choices[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
        message, finish = streamed(client, messages=ASK, response_format=response_format, temperature=temperature,
                                   seed=seed, max_tokens=200)
        assert (message["content"], finish) == (text, "stop")


def test_every_way_of_asking_for_json_regex_or_choices(client):
    asked = [({"extra_body": {"structured_outputs": {"json": SCHEMA}}}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
             ({"extra_body": {"guided_json": SCHEMA}}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
             ({"extra_body": {"structured_outputs": {"regex": r"[a-z]{2,6}\.py"}}}, lambda t: re.fullmatch(r"[a-z]{2,6}\.py", t)),
             ({"extra_body": {"guided_regex": r"v[0-9]\.[0-9]{1,2}"}}, lambda t: re.fullmatch(r"v[0-9]\.[0-9]{1,2}", t)),
             ({"extra_body": {"structured_outputs": {"choice": ["yes", "no"]}}}, lambda t: t in ("yes", "no")),
             ({"extra_body": {"guided_choice": ["red", "green"]}}, lambda t: t in ("red", "green")),
             ({"extra_body": {"structured_outputs": {"grammar": 'root ::= "x = " [0-9] [0-9]? ";"'}}}, lambda t: re.fullmatch(r"x = [0-9]{1,2};", t))]
    for extra, valid in asked:
        reply = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0.9, seed=7, max_tokens=120, **extra)
        text = reply.choices[0].message.content
        assert valid(text), (extra, text)
    # Any JSON object: unbounded, so the tiny model may ramble past max_tokens; what ends is an object.
    replies = [client.chat.completions.create(model=MODEL, messages=ASK, temperature=t, seed=seed, max_tokens=120,
                                              response_format={"type": "json_object"}).choices[0] for t, seed in [(0.7, 3), (0.9, 1)]]
    assert all(isinstance(json.loads(c.message.content), dict) for c in replies if c.finish_reason == "stop")
    assert replies[0].finish_reason == "stop"
    # completions take them too; n > 1 choices each follow the grammar (and share the prompt's prefill)
    reply = client.completions.create(model=MODEL, prompt="def f(", n=3, temperature=0.9, seed=3, max_tokens=20,
                                      extra_body={"structured_outputs": {"regex": "[a-z]{1,5}\\):"}})
    assert len(reply.choices) == 3 and all(re.fullmatch(r"[a-z]{1,5}\):", c.text) for c in reply.choices)


def test_tools_required_and_named_give_valid_calls(client):
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        for seed in (1, 2):
            request = dict(messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0.9, seed=seed, max_tokens=120,
                           parallel_tool_calls=False)
            reply = client.chat.completions.create(model=MODEL, **request)
            message = reply.choices[0].message
            assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
            assert len(message.tool_calls) == 1  # parallel_tool_calls false
            call = message.tool_calls[0]
            assert call.type == "function" and call.id.startswith("call_")
            if isinstance(choice, dict):
                assert call.function.name == "add"
            jsonschema.validate(json.loads(call.function.arguments), parameters[call.function.name])
            stream, finish = streamed(client, **request)
            assert finish == "tool_calls" and [(c["name"], c["arguments"]) for c in stream["tool_calls"]] == \
                [(call.function.name, call.function.arguments)]


def test_an_agent_loop_a_call_its_result_and_the_answer(client, server):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0,
                                           max_tokens=120)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 3})}]
    assert history[1]["role"] == "assistant" and "content" not in history[1]  # (as the SDK sends it back)
    final = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="auto", max_tokens=30,
                                           temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert final.usage.prompt_tokens_details.cached_tokens >= 16  # (the first turn's prefix: prefix caching composes)
    # The history rendered through the template: the call as its markup, then the tool's result.
    tokens = client.post("/../tokenize", cast_to=object, body={"messages": history})
    detokenized = client.post("/../detokenize", cast_to=object, body={"tokens": tokens["tokens"]})["prompt"]
    assert f'<tool_call>{{"name": "{call.function.name}", "arguments": {call.function.arguments}}}</tool_call>' in detokenized
    assert '# tool:\n{"temperature": 3}\n# assistant:\n' in detokenized and "# tools:\n" not in detokenized  # (no tools given)


def test_auto_reads_the_templates_tool_call_markup(client):
    """The tiny model does not call tools on its own: a grammar makes it write the template's
    markup (a regex of it), and `auto` reads the call out of it."""
    markup = r'<tool_call>\{"name": "add", "arguments": \{"a": [1-9], "b": [1-9]\}\}</tool_call>'
    request = dict(messages=ASK, tools=TOOLS, tool_choice="auto", temperature=0.9, seed=4, max_tokens=60,
                   extra_body={"structured_outputs": {"regex": r"Sure\. " + markup}})
    reply = client.chat.completions.create(model=MODEL, **request)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content == "Sure."
    assert message.tool_calls[0].function.name == "add"
    jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), ADD["function"]["parameters"])
    stream, finish = streamed(client, **request)
    assert finish == "tool_calls" and stream["content"] == "Sure. " and stream["tool_calls"][0]["arguments"] == \
        message.tool_calls[0].function.arguments


def test_thinking_is_reasoning_content_and_the_grammar_follows_it(client):
    """reasoning_effort turns the template's thinking switch on: the tiny model thinks (and, never
    having learnt to stop, thinks until max_tokens): all of it is reasoning_content, in a stream too."""
    request = dict(messages=ASK, reasoning_effort="high", temperature=0, max_tokens=24,
                   extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    reply = client.chat.completions.create(model=MODEL, **request)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "length" and message.content is None and message.model_extra["reasoning_content"]
    stream, _ = streamed(client, **request)
    assert stream["reasoning_content"] == message.model_extra["reasoning_content"] and stream["content"] == ""
    off = client.chat.completions.create(model=MODEL, extra_body={"chat_template_kwargs": {"thinking": False},
                                                                  "structured_outputs": {"choice": ["yes", "no"]}},
                                         messages=ASK, temperature=0, max_tokens=24, reasoning_effort="high")
    assert off.choices[0].message.content in ("yes", "no") and off.choices[0].message.model_extra["reasoning_content"] is None


def test_what_sdks_send_by_default_is_accepted(client):
    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, store=False, metadata={"run": "1"},
                                           service_tier="auto", parallel_tool_calls=True, reasoning_effort="none",
                                           prompt_cache_key="k", safety_identifier="u1", modalities=["text"], tools=TOOLS)
    assert reply.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("extra,param,said", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema", "objekt"),
    ({"extra_body": {"guided_regex": "(a"}}, "guided_regex", "regex"),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= nothing"}}}, "structured_outputs.grammar", "nothing"),
    ({"extra_body": {"structured_outputs": {"choice": []}}}, "structured_outputs.choice", "non-empty"),
    ({"extra_body": {"structured_outputs": {"json": SCHEMA, "regex": "a"}}}, "structured_outputs", "exactly one"),
    ({"extra_body": {"guided_json": SCHEMA, "guided_regex": "a"}}, "guided_", "one output constraint"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among"),
    ({"tool_choice": "required"}, "tool_choice", "needs"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name", "letters"),
    ({"extra_body": {"functions": [ADD["function"]]}}, "functions", "deprecated"),
    ({"modalities": ["audio"]}, "modalities", "not supported"),
    ({"extra_body": {"made_up": 1}}, "made_up", "unknown"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "extreme"),
])
def test_bad_requests_name_the_field(client, extra, param, said):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **extra)
    error = caught.value.body
    assert error["param"].startswith(param) and said in error["message"], error


def test_a_hostile_schema_is_refused_in_bounded_time_and_the_server_goes_on(client):
    """allOf over 30 anyOf pairs is 2^30 object shapes: refused by the grammar library's limits
    (in the bounded worker), and the server answers the next request."""
    hostile = {"type": "object", "allOf": [{"anyOf": [{"properties": {f"a{i}": {"type": "integer"}}, "required": [f"a{i}"]},
                                                      {"properties": {f"b{i}": {"type": "string"}}, "required": [f"b{i}"]}]}
                                           for i in range(30)]}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "h", "schema": hostile}})
    error = caught.value.body
    assert error["param"] == "response_format.json_schema.schema" and "too large" in error["message"], error
    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=30, response_format={
        "type": "json_schema", "json_schema": {"name": "module", "schema": SCHEMA}})
    assert reply.choices[0].message.content.startswith('{"name":"')


def test_the_sdks_pydantic_helpers_parse_what_comes_back(client):
    """What instructor-style code calls: the SDK's parse() with a pydantic model (a strict JSON
    schema), its streaming helper, and pydantic_function_tool (a strict tool)."""
    from typing import Literal

    import pydantic

    class Owner(pydantic.BaseModel):
        id: int = pydantic.Field(ge=1, le=999)
        alias: str | None = pydantic.Field(max_length=6)

    class Module(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=12)
        kind: Literal["io", "os", "re"]
        owner: Owner

    class GetWeather(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=10)

    parsed = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Module, temperature=0.9, seed=3)
    assert isinstance(parsed.choices[0].message.parsed, Module)
    with client.chat.completions.stream(model=MODEL, messages=ASK, response_format=Module, temperature=0.9, seed=3) as stream:
        assert stream.get_final_completion().choices[0].message.parsed == parsed.choices[0].message.parsed
    called = client.chat.completions.parse(model=MODEL, messages=ASK, tools=[openai.pydantic_function_tool(GetWeather)],
                                           tool_choice="required", temperature=0.9, seed=1)
    assert isinstance(called.choices[0].message.tool_calls[0].function.parsed_arguments, GetWeather)
