"""Grammar-constrained decoding in the engine (runtime/grammar.py with llguidance), on the trained tiny
model (eager): every output of a schema is valid JSON that validates, greedy or sampled; greedy
output with MTP speculation -- drafts checked, and the grammar's forced tokens proposed -- is the
output without, token for token; a matcher's draft masks stop at the first draft the grammar
refuses and leave the matcher where it was; a grammar starts after a reasoning model's "</think>"."""

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from deepinfer.compiler.eager import eager_engine
from deepinfer.models import build_model
from deepinfer.runtime.engine import Request
from deepinfer.runtime.grammar import Grammars
from deepinfer.runtime.grammar_text import GrammarError
from deepinfer.runtime.sampling import SamplingParams
from deepinfer.runtime.tokenizer import ByteTokenizer, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINT = ROOT / "checkpoints" / "tiny-v3-code"
# Nested objects, enums, bounded arrays, string patterns and lengths, integer ranges, a nullable union.
SCHEMA = json.loads((ROOT / "examples" / "structured" / "module.schema.json").read_text())
PROMPT = "# user:\nDescribe a module as JSON.\n# assistant:\n"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(CHECKPOINT, 2048)


@pytest.fixture(scope="module")
def engines():
    """The trained tiny model without and with its MTP module drafting 3 tokens a step."""
    return {k: eager_engine(build_model("deepseek_v3", checkpoint=CHECKPOINT, draft_tokens=k), max_len=512) for k in (0, 3)}


@pytest.fixture(scope="module")
def grammars(engines, tokenizer):
    return Grammars(tokenizer, engines[0].vocab_size, engines[0].eos_id)


def test_schema_outputs_validate_and_speculation_changes_no_greedy_token(engines, grammars, tokenizer):
    grammar = grammars.compile("json", SCHEMA)
    prompt = tokenizer.encode(PROMPT)
    outputs = {}
    for k, engine in engines.items():
        requests = [Request(prompt, 160, SamplingParams(temperature=t, seed=s), constraint=grammars.matcher(grammar))
                    for t, s in [(0.0, 0), (0.9, 1), (0.9, 2), (0.9, 3)]]
        results = engine.generate(requests)
        for result in results:
            assert result.finish_reason == "grammar", tokenizer.decode(result.token_ids)
            jsonschema.validate(json.loads(tokenizer.decode(result.token_ids)), SCHEMA)
        outputs[k] = results
    assert outputs[0][0].token_ids == outputs[3][0].token_ids  # greedy: token for token
    assert outputs[3][0].tokens_per_step > 1.5, outputs[3][0].tokens_per_step  # (the forced tokens as drafts)
    assert engines[3].drafted[0] > 0


def test_regex_and_choice_outputs_match(engines, grammars, tokenizer):
    prompt = tokenizer.encode(PROMPT)
    regex = grammars.compile("regex", r"[a-z]{3,8}_[0-9]{2}")
    choice = grammars.compile("choice", ["import os", "import re", "pass"])
    requests = [Request(prompt, 40, SamplingParams(temperature=0.9, seed=s), constraint=grammars.matcher(g))
                for g in (regex, choice) for s in range(3)]
    texts = [tokenizer.decode(r.token_ids) for r in engines[3].generate(requests)]
    import re
    assert all(re.fullmatch(r"[a-z]{3,8}_[0-9]{2}", t) for t in texts[:3]), texts
    assert all(t in ("import os", "import re", "pass") for t in texts[3:]), texts


def test_a_grammar_that_cannot_end_in_time_stops_at_max_tokens(engines, grammars, tokenizer):
    grammar = grammars.compile("regex", "a+")
    [result] = engines[3].generate([Request(tokenizer.encode(PROMPT), 9, constraint=grammars.matcher(grammar))])
    assert result.finish_reason == "max_tokens" and tokenizer.decode(result.token_ids) == "a" * len(result.token_ids)


def test_draft_masks_stop_at_the_first_refused_draft_and_roll_back(grammars, tokenizer):
    grammar = grammars.compile("regex", "ab+c")
    a, b, c = (tokenizer.encode(x)[0] for x in "abc")
    matcher = grammars.matcher(grammar)
    allowed, kept = matcher.masks([a, b, a, c])  # the second a is refused: rows for the last token, a, b
    assert kept == 2 and allowed.shape == (3, grammars.vocab_size)
    assert allowed[0, a] and not allowed[0, b] and allowed[1, b] and not allowed[1, c] and allowed[2, c]
    again, _ = matcher.masks([])  # rolled back: the start again
    assert torch.equal(again[0], allowed[0])
    matcher.advance([a, b, c])
    assert matcher.done
    forcing = grammars.matcher(grammars.compile("regex", "import (os|re)"))
    assert tokenizer.decode(forcing.forced()) == "import"  # (" o" or " os" may follow: the space is not forced alone)


def test_a_grammar_starts_after_the_end_of_thinking(grammars, tokenizer):
    matcher = grammars.matcher(grammars.compile("choice", ["yes", "no"]), after="</think>")
    thinking = tokenizer.encode("hmm, let me see</think>")
    allowed, kept = matcher.masks(thinking[:3])
    assert kept == 3 and allowed.all()  # free text while thinking
    matcher.advance(thinking)
    allowed, _ = matcher.masks([])
    assert matcher.started and allowed[0].sum() < 10


def test_bad_grammars_are_refused_with_the_librarys_reason(grammars):
    for kind, spec, said in [("json", {"type": "objekt"}, "objekt"), ("regex", "(a", "regex"),
                             ("json", {"$ref": "#/nowhere"}, "nowhere"), ("grammar", "root ::= missing", "missing")]:
        with pytest.raises(GrammarError, match=said):
            grammars.compile(kind, spec)


def test_byte_level_bundles_get_grammars_too():
    grammars = Grammars(ByteTokenizer(320), 320, 1)
    matcher = grammars.matcher(grammars.compile("choice", ["yes"]))
    allowed, _ = matcher.masks([])
    assert allowed[0].nonzero().flatten().tolist() == [ord("y") + ByteTokenizer.OFFSET]
