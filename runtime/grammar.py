"""Grammar-constrained decoding with llguidance: which tokens may come next, per sequence.

A `Grammars` holds the model's tokenizer as llguidance sees it and a bounded cache of compiled
grammars: `compile(kind, spec)` once per distinct schema, then `matcher(grammar)` gives each
sequence its own `Matcher` (a copy of the cached one). The engine asks a matcher for the
tokens allowed at each row of a step -- the last token's, then each draft's the grammar accepts --
masks everything else to -inf before sampling, and advances it with the tokens it emits. So the
compiled programs do not change: logits are on the host already.

Why llguidance (bench/structured_output_bench.py compares it with xgrammar; docs/serving.md has
the numbers): every document its masks allowed validated, and a feature it lacks is refused by
name (xgrammar let invalid documents through for 4 of 19 features); masks cost the same (~20 us a
token here, 6 of them llguidance's); one wheel with no dependencies (xgrammar pulls transformers,
triton, pydantic and tvm-ffi); resource limits (`LLParserLimits`) a server can set.

An optional `after` text starts the grammar only once the output spelled it (a reasoning model's
end-of-thinking marker, "</think>"): tokens before it are free.

The grammars themselves: grammar_text.py.
"""

import threading
from collections import OrderedDict

import numpy as np
import torch

from .grammar_text import GrammarError, first_lines, grammar_text, llguidance, parser_limits
from .tokenizer import HFTokenizer

CACHED_GRAMMARS = 256  # distinct compiled grammars kept (least recently used goes first)


class Grammars:
    def __init__(self, tokenizer, vocab_size: int, eos_id: int | None):
        """`tokenizer`: a runtime.tokenizer one (HFTokenizer's tokenizer.json, or bytes)."""
        lg = llguidance()
        self.vocab_size = vocab_size
        eos = eos_id if eos_id is not None else vocab_size - 1  # (llguidance needs one; a model without ends on the grammar)
        if isinstance(tokenizer, HFTokenizer):
            self.tokenizer = lg.LLTokenizer(tokenizer.source, n_vocab=vocab_size, eos_token=eos)
        else:
            self.tokenizer = lg.LLTokenizer(lg.TokenizerWrapper(_ByteVocabulary(tokenizer, vocab_size, eos)))
        self.limits = parser_limits()
        self.cache: OrderedDict[str, object] = OrderedDict()  # grammar text -> compiled LLMatcher (never advanced)
        self.lock = threading.Lock()  # (the server compiles on worker threads)
        self.everything = torch.ones(vocab_size, dtype=torch.bool)  # a row before the grammar started

    def compile(self, kind: str, spec) -> str:
        """The llguidance grammar of a request's constraint (grammar_text), its matcher built and
        cached; raises GrammarError saying what is wrong with it. (The conversion of a hostile JSON
        schema is unbounded: the server runs grammar_text in a bounded worker and calls `add`.)"""
        return self.add(grammar_text(kind, spec))

    def add(self, grammar: str) -> str:
        """Build and cache the matcher of an llguidance grammar (bounded by LIMITS); returns it, or
        raises GrammarError."""
        with self.lock:
            if grammar in self.cache:
                self.cache.move_to_end(grammar)
                return grammar
        matcher = llguidance().LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise GrammarError(first_lines(matcher.get_error()))
        with self.lock:
            self.cache[grammar] = matcher
            while len(self.cache) > CACHED_GRAMMARS:
                self.cache.popitem(last=False)
        return grammar

    def matcher(self, grammar: str, after: str = "") -> "Matcher":
        """A new sequence's matcher of a grammar `compile` returned (compiled again if evicted)."""
        with self.lock:
            compiled = self.cache.get(grammar)
        if compiled is None:
            compiled = llguidance().LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        return Matcher(self, compiled.deep_copy(), after.encode())

    def allowed(self, bitmask: bytes) -> torch.Tensor:
        """llguidance's bitmask (32 tokens a word, little-endian bits) -> allowed [V] bool."""
        bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")[: self.vocab_size]
        return torch.from_numpy(bits.view(np.bool_))


class Matcher:
    """One sequence's grammar state. The engine's contract (runtime/engine.py):
    `masks(drafts)` -> (allowed [m + 1, V] bool, m): the tokens allowed after the last token and
    after each of the first m drafts, m being how many drafts the grammar accepts in a row (the
    rest are not proposed); `forced()`: the tokens the grammar forces next; `advance(tokens)`
    after tokens were emitted; `done`: the grammar is complete and can take nothing more (the
    sequence ends)."""

    def __init__(self, grammars: Grammars, matcher, after: bytes):
        self.grammars, self.matcher = grammars, matcher
        self.after = after  # the text that starts the grammar (empty: it starts at once)
        self.tail = b""  # the output's last bytes before the grammar started

    @property
    def started(self) -> bool:
        return self.after in self.tail

    @property
    def done(self) -> bool:
        return self.started and self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return first_lines(self.matcher.get_error()) if self.matcher.is_error() else None

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (its only way on: `"name":"` after `{` in a
        schema's object), which make drafts the verify step accepts."""
        return self.matcher.compute_ff_tokens() if self.started else []

    def masks(self, drafts: list[int]) -> tuple[torch.Tensor, int]:
        rows, consumed, tail = [], 0, self.tail
        for j in range(len(drafts) + 1):
            started = self.after in tail
            rows.append(self.grammars.allowed(self.matcher.compute_bitmask()) if started else self.grammars.everything)
            if j == len(drafts):
                break
            token = drafts[j]
            if not started:
                tail = self._grow(tail, token)
            elif rows[-1][token] and self.matcher.consume_token(token):
                consumed += 1
            else:
                break
        if consumed:
            self.matcher.rollback(consumed)
        return (rows[0][None] if len(rows) == 1 else torch.stack(rows)), len(rows) - 1

    def advance(self, tokens: list[int]):
        for token in tokens:
            if self.started:
                self.matcher.consume_token(token)  # (one the mask allowed; an error state would be a bug, reported)
            else:
                self.tail = self._grow(self.tail, token)

    def _grow(self, tail: bytes, token: int) -> bytes:
        # (the marker may end inside a token: what follows it in that token is not checked)
        return (tail + self.grammars.tokenizer.decode_bytes([token]))[-len(self.after) - 64:]


class _ByteVocabulary:
    """runtime.tokenizer.ByteTokenizer as llguidance's TokenizerWrapper wants it: each id's bytes."""

    def __init__(self, tokenizer, vocab_size: int, eos: int):
        offset = tokenizer.OFFSET
        self.tokens = [bytes([i - offset]) if offset <= i < 256 + offset else f"<|{i}|>".encode() for i in range(vocab_size)]
        self.special_token_ids = [i for i in range(vocab_size) if not offset <= i < 256 + offset]
        self.eos_token_id, self.bos_token_id = eos, None
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text)
