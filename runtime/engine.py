"""The leader's engine: a request queue, chunked prefill, batched decode, sampling.

It knows nothing of how a step is computed: `executor.run(step) -> logits` may be the eager
model, a compiled bundle, or a leader that also feeds follower ranks. Static shapes rule here:
every step is padded to a bucket, and padding points at the scratch slot (index max_seqs).
"""

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .errors import DeepinferError
from .sampling import SamplingParams, sample
from .step import Step


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int = 32
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class Result:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""  # "eos" | "max_tokens" | "context"
    ttft: float = 0.0  # seconds from generate() to the first token
    token_times: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float:
        """Mean seconds per output token after the first (0 with a single token)."""
        gaps = len(self.token_times) - 1
        return (self.token_times[-1] - self.token_times[0]) / gaps if gaps > 0 else 0.0


@dataclass
class _Sequence:
    index: int
    request: Request
    result: Result
    slot: int
    generator: torch.Generator

    @property
    def length(self) -> int:  # tokens in the cache once the last sampled token is fed back
        return len(self.request.prompt_ids) + len(self.result.token_ids) - 1


class Engine:
    def __init__(self, executor, prefill_buckets, decode_buckets, max_seqs: int, max_len: int, eos_id: int | None,
                 vocab_size: int | None = None):
        self.executor = executor
        self.prefill_buckets = sorted(prefill_buckets)
        self.decode_buckets = sorted(decode_buckets)
        self.max_seqs, self.max_len, self.eos_id, self.vocab_size = max_seqs, max_len, eos_id, vocab_size
        self.scratch = max_seqs

    def check(self, request: Request):
        """Refuse what the compiled graphs cannot take: they index embeddings and the cache with
        these values and no bounds checks."""
        n = len(request.prompt_ids)
        if n == 0:
            raise DeepinferError("empty prompt: give at least one token.")
        if self.vocab_size is not None:
            bad = [t for t in request.prompt_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
            if bad:
                raise DeepinferError(f"token id {bad[0]} is outside the model's vocabulary [0, {self.vocab_size}); "
                                     "prompt ids must come from this model's tokenizer.")
        if not isinstance(request.max_tokens, int) or request.max_tokens < 1:
            raise DeepinferError(f"max_tokens={request.max_tokens!r}: give at least 1.")
        request.sampling.check()
        if n >= self.max_len:
            raise DeepinferError(
                f"prompt of {n} tokens is past the context limit: the bundle's KV pool holds "
                f"kv.max_len={self.max_len} positions, so a prompt may have at most {self.max_len - 1} tokens. "
                "Shorten the prompt or compile with a larger kv.max_len."
            )

    def generate(self, requests: list[Request]) -> list[Result]:
        for request in requests:
            self.check(request)
        start = time.perf_counter()
        waiting = deque(enumerate(requests))
        free_slots = list(range(self.max_seqs))
        active: list[_Sequence] = []
        results: list[Result | None] = [None] * len(requests)
        while waiting or active:
            while waiting and free_slots:
                index, request = waiting.popleft()
                seq = _Sequence(index, request, Result(list(request.prompt_ids)), free_slots.pop(0),
                                torch.Generator().manual_seed(request.sampling.seed + index))
                logits = self._prefill(seq)
                self._append(seq, logits, start)
                active.append(seq)
                self._retire(active, free_slots, results)  # its first token may already end it
            if active:
                self._decode(active, start)
            self._retire(active, free_slots, results)
        return results

    @staticmethod
    def _retire(active: list[_Sequence], free_slots: list[int], results: list):
        for seq in [s for s in active if s.result.finish_reason]:
            active.remove(seq)
            free_slots.append(seq.slot)
            results[seq.index] = seq.result

    def _prefill(self, seq: _Sequence) -> torch.Tensor:
        """Run the prompt in chunks: the largest bucket while more remains, then the smallest that fits."""
        ids, done = seq.request.prompt_ids, 0
        while done < len(ids):
            remaining = len(ids) - done
            bucket = next((b for b in self.prefill_buckets if b >= remaining), self.prefill_buckets[-1])
            n = min(bucket, remaining)
            pad = bucket - n
            positions = list(range(done, done + n)) + [0] * pad
            step = Step(
                "prefill",
                tokens=torch.tensor(ids[done : done + n] + [0] * pad),
                positions=torch.tensor(positions),
                slots=torch.tensor([seq.slot] * n + [self.scratch] * pad),
                read_slot=torch.tensor([seq.slot]),
                last_index=torch.tensor([n - 1]),
            )
            logits = self.executor.run(step)
            done += n
        return logits[0]

    def _decode(self, active: list[_Sequence], start: float):
        """One token for every active sequence, in groups of at most the largest decode bucket."""
        largest = self.decode_buckets[-1]
        for lo in range(0, len(active), largest):
            group = active[lo : lo + largest]
            bucket = next(b for b in self.decode_buckets if b >= len(group))
            pad = bucket - len(group)
            step = Step(
                "decode",
                tokens=torch.tensor([s.result.token_ids[-1] for s in group] + [0] * pad),
                positions=torch.tensor([s.length for s in group] + [0] * pad),
                slots=torch.tensor([s.slot for s in group] + [self.scratch] * pad),
            )
            logits = self.executor.run(step)
            for row, seq in enumerate(group):
                self._append(seq, logits[row], start)

    def _append(self, seq: _Sequence, logits: torch.Tensor, start: float):
        token = int(sample(logits[None], seq.request.sampling, seq.generator)[0])
        result = seq.result
        result.token_ids.append(token)
        now = time.perf_counter() - start
        result.token_times.append(now)
        if len(result.token_ids) == 1:
            result.ttft = now
        if token == self.eos_id:
            result.finish_reason = "eos"
        elif len(result.token_ids) >= seq.request.max_tokens:
            result.finish_reason = "max_tokens"
        elif seq.length >= self.max_len:  # the next token would have no cache position
            result.finish_reason = "context"
