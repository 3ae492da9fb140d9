"""Next-token choice on the leader: greedy, or temperature plus nucleus (top-p) sampling; and
speculative decoding's acceptance of drafted tokens, which keeps the model's distribution."""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .errors import DeepinferError

# A temperature below this is greedy (vLLM's _SAMPLING_EPS): logits / T in float32 would soon
# overflow, and T itself underflows to 0 in float32 below ~1e-45.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    seed: int = 0

    def check(self):
        """Raise a DeepinferError naming the first parameter out of range."""
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise DeepinferError(f"temperature={self.temperature!r}: give a finite number, 0 (greedy) or more.")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise DeepinferError(f"top_p={self.top_p!r}: give a number in (0, 1].")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 1 << 63:
            raise DeepinferError(f"seed={self.seed!r}: give an integer in [0, 2**63).")


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [N, V] float32 -> the distribution tokens are drawn from [N, V]: temperature, then
    the nucleus (top-p); greedy is the one-hot of the argmax."""
    if params.temperature < GREEDY_BELOW:
        return F.one_hot(logits.argmax(dim=-1), logits.shape[-1]).to(logits.dtype)
    probs = (logits / params.temperature).softmax(dim=-1)
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
    """logits [N, V] float32 -> token ids [N]. Raises only on logits that are not numbers (NaN):
    the engine then fails that one request."""
    if params.temperature < GREEDY_BELOW:
        return logits.argmax(dim=-1)
    return torch.multinomial(probabilities(logits, params), 1, generator=generator)[:, 0]


def verify_drafts(logits: torch.Tensor, drafts: list[int], params: SamplingParams, generator: torch.Generator) -> list[int]:
    """Speculative decoding's acceptance: `logits` [m + 1, V] are the model's at the last token
    and at each of the m drafts, which the drafter chose by argmax (a one-hot distribution q).
    Returns the tokens to emit: the accepted drafts, then one more -- drawn from the model where a
    draft was rejected, or after the last. Greedy: a draft is accepted while it is the model's
    argmax. Sampling: draft d is accepted with probability min(1, p(d) / q(d)) = p(d), and a
    rejection draws from max(0, p - q) renormalised, p without d (Leviathan et al. 2023; Chen et
    al. 2023), so what is emitted is distributed exactly as the model's own samples (p after
    temperature and top-p): a token p gives no mass is never emitted."""
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
