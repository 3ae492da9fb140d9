"""The leader's engine: continuous batching over a fixed pool of sequence slots.

It knows nothing of how a step is computed: `executor.run(step) -> logits` may be the eager
model, a compiled bundle, or a leader that also feeds follower ranks. Nor of who asks: the
front doors (`deepinfer-run`'s list of prompts, the HTTP server) `submit` requests and call
`step` until their sequences finish; a request may join or be cancelled between any two steps.

One `step` is one engine iteration: admit waiting requests into free slots, run AT MOST ONE
prefill chunk (one sequence's next <= largest-prefill-bucket prompt tokens), then one decode
token for every sequence past its prompt. So a running stream waits at most one chunk between
two tokens however long a newcomer's prompt is, and a long prompt is prefilled over several
iterations while the others decode.

Static shapes rule here: every step is padded to a bucket, and padding points at the scratch
slot (index max_seqs). Where the bundle has context buckets, a step runs the program for the
smallest context that holds its longest sequence, so a short conversation does not pay for
the pool's kv.max_len.

Prefix caching: a finished sequence's state stays in its slot until the slot is needed (the
least recently used free slot goes first). A new prompt starting with the tokens a free slot
holds takes that slot and prefills only the rest: exact, since positions past the reused prefix
are rewritten before any query reads them. When its first chunk is due, a prompt whose prefix
another slot holds (a running sequence's, or a free slot another prompt took no longer) has that
state copied into its own slot first (a copy step, which followers replay): so `n` sequences of
one prompt prefill it once, and requests sharing a system prompt share its prefill. Slots are
found by hashed token blocks (prefix_index.py). What is reusable is read from the state specs as
data: with only position-indexed state any prefix is (rounded down to whole compressed entries); a
fixed-size state (a sliding window's ring, a compressor's buffer) holds the slot's last positions
only, so there a prompt must continue the whole sequence the slot holds (a chat resending its
history, a second sequence of the same prompt). An MTP module lags the main model by the tokens it
has not drafted over: those few are prefilled again (the same tokens at the same positions write
the same state).

Speculative decoding (a bundle compiled with `speculative`, k draft tokens): a sequence's decode
step verifies its last token and the k tokens its MTP module drafted, all in one step of the
main model (rows at consecutive positions attend each other causally), and emits the accepted
drafts and one more token (sampling.verify_drafts: exactly the model's distribution); then one
draft step proposes the next k for every sequence: the MTP module runs over the tokens just
emitted (it has not seen them) and chains its own argmax k - 1 times, in one program. Rejected
drafts' state is overwritten by later steps: nothing is cleared. Without speculation a decode
step is the same with no drafts.

Grammar-constrained decoding (a request's `constraint`, runtime/grammar.py): the logits of every
row are masked on the host before sampling; drafts the grammar refuses are not verified, and
where the grammar forces the next tokens, those are the drafts.
"""

import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .errors import DeepinferError
from .prefix_index import PrefixIndex
from .sampling import SamplingParams, adjust, token_logprobs, verify_drafts
from .step import Step, copy_step


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int = 32  # 0: none (only with sampling.prompt_logprobs: the prompt is scored)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    ignore_eos: bool = False  # generate max_tokens even past EOS (benchmarks with fixed output lengths)
    cache_salt: str = ""  # prefix caching reuses state only between requests of the same salt (tenants)
    # Grammar-constrained decoding (runtime/grammar.py's Matcher, one per sequence): masks(drafts) ->
    # (allowed [m + 1, V] bool, m drafts it accepts), forced(), advance(tokens), done, error.
    constraint: object | None = None


@dataclass
class Result:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""  # "eos" | "stop_token" | "grammar" | "max_tokens" | "context" | "cancelled" | "error"
    error: str = ""  # with finish_reason "error": what failed (this request only; the engine goes on)
    cached_tokens: int = 0  # prompt tokens whose state was reused (prefix caching), not prefilled
    ttft: float = 0.0  # seconds from submission to the first token
    queue_time: float = 0.0  # seconds from submission to taking a sequence slot
    token_times: list[float] = field(default_factory=list)  # seconds from submission to each token
    decode_steps: int = 0  # decode steps that emitted its tokens after the first
    # With sampling.logprobs / prompt_logprobs: per generated token / per prompt token after the
    # first, (its logprob, [(token, logprob)] of the most likely, most likely first).
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)

    @property
    def tokens_per_step(self) -> float:
        return tokens_per_step([self])

    @property
    def tpot(self) -> float:
        """Mean seconds per output token after the first (0 with a single token)."""
        gaps = len(self.token_times) - 1
        return (self.token_times[-1] - self.token_times[0]) / gaps if gaps > 0 else 0.0


