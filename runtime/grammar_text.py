"""What a request asks its output to follow, as an llguidance grammar: a JSON schema, a regex, a
list of choices, or a Lark / GBNF grammar. The tokenizer plays no part here (runtime/grammar.py
builds matchers over it), and neither does torch: deepinfer-serve converts in a small bounded
worker process (serve/grammar_worker.py).

    kinds: "json" (a JSON schema, dict), "regex", "choice" (list of strings), "grammar" (Lark or GBNF)
"""

import json

from .errors import DeepinferError

KINDS = ("json", "regex", "choice", "grammar")
# What one grammar may cost (llguidance's units: "fuel" ~ 50k/ms to build the lexer, ~14k/ms a
# mask step; lexer states ~1-2 kB each): a schema or regex past these is refused, not compiled.
LIMITS = dict(initial_lexer_fuel=2_000_000, step_lexer_fuel=400_000, max_lexer_states=100_000,
              max_grammar_size=200_000)


class GrammarError(DeepinferError):
    """A grammar llguidance refuses (its message), or one past the limits."""


def llguidance():
    try:
        import llguidance
    except ImportError:
        raise DeepinferError("structured outputs need llguidance: pip install 'deepinfer[serve]'.") from None
    return llguidance


def grammar_text(kind: str, spec) -> str:
    """A request's constraint as an llguidance grammar (the tokenizer plays no part); raises
    GrammarError. JSON is compact (no whitespace between tokens: a model cannot ramble in it)."""
    lg = llguidance()
    try:
        if kind == "json":
            return lg.LLMatcher.grammar_from_json_schema(json.dumps(spec), overrides={"whitespace_flexible": False})
        if kind == "choice":
            return lg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))
        if kind == "regex":
            return lg.LLMatcher.grammar_from_regex(spec)
        if kind == "grammar":
            return lg.grammar_from("grammar", spec)  # Lark, or GBNF converted to Lark
    except ValueError as err:
        raise GrammarError(first_lines(str(err))) from None
    raise GrammarError(f"unknown grammar kind {kind!r}: give one of {', '.join(KINDS)}.")


def checked(grammar: str) -> str:
    """The grammar, once llguidance compiled it under LIMITS without a tokenizer (what a schema's
    size costs: a 15 MB schema of nested anyOf is refused in 0.5 s); raises GrammarError."""
    error = llguidance().LLMatcher.validate_grammar(grammar, None, limits=parser_limits())
    if error:
        raise GrammarError(first_lines(error))
    return grammar


def parser_limits():
    return llguidance().LLParserLimits(**LIMITS, verbose_errors=False)


def first_lines(message: str) -> str:
    """llguidance's message without its grammar dump: the first lines, bounded."""
    return " ".join(message.strip().splitlines()[:3])[:500]
