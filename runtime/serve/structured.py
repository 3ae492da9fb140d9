"""What a request asks its output to follow: OpenAI's `response_format` (json_object, json_schema),
vLLM's `structured_outputs` ({"json" | "regex" | "choice" | "grammar" | "json_object"}) and its older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` names. One of them a request;
the grammar itself is compiled by runtime/grammar.py (its errors name the same parameter)."""

import json
from dataclasses import dataclass

from .api_error import bad

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
FIELDS = {"response_format", "structured_outputs", *GUIDED}
ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class OutputConstraint:
    kind: str  # runtime/grammar.py's KINDS
    spec: object  # a JSON schema (dict), a regex or grammar (str), choices (list of str)
    param: str  # the request field it came from, for errors


def parse_output_constraint(body: dict) -> OutputConstraint | None:
    given = [name for name in FIELDS if body.get(name) is not None and body.get(name) != {"type": "text"}]
    if len(given) > 1:
        raise bad(given[1], f"give one output constraint, not {' and '.join(sorted(given))}.")
    if not given:
        return None
    name = given[0]
    value = body[name]
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        if not isinstance(value, dict):
            raise bad(name, "give an object with one of \"json\", \"regex\", \"choice\", \"grammar\", \"json_object\".")
        kinds = [k for k, v in value.items() if v is not None and v is not False]
        unknown = set(value) - {"json", "regex", "choice", "grammar", "json_object"}
        if unknown:
            raise bad(f"{name}.{sorted(unknown)[0]}", "not supported by this server (json, regex, choice, grammar and "
                                                      "json_object are).")
        if len(kinds) != 1:
            raise bad(name, f"give exactly one of json, regex, choice, grammar, json_object (got {kinds or 'none'}).")
        kind = kinds[0]
        if kind == "json_object":
            return OutputConstraint("json", ANY_OBJECT, f"{name}.json_object")
        return _constraint(kind, value[kind], f"{name}.{kind}")
    return _constraint(GUIDED[name], value, name)


def _response_format(value) -> OutputConstraint:
    param = "response_format"
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return OutputConstraint("json", ANY_OBJECT, param)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise bad(f"{param}.json_schema", "give {\"name\": ..., \"schema\": {...}, \"strict\": true|false}.")
        return _constraint("json", spec.get("schema", ANY_OBJECT), f"{param}.json_schema.schema")
    raise bad(param, f"type {kind!r}: give \"text\", \"json_object\" or \"json_schema\".")


def _constraint(kind: str, value, param: str) -> OutputConstraint:
    if kind == "json":
        if isinstance(value, str):  # (vLLM takes the schema as a JSON string too)
            try:
                value = json.loads(value)
            except ValueError:
                raise bad(param, "not valid JSON: give a JSON schema object.") from None
        if not isinstance(value, dict):
            raise bad(param, "give a JSON schema object.")
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad(param, "give a non-empty list of non-empty strings.")
    elif not isinstance(value, str) or not value:
        raise bad(param, f"give the {kind} as a non-empty string.")
    return OutputConstraint(kind, value, param)
