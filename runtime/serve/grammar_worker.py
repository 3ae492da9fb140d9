"""Output constraints compiled in a bounded child process (bounded_worker.py), and cached.

A request's schema, regex or grammar is converted and compiled once in the worker, bounded by
GRAMMAR_SECONDS and its memory cap on top of llguidance's own limits (grammar_text.LIMITS), so
whatever a hostile one costs is spent there, off the event loop and the engine; the checked
grammar is then built into a matcher in the server (runtime/grammar.py). Conversions are cached by
the request's constraint, matchers by the grammar.

    python -m deepinfer.runtime.serve.grammar_worker    # started by deepinfer-serve: {} then
                                                        # {"kind", "spec"} per line
"""

import asyncio
import json
from collections import OrderedDict

from ..grammar_text import GrammarError, checked, grammar_text
from .bounded_worker import BoundedWorker, serve

GRAMMAR_SECONDS = 10.0
CACHED_CONVERSIONS = 256  # (the child imports no torch: runtime/grammar.py is not imported here)


class GrammarCompiler:
    """The event loop's side: `await compile(kind, spec)` -> the grammar for `grammars.matcher`,
    or GrammarError saying what is wrong (the library's words, or a bound it passed)."""

    def __init__(self, grammars, seconds: float = GRAMMAR_SECONDS):
        """`grammars`: runtime/grammar.py's Grammars, which builds the matchers."""
        self.grammars = grammars
        self.worker = BoundedWorker(__name__, {}, seconds)
        self.converted: OrderedDict[str, str] = OrderedDict()  # the constraint as JSON -> its grammar

    async def compile(self, kind: str, spec) -> str:
        key = json.dumps([kind, spec], sort_keys=True)
        grammar = self.converted.get(key)
        if grammar is None:
            try:
                grammar = (await self.worker.call({"kind": kind, "spec": spec}))["grammar"]
            except ValueError as err:
                raise GrammarError(str(err)) from None
        grammar = await asyncio.get_running_loop().run_in_executor(None, self.grammars.add, grammar)
        self.converted[key] = grammar
        self.converted.move_to_end(key)
        while len(self.converted) > CACHED_CONVERSIONS:
            self.converted.popitem(last=False)
        return grammar

    async def close(self):
        await self.worker.close()


def _converter(setup: dict):
    def convert(job: dict) -> dict:
        try:
            return {"grammar": checked(grammar_text(job["kind"], job["spec"]))}
        except GrammarError as err:
            raise ValueError(str(err)) from None
    return convert


if __name__ == "__main__":
    serve(_converter)
