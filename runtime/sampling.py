"""Next-token choice on the leader, with vLLM's and OpenAI's sampling knobs and semantics; the
log-probabilities reported to clients; and speculative decoding's acceptance of drafted tokens,
which keeps the model's distribution.

Order (vLLM's sampler): logit_bias and min_tokens, then the penalties -- these change what
greedy picks too -- then temperature, min_p, top_k and top_p. Reported logprobs are the model's
own (log-softmax of the raw logits, vLLM's default `raw_logprobs`), as transformers gives them.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .errors import DeepinferError

# A temperature below this is greedy (vLLM's _SAMPLING_EPS): logits / T in float32 would soon
# overflow, and T itself underflows to 0 in float32 below ~1e-45.
GREEDY_BELOW = 1e-5
MAX_LOGPROBS = 20  # top logprobs a request may ask for per token (OpenAI's limit)
# The largest logit a penalty may make: divided by the smallest temperature that is not greedy it
# is still finite in float32 (1e30 / 1e-5 = 1e35 < 3.4e38).
LARGEST_LOGIT = 1e30


class SamplingError(DeepinferError):
    """A sampling parameter the request or the bundle cannot take; `param` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    seed: int = 0
    top_k: int = 0  # keep the k most likely tokens (0: all)
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one
    presence_penalty: float = 0.0  # subtracted from a token's logit once it was generated
    frequency_penalty: float = 0.0  # ... times the times it was generated
    repetition_penalty: float = 1.0  # a prompt's or generated token's logit: divided (> 0) or multiplied (< 0) by it
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, added to its logit)
    min_tokens: int = 0  # EOS and stop_token_ids cannot end a sequence before this many tokens
    stop_token_ids: tuple[int, ...] = ()  # generating one of these ends the sequence (it is kept)
    logprobs: int | None = None  # per generated token, its logprob and the top N (None: none)
    prompt_logprobs: int | None = None  # per prompt token, likewise (needs a bundle compiled with prompt_logprobs)

    def check(self, vocab_size: int | None = None, score_top: int | None = None):
        """Raise a SamplingError naming the first parameter out of range; given a model, against its
        vocabulary and the top tokens its score programs return (`score_top`; 0: it has none)."""
        def fail(param: str, message: str):
            raise SamplingError(param, f"{param}={getattr(self, param)!r}: {message}")

        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            fail("temperature", "give a finite number, 0 (greedy) or more.")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            fail("top_p", "give a number in (0, 1].")
        if not _is_int(self.seed) or not 0 <= self.seed < 1 << 63:
            fail("seed", "give an integer in [0, 2**63).")
        if not _is_int(self.top_k) or self.top_k < 0:
            fail("top_k", "give 0 (all tokens) or a number of tokens.")
        if not _number_in(self.min_p, 0, 1):
            fail("min_p", "give a number in [0, 1].")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _number_in(getattr(self, name), -2, 2):
                fail(name, "give a number in [-2, 2].")
        if not _number_in(self.repetition_penalty, 0, 2) or self.repetition_penalty == 0:
            fail("repetition_penalty", "give a number in (0, 2] (1: none).")
        if not all(_is_int(t) and _number_in(b, -100, 100) for t, b in self.logit_bias):
            fail("logit_bias", "give token ids and biases in [-100, 100].")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            fail("min_tokens", "give 0 or more.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                fail(name, f"give 0 to {MAX_LOGPROBS} top tokens.")
        for name, ids in (("logit_bias", [t for t, _ in self.logit_bias]), ("stop_token_ids", self.stop_token_ids)):
            outside = [t for t in ids if vocab_size is not None and not 0 <= t < vocab_size]
            if outside:
                raise SamplingError(name, f"{name}: token id {outside[0]} is outside the model's vocabulary [0, {vocab_size}).")
        if score_top is not None and self.prompt_logprobs is not None and self.prompt_logprobs > score_top:
            fail("prompt_logprobs", f"this bundle scores prompts with at most {score_top} top tokens." if score_top else
                 "this bundle was compiled without score programs; compile its recipe with `prompt_logprobs: true`.")

    @property
    def adjusts(self) -> bool:
        """Whether the logits change before sampling (bias, min_tokens, penalties)."""
        return bool(self.logit_bias or self.min_tokens or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1)


def adjust(logits: torch.Tensor, params: SamplingParams, prompt: list[int], histories: list[list[int]],
           stop_ids: list[int]) -> torch.Tensor:
    """logits [N, V] float32, row j following the generated tokens histories[j] -> the logits
    greedy and sampling choose from: + logit_bias; `stop_ids` (EOS and stop_token_ids) at -inf
    while fewer than min_tokens were generated; repetition_penalty over the prompt's and the
    generated tokens, then frequency and presence penalties over the generated ones (vLLM's
    apply_penalties)."""
    if not params.adjusts:
        return logits
    logits = logits.clone()
    for row, history in zip(logits, histories):
        if params.logit_bias:
            ids, biases = zip(*params.logit_bias)
            row.index_add_(0, torch.tensor(ids), torch.tensor(biases, dtype=row.dtype))
        if len(history) < params.min_tokens and stop_ids:
            row[stop_ids] = -math.inf
        if params.repetition_penalty != 1:
            seen = torch.tensor(sorted(set(prompt) | set(history)))
            values = row[seen]
            # (a tiny penalty divides a logit past float32: saturate, so softmax still sees numbers)
            raised = (values / params.repetition_penalty).clamp(max=LARGEST_LOGIT)
            row[seen] = torch.where(values > 0, raised, values * params.repetition_penalty)
        if history and (params.presence_penalty or params.frequency_penalty):
            ids, counts = torch.tensor(history).unique(return_counts=True)
            row[ids] -= params.frequency_penalty * counts + params.presence_penalty
    return logits


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [N, V] float32 -> the distribution tokens are drawn from [N, V]: temperature, then
    min_p, top_k and the nucleus (top-p); greedy is the one-hot of the argmax."""
    if params.temperature < GREEDY_BELOW:
        return F.one_hot(logits.argmax(dim=-1), logits.shape[-1]).to(logits.dtype)
    logits = logits / params.temperature
    if params.min_p > 0:
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.amax(dim=-1, keepdim=True), -math.inf)
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)  # (ties with the k-th stay, as vLLM's)
    probs = logits.softmax(dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= params.top_p
        outside[..., 0] = False  # (a top_p that underflows to 0 in float32 would mask it too)
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)  # (a distribution: draft acceptance compares two)
    return probs


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """logits [N, V] float32 (adjusted) -> token ids [N]. Raises only on logits that are not
    numbers (NaN): the engine then fails that one request."""
    if params.temperature < GREEDY_BELOW:
        return logits.argmax(dim=-1)
    return torch.multinomial(probabilities(logits, params), 1, generator=generator)[:, 0]


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """Raw logits [N, V] and the token chosen at each row -> per row (its logprob, the `top` most
    likely (token, logprob), most likely first)."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
    values, ids = logprobs.topk(top, dim=-1) if top else (logprobs[:, :0], logprobs[:, :0].long())
    return [(lp, list(zip(i, v))) for lp, i, v in zip(chosen, ids.tolist(), values.tolist())]


def verify_drafts(logits: torch.Tensor, drafts: list[int], params: SamplingParams, generator: torch.Generator) -> list[int]:
    """Speculative decoding's acceptance: `logits` [m + 1, V] (adjusted) are the model's at the
    last token and at each of the m drafts, which the drafter chose by argmax (a one-hot
    distribution q). Returns the tokens to emit: the accepted drafts, then one more -- drawn from
    the model where a draft was rejected, or after the last. Greedy: a draft is accepted while it
    is the model's argmax. Sampling: draft d is accepted with probability min(1, p(d) / q(d)) =
    p(d), and a rejection draws from max(0, p - q) renormalised, p without d (Leviathan et al.
    2023; Chen et al. 2023), so what is emitted is distributed exactly as the model's own samples
    (p after temperature, min_p, top_k and top_p): a token p gives no mass is never emitted."""
    if params.temperature < GREEDY_BELOW:
        best = logits.argmax(dim=-1).tolist()
        n = 0
        while n < len(drafts) and drafts[n] == best[n]:
            n += 1
        return drafts[:n] + [best[n]]
    p = probabilities(logits, params)
    for j, token in enumerate(drafts):
        if torch.rand(1, generator=generator).item() < p[j, token]:
            continue
        residual = p[j].clone()
        residual[token] = 0.0
        if not residual.sum() > 0:  # (all of p's mass on d, short of 1.0 by rounding: accepted)
            continue
        return drafts[:j] + [int(torch.multinomial(residual, 1, generator=generator))]
    return drafts + [int(torch.multinomial(p[-1], 1, generator=generator))]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number_in(value, low: float, high: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high
