"""Grammar-constrained decoding: what a JSON schema costs a decode step, and the two grammar
libraries made for it side by side.

    .venv/bin/python bench/structured_output_bench.py                    # inductor bundle: ~6 minutes cold
    .venv/bin/python bench/structured_output_bench.py --backend export
    PYTHONPATH=/path/to/xgrammar .venv/bin/python bench/structured_output_bench.py --libraries-only

1. Libraries (the trained tiny model's tokenizer, 2048 tokens): llguidance (ours) and xgrammar when
   it imports (it is not a dependency: it pulls transformers, triton, pydantic and tvm-ffi). Per
   JSON-schema feature: does it compile, and do 8 random walks through its masks give only
   documents that `jsonschema` validates (coverage); then the compile time of a 50-property
   schema, and the median mask per token over the walks of a nested schema.
2. Decode (recipes/tiny-code.yaml compiled with --backend, its MTP module drafting 3 tokens, the
   engine in this process): requests with the nested schema and without any, in alternating
   rounds (this machine is noisy), at concurrency 1 and 4, sampled at T = 0.9: p50 time per
   output token after the first (TPOT), tokens per decode step (with a schema the drafts are
   the tokens the grammar forces, where it forces some), and the time the grammar took per
   token (masks for every row of a verify step, forced tokens, advancing the matcher).
Target (the issue's): TPOT with a schema / without <= 1.15 at concurrency 1 and 4.
"""

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import jsonschema
import torch

from deepinfer.compiler.build import compile_recipe
from deepinfer.compiler.recipe import load_recipe
from deepinfer.runtime.engine import Engine, Request
from deepinfer.runtime.executor import BundleExecutor
from deepinfer.runtime.grammar import Grammars
from deepinfer.runtime.grammar_text import checked, grammar_text
from deepinfer.runtime.knobs import cache_dir
from deepinfer.runtime.sampling import SamplingParams
from deepinfer.runtime.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = ROOT / "checkpoints" / "tiny-v3-code"
VOCAB = 2048
# Objects, enums, bounded arrays, patterns, ranges, a nullable union (tests/runtime/test_grammar.py's too).
NESTED = json.loads((ROOT / "examples" / "structured" / "module.schema.json").read_text())
FIELD_KINDS = [{"type": "string", "maxLength": 20}, {"type": "integer", "minimum": -5, "maximum": 500}, {"enum": ["a", "b", "c"]},
               {"type": "boolean"}, {"type": ["number", "null"]}]
FIFTY = {"type": "object", "additionalProperties": False, "required": [f"field_{i}" for i in range(50)],
         "properties": {f"field_{i}": FIELD_KINDS[i % 5] for i in range(50)}}


def closed(properties: dict, required: list | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": required or list(properties), "additionalProperties": False}


# One schema per JSON-schema feature an agent's tools use (bounded, so a random walk ends).
FEATURES = {
    "string length": closed({"s": {"type": "string", "minLength": 2, "maxLength": 5}}),
    "pattern": closed({"s": {"type": "string", "pattern": "^[a-z]{2}[0-9]$"}}),
    "format: date": closed({"d": {"type": "string", "format": "date"}}),
    "format: uuid": closed({"u": {"type": "string", "format": "uuid"}}),
    "integer range": closed({"i": {"type": "integer", "minimum": 10, "maximum": 99}}),
    "exclusiveMinimum": closed({"i": {"type": "integer", "exclusiveMinimum": 5, "maximum": 9}}),
    "enum": closed({"e": {"enum": ["x", 1, None]}}),
    "const": closed({"c": {"const": "fixed"}}),
    "array bounds": closed({"a": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 3}}),
    "prefixItems": closed({"t": {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                                  {"enum": ["k"]}], "items": False}}),
    "nullable (type list)": closed({"n": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}}),
    "anyOf": closed({"u": {"anyOf": [{"type": "boolean"}, {"enum": ["z"]}]}}),
    "oneOf": closed({"u": {"oneOf": [{"type": "boolean"}, {"enum": ["z"]}]}}),
    "allOf": {"allOf": [closed({"a": {"type": "boolean"}}, []), {"required": ["a"]}]},
    "$ref / $defs": {"$defs": {"flag": {"type": "boolean"}}, **closed({"f": {"$ref": "#/$defs/flag"}})},
    "optional properties": closed({"a": {"type": "boolean"}, "b": {"enum": [1]}}, ["a"]),
    "nested objects": NESTED,
    "uniqueItems": closed({"a": {"type": "array", "items": {"enum": [1, 2, 3]}, "uniqueItems": True, "maxItems": 3}}),
    "multipleOf": closed({"m": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 50}}),
}


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer):
        self.grammars = Grammars(tokenizer, VOCAB, 0)

    def compile(self, schema: dict):
        return self.grammars.add(checked(grammar_text("json", schema)))

    def walker(self, compiled):
        matcher = self.grammars.matcher(compiled)
        return lambda: matcher.masks([])[0][0], lambda t: matcher.advance([t]), lambda: matcher.done


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer):
        import transformers
        import xgrammar

        hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(CHECKPOINT / "tokenizer.json"), eos_token="<|endoftext|>")
        self.xgr = xgrammar
        self.compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB))
        self.bitmask = xgrammar.allocate_token_bitmask(1, VOCAB)
        self.bits = 1 << torch.arange(32, dtype=torch.int64)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)

    def walker(self, compiled):
        matcher = self.xgr.GrammarMatcher(compiled)

        def allowed():
            matcher.fill_next_token_bitmask(self.bitmask)
            return ((self.bitmask[0].to(torch.int64)[:, None] & self.bits) != 0).flatten()[:VOCAB]
        return allowed, matcher.accept_token, matcher.is_terminated