def tokens_per_step(results: list[Result]) -> float:
    """Tokens a decode step emitted, on average over `results` (the first token comes from the
    prompt's prefill; 1 without speculative decoding)."""
    steps = sum(r.decode_steps for r in results)
    return sum(len(r.token_ids) - 1 for r in results) / steps if steps else 0.0


@dataclass(eq=False)
class Sequence:
    """One submitted request as the engine tracks it: the handle front doors hold."""

    request: Request
    result: Result
    generator: torch.Generator
    submitted: float  # time.perf_counter() at submission
    slot: int | None = None  # its row in the state pool, once admitted
    prefilled: int = 0  # prompt tokens already in the cache
    started: bool = False  # its first prefill chunk has run (a cached prefix is looked for before it)
    drafts: list[int] = field(default_factory=list)  # proposed to follow its last token, not yet verified
    unseen: int = 0  # its last tokens the MTP module has not run over yet (speculative decoding)

    @property
    def finished(self) -> bool:
        return bool(self.result.finish_reason)

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.request.prompt_ids) and not self.finished

    @property
    def length(self) -> int:  # tokens in the cache once the last sampled token is fed back
        return len(self.request.prompt_ids) + len(self.result.token_ids) - 1


def check_request(request: Request, vocab_size: int | None, max_len: int, score_top: int = 0):
    """Refuse what the compiled graphs cannot take: they index embeddings and the cache with
    these values and no bounds checks. (deepinfer-run calls it before the bundle loads too.)
    `score_top`: the top tokens the bundle's score programs return (0: it has none)."""
    n = len(request.prompt_ids)
    if n == 0:
        raise DeepinferError("empty prompt: give at least one token.")
    request.sampling.check(vocab_size, score_top)
    if vocab_size is not None:
        bad = [t for t in request.prompt_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
        if bad:
            raise DeepinferError(f"token id {bad[0]} is outside the model's vocabulary [0, {vocab_size}); "
                                 "prompt ids must come from this model's tokenizer.")
    scored = request.sampling.prompt_logprobs is not None
    if not isinstance(request.max_tokens, int) or request.max_tokens < (0 if scored else 1):
        raise DeepinferError(f"max_tokens={request.max_tokens!r}: give at least 1 (0 only when the prompt is scored).")
    if n >= max_len:
        raise DeepinferError(
            f"prompt of {n} tokens is past the context limit: the bundle's KV pool holds "
            f"kv.max_len={max_len} positions, so a prompt may have at most {max_len - 1} tokens. "
            "Shorten the prompt or compile with a larger kv.max_len."
        )


class Engine:
    def __init__(self, executor, prefill_buckets, decode_buckets, max_seqs: int, max_len: int, eos_id: int | None,
                 vocab_size: int, contexts: dict[str, list[int]] | None = None, speculative: int = 0,
                 prompt_logprobs: int = 0, entry_positions: list[int | None] = (1,), prefix_caching: bool = True):
        """Buckets in rows: with `speculative` k draft tokens a decode bucket holds k + 1 rows a
        sequence, and the draft steps take the same buckets. `prompt_logprobs`: the top tokens
        the score programs return per row (0: the executor has none). `entry_positions`: each
        state tensor's positions per entry (None: fixed size), what prefix caching may reuse."""
        self.executor = executor
        self.prefill_buckets = sorted(prefill_buckets)
        self.decode_buckets = sorted(decode_buckets)
        self.speculative, self.prompt_logprobs = speculative, prompt_logprobs
        # Per draft position: drafts verified, and accepted (the acceptance rate by position).
        self.drafted, self.accepted = [0] * speculative, [0] * speculative
        self.contexts = contexts or {}  # method -> context buckets, the largest kv.max_len
        self.max_seqs, self.max_len, self.eos_id, self.vocab_size = max_seqs, max_len, eos_id, vocab_size
        self.scratch = max_seqs
        self.padding = (0, 0, self.scratch)  # a (token, position, slot) row that changes nothing
        self.prefix_caching = prefix_caching
        self.fixed_size_state = None in entry_positions
        self.entry_positions = math.lcm(*[r for r in entry_positions if r])  # a reused prefix is a multiple of it
        # Slots holding reusable state -- free ones (finished sequences') and running ones -- by
        # the tokens they hold (a running sequence's prompt: it holds a prefix of it). Blocks of
        # >= 16 tokens and whole compressed entries.
        self.index = PrefixIndex(self.entry_positions * -(-16 // self.entry_positions))
        self.cached: dict[int, tuple[int, int]] = {}  # free slot -> (positions its state holds, positions reusable)
        self.prefix_hits = self.prefix_hit_tokens = self.prefix_evictions = self.prefix_copies = 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admitted: holding a slot, prefilling or decoding
        self.free_slots = list(range(max_seqs))

    @classmethod
    def for_bundle(cls, executor, prefix_caching: bool = True) -> "Engine":
        """The engine a loaded bundle's manifest describes."""
        m = executor.manifest
        entries = [t.positions_per_entry for layer in m.state for t in layer] if m.state is not None else [1]
        return cls(executor, m.buckets["prefill"], m.buckets["decode"], m.kv.max_seqs, m.kv.max_len, m.eos_token_id,
                   m.vocab_size, m.contexts, m.speculative, m.prompt_logprobs, entries, prefix_caching)

    def check(self, request: Request):
        check_request(request, self.vocab_size, self.max_len, self.prompt_logprobs)

    def submit(self, request: Request, seed: int | None = None) -> Sequence:
        """Queue a request (checked first); its sampling generator starts from `seed` (default: its own)."""
        self.check(request)
        generator = torch.Generator().manual_seed(request.sampling.seed if seed is None else seed)
        seq = Sequence(request, Result(list(request.prompt_ids)), generator, time.perf_counter())
        self.waiting.append(seq)
        return seq

    def cancel(self, seq: Sequence):
        """Stop a sequence now; its slot is free for the next step."""
        if seq.finished:
            return
        seq.result.finish_reason = "cancelled"
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._retire()

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[Sequence]:
        """One iteration (see the module docstring). Returns the sequences that got a token or
        finished, in the order they did."""
        while self.waiting and self.free_slots:
            self._admit(self.waiting.popleft())
        updated = []
        prefilling = next((s for s in self.running if s.prefilled < len(s.request.prompt_ids)), None)
        if prefilling is not None:
            if not prefilling.started:
                self._start_prefill(prefilling)
            logits = self._prefill_chunk(prefilling)
            if prefilling.decoding:  # its whole prompt is in: the first token
                self._first_token(prefilling, logits)
                updated.append(prefilling)
        decoding = [s for s in self.running if s.decoding and s not in updated]  # (each has its first token)
        if decoding:
            self._decode(decoding)
            updated += [s for s in decoding if s not in updated]
        if self.speculative:
            self._draft([s for s in self.running if s.decoding and s.unseen and self._draft_budget(s) > 0])
        self._retire()
        if self.speculative:
            for seq in self.running:
                if seq.request.constraint is not None and seq.decoding:
                    self._grammar_drafts(seq)
        return updated

    def _grammar_drafts(self, seq: Sequence):
        """A constrained sequence's next drafts are the tokens its grammar forces, where it forces
        some: the verify step accepts them (the masked model has no other choice), as it seldom
        accepts the MTP module's through a schema's fixed punctuation and names."""
        forced = seq.request.constraint.forced()[: self._draft_budget(seq)]
        if forced:
            seq.drafts = forced

    def generate(self, requests: list[Request]) -> list[Result]:
        """Run a list of requests to the end (sequence i samples from seed + i)."""
        for request in requests:
            self.check(request)
        seqs = [self.submit(r, r.sampling.seed + i) for i, r in enumerate(requests)]
        while self.busy:
            self.step()
        return [s.result for s in seqs]

    def _retire(self):
        for seq in [s for s in self.running if s.finished]:
            self.running.remove(seq)
            self.free_slots.append(seq.slot)  # (appended: the list runs from least to most recently used)
            held, usable = self._held(seq)
            if self.prefix_caching and seq.result.finish_reason != "error" and held:
                self.cached[seq.slot] = held, usable
                self.index.add(seq.slot, (seq.request.prompt_ids + seq.result.token_ids)[:held], seq.request.cache_salt)
            else:  # (a sequence cancelled before its first chunk leaves nothing)
                self.index.remove(seq.slot)

    def _admit(self, seq: Sequence):
        """Give a sequence a free slot: the one holding the longest reusable prefix of its prompt
        (then only the rest is prefilled), else an empty one, else the least recently used."""
        slot, reused = None, 0
        if self._may_reuse(seq):
            free = [(s, n) for s, n in self._reusable(seq.request).items() if s in self.cached]
            slot, reused = max(free, key=lambda pair: pair[1], default=(None, 0))
        if not reused:
            slot = next((s for s in self.free_slots if s not in self.cached), self.free_slots[0])
            self.prefix_evictions += slot in self.cached
        self.free_slots.remove(slot)
        self.cached.pop(slot, None)
        seq.slot, seq.prefilled = slot, reused
        seq.result.queue_time = time.perf_counter() - seq.submitted
        if self.prefix_caching:  # (a running sequence holds a prefix of its prompt: other prompts may copy it)
            self.index.add(slot, seq.request.prompt_ids, seq.request.cache_salt)
        self.running.append(seq)

    def _start_prefill(self, seq: Sequence):
        """Before a prompt's first chunk: copy in the longest reusable prefix another slot holds
        now, if it beats what the sequence's own slot gave it; count the reuse."""
        seq.started = True
        if self._may_reuse(seq):
            others = [(s, n) for s, n in self._reusable(seq.request).items() if s != seq.slot]
            source, n = max(others, key=lambda pair: pair[1], default=(None, 0))
            if n > seq.prefilled:
                # Everything the source holds when a fixed-size state makes the copy stand for the source's
                # whole sequence (its rings hold its last positions); the reused positions otherwise.
                positions = self._holding(source)[0] if self.fixed_size_state else n
                self.executor.run(copy_step(source, seq.slot, positions))
                seq.prefilled = n
                self.prefix_copies += 1
        if seq.prefilled:
            self.prefix_hits += 1
            self.prefix_hit_tokens += seq.prefilled
            seq.result.cached_tokens = seq.prefilled

    def _may_reuse(self, seq: Sequence) -> bool:
        return self.prefix_caching and seq.request.sampling.prompt_logprobs is None  # (a scored prompt runs whole)

    def _reusable(self, request: Request) -> dict[int, int]:
        """slot -> positions of the request's prompt its state gives now (0: none), for every slot
        the index knows under the request's cache salt."""
        reusable, prompt = {}, request.prompt_ids
        for slot, common in self.index.matches(prompt, request.cache_salt).items():
            known = len(self.index.tokens[slot])  # (a running sequence's: its prompt; it may hold fewer, or more)
            held, usable = self._holding(slot)
            n = min(common, usable, len(prompt) - 1)  # (one prompt token at least is prefilled: its logits give the next)
            if self.fixed_size_state:  # rings hold the last positions: only a prompt continuing all it holds reuses
                reusable[slot] = n if common >= held and known >= held else 0  # (n < held: the same tokens rewritten)
            else:
                reusable[slot] = n - n % self.entry_positions
        return reusable

    def _holding(self, slot: int) -> tuple[int, int]:
        """(positions the slot's state holds, how many of them a later prompt can reuse)."""
        if slot in self.cached:
            return self.cached[slot]
        return self._held(next(s for s in self.running if s.slot == slot))

    def _held(self, seq: Sequence) -> tuple[int, int]:
        """(tokens whose state a sequence has put in its slot, how many of them a later prompt can
        reuse): an MTP module has not run over the last `unseen` tokens (a prefill of position p
        rewrites its entry at p - 1 itself, hence one more)."""
        fed = seq.prefilled + max(len(seq.result.token_ids) - 1, 0)
        lag = max(seq.unseen - 1, 0) if self.speculative else 0
        return fed, fed - lag

    def _prefill_chunk(self, seq: Sequence) -> torch.Tensor:
        """The prompt's next chunk: the largest bucket while more remains, then the smallest that
        fits. A prompt whose logprobs are asked for runs score steps: each row also scores the
        prompt's next token. -> the logits after the chunk [V]."""
        ids, done = seq.request.prompt_ids, seq.prefilled
        remaining = len(ids) - done
        bucket = next((b for b in self.prefill_buckets if b >= remaining), self.prefill_buckets[-1])
        n = min(bucket, remaining)
        pad = bucket - n
        scored = seq.request.sampling.prompt_logprobs is not None
        targets = ids[done + 1 : done + n + 1]  # each row's next prompt token (the last row of the prompt has none)
        step = Step(
            "score" if scored else "prefill",
            tokens=torch.tensor(ids[done : done + n] + [0] * pad),
            positions=torch.tensor(list(range(done, done + n)) + [0] * pad),
            slots=torch.tensor([seq.slot] * n + [self.scratch] * pad),
            read_slot=torch.tensor([seq.slot]),
            last_index=torch.tensor([n - 1]),
            context=self._context("prefill", done + n),  # (score steps have the prefill steps' contexts)
            targets=torch.tensor(targets + [0] * (bucket - len(targets))) if scored else None,
        )
        out = self.executor.run(step)
        seq.prefilled += n
        if not scored:
            return out[0]
        width = 2 * self.prompt_logprobs + 1  # per row: the target's logprob, the top logprobs, their ids
        scores = out[: bucket * width].view(bucket, width)[: len(targets)].tolist()
        top = seq.request.sampling.prompt_logprobs
        for row in scores:
            ranked = row[1 + self.prompt_logprobs : 1 + self.prompt_logprobs + top]
            seq.result.prompt_logprobs.append((row[0], [(int(t), v) for t, v in zip(ranked, row[1 : 1 + top])]))
        return out[bucket * width :]

    def _decode(self, seqs: list[Sequence]):
        """A decode step for every given sequence, in groups of at most the largest bucket: each
        verifies its last token and its drafts (none without speculation) and emits the tokens
        that passed and one more."""
        for group in self._groups(seqs):
            rows = [[(t, s.length + i, s.slot) for i, t in enumerate([s.result.token_ids[-1], *s.drafts])] for s in group]
            logits = self._run("decode", rows, max(s.length + len(s.drafts) for s in group) + 1)
            for seq, block, seq_rows in zip(group, logits.view(-1, self.speculative + 1, logits.shape[-1]), rows):
                self._verify(seq, block[: len(seq_rows)])

    def _verify(self, seq: Sequence, logits: torch.Tensor):
        drafts, seq.drafts = seq.drafts, []
        tokens = self._emit_chosen(seq, logits, drafts)
        if tokens is None:
            return
        for j in range(len(drafts)):
            self.drafted[j] += 1
            self.accepted[j] += j < len(tokens) - 1
        seq.result.decode_steps += 1

    def _first_token(self, seq: Sequence, logits: torch.Tensor):
        """The token after a prompt (logits [V]); with max_tokens 0 (a prompt only scored) the
        sequence ends here."""
        if seq.request.max_tokens == 0:
            seq.result.finish_reason = "max_tokens"
        else:
            self._emit_chosen(seq, logits[None], [])

    def _emit_chosen(self, seq: Sequence, logits: torch.Tensor, drafts: list[int]) -> list[int] | None:
        """Choose the tokens to emit from the model's logits [len(drafts) + 1, V] at the last token
        and at each draft (sampling.verify_drafts), after the request's grammar mask (drafts past
        the first it rejects are not proposed) and its logit adjustments as they stand at each row
        (row j follows drafts[:j]), and emit them until the sequence finishes. None: sampling
        failed (the request did)."""
        params, constraint = seq.request.sampling, seq.request.constraint
        adjusted = logits
        try:
            if constraint is not None:
                allowed, kept = constraint.masks(drafts)
                drafts, adjusted = drafts[:kept], logits[: kept + 1].masked_fill(~allowed, -math.inf)
            if params.adjusts:
                stop_ids = list(params.stop_token_ids) + ([] if self.eos_id is None or seq.request.ignore_eos else [self.eos_id])
                histories = [seq.result.token_ids + drafts[:j] for j in range(len(drafts) + 1)]
                adjusted = adjust(adjusted, params, seq.request.prompt_ids, histories, stop_ids)
            tokens = verify_drafts(adjusted, drafts, params, seq.generator)
        except RuntimeError as err:
            _sampling_failed(seq.result, err)
            return None
        rows = logits[: len(tokens)]
        reported = [None] * len(tokens) if params.logprobs is None else token_logprobs(rows, tokens, params.logprobs)
        for token, logprobs in zip(tokens, reported):
            self._emit(seq, token, logprobs)
            seq.unseen += 1
            if seq.finished:
                break
        return tokens

    def _draft(self, seqs: list[Sequence]):
        """The next drafts of every given sequence, in groups of at most the largest bucket: the
        rows are its tokens the MTP module has not seen. A sequence keeps no more drafts than
        its context and its max_tokens can use."""
        for group in self._groups(seqs):
            rows = []
            for seq in group:
                ids, first = seq.result.token_ids, seq.length - seq.unseen + 1
                rows.append([(token, first + i, seq.slot) for i, token in enumerate(ids[len(ids) - seq.unseen :])])
                seq.unseen = 0
            # Chained drafts reach k - 1 positions past the last token (models/speculative.py).
            drafts = self._run("draft", rows, min(max(s.length for s in group) + self.speculative, self.max_len))
            for seq, proposed in zip(group, drafts.tolist()):  # drafts [bucket / (k + 1), k]
                # (the next step indexes embeddings with them: a token outside the vocabulary ends the drafts)
                valid = list(itertools.takewhile(lambda t: 0 <= t < self.vocab_size, proposed))
                seq.drafts = valid[: self._draft_budget(seq)]

    def _draft_budget(self, seq: Sequence) -> int:
        """Drafts a sequence can use: the verify step puts them at the next positions, and emits one token more."""
        return min(self.speculative, self.max_len - 1 - seq.length, seq.request.max_tokens - len(seq.result.token_ids) - 1)

    def _groups(self, seqs: list[Sequence]) -> list[list[Sequence]]:
        """The sequences in groups the largest decode bucket holds (k + 1 rows each)."""
        largest = self.decode_buckets[-1] // (self.speculative + 1)
        return [seqs[lo : lo + largest] for lo in range(0, len(seqs), largest)]

    def _run(self, method: str, rows: list[list[tuple[int, int, int]]], reach: int) -> torch.Tensor:
        """One step of `method` over each sequence's (token, position, slot) rows, in blocks of
        k + 1 rows (models/speculative.py: valid rows first, then padding) padded to the smallest
        bucket, for the smallest context holding `reach` positions."""
        per_sequence = self.speculative + 1
        flat = [row for seq_rows in rows for row in seq_rows + [self.padding] * (per_sequence - len(seq_rows))]
        bucket = next(b for b in self.decode_buckets if b >= len(flat))
        flat += [self.padding] * (bucket - len(flat))
        tokens, positions, slots = (torch.tensor(column) for column in zip(*flat))
        return self.executor.run(Step(method, tokens, positions, slots, context=self._context(method, reach)))

    def _context(self, method: str, positions: int) -> int | None:
        """The smallest context bucket holding `positions` positions (None: the method has none)."""
        return next((c for c in self.contexts.get(method, ()) if c >= positions), None)

    def _emit(self, seq: Sequence, token: int, logprobs=None):
        result, constraint = seq.result, seq.request.constraint
        result.token_ids.append(token)
        if constraint is not None:
            constraint.advance([token])
        if logprobs is not None:
            result.logprobs.append(logprobs)
        now = time.perf_counter() - seq.submitted
        result.token_times.append(now)
        if len(result.token_ids) == 1:
            result.ttft = now
        if token == self.eos_id and not seq.request.ignore_eos:
            result.finish_reason = "eos"
        elif token in seq.request.sampling.stop_token_ids:
            result.finish_reason = "stop_token"
        elif constraint is not None and constraint.error:  # (a bug: the mask allowed the token)
            result.finish_reason, result.error = "error", f"the grammar refused token {token}: {constraint.error}"
        elif constraint is not None and constraint.done:  # the grammar is complete: nothing may follow
            result.finish_reason = "grammar"
        elif len(result.token_ids) >= seq.request.max_tokens:
            result.finish_reason = "max_tokens"
        elif seq.length >= self.max_len:  # the next token would have no cache position
            result.finish_reason = "context"


def _sampling_failed(result: Result, err: RuntimeError):
    """Logits that are not numbers (NaN): this request fails, the others go on."""
    result.finish_reason, result.error = "error", f"sampling failed: {str(err).splitlines()[0]}"
