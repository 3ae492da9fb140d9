"""Next-token choice on the leader: greedy, or temperature plus nucleus (top-p) sampling."""

import math
from dataclasses import dataclass

import torch

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


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """logits [N, V] float32 -> token ids [N]. Raises only on logits that are not numbers (NaN):
    the engine then fails that one request."""
    if params.temperature < GREEDY_BELOW:
        return logits.argmax(dim=-1)
    probs = (logits / params.temperature).softmax(dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= params.top_p
        outside[..., 0] = False  # (a top_p that underflows to 0 in float32 would mask it too)
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