def libraries(tokenizer):
    engines = [Llguidance(tokenizer)]
    try:
        engines.append(Xgrammar(tokenizer))
    except ImportError as err:
        print(f"xgrammar: not importable here ({err.name}); pip install xgrammar to compare.\n")
    print("| JSON-schema feature | " + " | ".join(e.name for e in engines) + " |")
    print("|---|" + "---|" * len(engines))
    for feature, schema in FEATURES.items():
        cells = [coverage(e, schema, tokenizer) for e in engines]
        print(f"| {feature} | " + " | ".join(cells) + " |", flush=True)
    print()
    for e in engines:
        start = time.perf_counter()
        e.compile(FIFTY)
        compile_ms = (time.perf_counter() - start) * 1000
        costs = []
        for seed in range(8):
            costs += walk(e, e.compile(NESTED), tokenizer, seed)[1]
        print(f"{e.name}: 50-property schema compiled in {compile_ms:.1f} ms; nested schema's mask per token: median "
              f"{statistics.median(costs) * 1e6:.1f} us, p90 {sorted(costs)[int(0.9 * len(costs))] * 1e6:.1f} us "
              f"({len(costs)} tokens)", flush=True)


def coverage(library, schema: dict, tokenizer) -> str:
    """"ok" when it compiles and 8 random walks through its masks give valid documents only."""
    try:
        compiled = library.compile(schema)
    except Exception as err:  # each library has its own errors
        return f"refused ({str(err).splitlines()[0][:60]})"
    invalid = 0
    for seed in range(8):
        text, _ = walk(library, compiled, tokenizer, seed)
        try:
            jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
        except (ValueError, jsonschema.ValidationError):
            invalid += 1
    return "ok" if not invalid else f"{invalid}/8 walks invalid"


def walk(library, compiled, tokenizer, seed: int, limit: int = 400) -> tuple[str, list[float]]:
    """A random document through the library's masks: (its text, seconds per mask)."""
    allowed, advance, done = library.walker(compiled)
    rng, tokens, costs = random.Random(seed), [], []
    while len(tokens) < limit and not done():
        start = time.perf_counter()
        ids = allowed().nonzero().flatten().tolist()
        costs.append(time.perf_counter() - start)
        ids = [t for t in ids if t != 0] or ids  # (end only when nothing else may come)
        token = rng.choice(ids)
        if token == 0:
            break
        advance(token)
        tokens.append(token)
    return tokenizer.decode(tokens), costs


class Timed:
    """A sequence's matcher, timing what the engine spends on it."""

    def __init__(self, matcher, clock: list):
        self.matcher, self.clock = matcher, clock

    def masks(self, drafts):
        return self._timed(self.matcher.masks, drafts)

    def advance(self, tokens):
        self._timed(self.matcher.advance, tokens)

    def forced(self):
        return self._timed(lambda _: self.matcher.forced(), None)

    def _timed(self, method, argument):
        start = time.perf_counter()
        out = method(argument)
        self.clock[0] += time.perf_counter() - start
        return out

    def __getattr__(self, name):
        return getattr(self.matcher, name)


def decode(backend: str, rounds: int, tokenizer):
    work = Path(tempfile.mkdtemp(prefix="structured-bench-"))
    start = time.perf_counter()
    bundle = compile_recipe(load_recipe(ROOT / "recipes" / "tiny-code.yaml", backend=backend, output=work / "tiny-code"),
                            cache_dir=cache_dir(), progress=False).bundle
    print(f"\ncompiled recipes/tiny-code.yaml ({backend}) in {time.perf_counter() - start:.0f} s", flush=True)
    engine = Engine.for_bundle(BundleExecutor(bundle))
    grammars = Grammars(tokenizer, VOCAB, engine.eos_id)
    grammar = grammars.compile("json", NESTED)
    prompt = tokenizer.encode("# user:\nDescribe a module as JSON.\n# assistant:\n")
    print("| concurrency | TPOT p50 without (ms) | with the schema (ms) | ratio | grammar time per token (us) | tokens per step without / with |")
    print("|---|---|---|---|---|---|")
    for concurrency in (1, 4):
        tpot, per_step, clock, emitted = {False: [], True: []}, {False: [], True: []}, [0.0], 0
        for r in range(rounds):
            for constrained in (False, True):
                requests = [Request(prompt, 96, SamplingParams(temperature=0.9, seed=1000 * r + i), ignore_eos=not constrained,
                                    constraint=Timed(grammars.matcher(grammar), clock) if constrained else None)
                            for i in range(concurrency)]
                results = engine.generate(requests)
                tpot[constrained] += [x.tpot for x in results]
                per_step[constrained] += [x.tokens_per_step for x in results]
                emitted += sum(len(x.token_ids) for x in results) if constrained else 0
        without, with_ = statistics.median(tpot[False]), statistics.median(tpot[True])
        print(f"| {concurrency} | {without * 1000:.2f} | {with_ * 1000:.2f} | {with_ / without:.2f} | "
              f"{clock[0] / emitted * 1e6:.0f} | {statistics.mean(per_step[False]):.2f} / {statistics.mean(per_step[True]):.2f} |",
              flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor", choices=["inductor", "export"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--libraries-only", action="store_true")
    args = parser.parse_args()
    tokenizer = load_tokenizer(CHECKPOINT, VOCAB)
    print(f"torch threads: {torch.get_num_threads()}\n")
    libraries(tokenizer)
    if not args.libraries_only:
        decode(args.backend, args.rounds, tokenizer)


if __name__ == "__main__":
    main()
