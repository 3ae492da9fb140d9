"""One step of work for every rank: which method, at which bucket, on which padded inputs.

The leader builds it, followers receive it (the shared-memory ring carries exactly these fields),
and every rank's executor replays it. Padding rows and tokens point at the scratch slot."""

from dataclasses import dataclass

import torch


@dataclass
class Step:
    method: str  # "prefill" | "decode"
    tokens: torch.Tensor  # [bucket] int64
    positions: torch.Tensor  # [bucket] int64
    slots: torch.Tensor  # [bucket] int64: the KV slot each row/token writes (decode: also reads)
    read_slot: torch.Tensor | None = None  # [1] int64, prefill: the sequence whose cache is attended
    last_index: torch.Tensor | None = None  # [1] int64, prefill: the row whose logits are returned

    @property
    def bucket(self) -> int:
        return self.tokens.shape[0]

    def inputs(self) -> tuple[torch.Tensor, ...]:
        """The method's inputs in the model's argument order (KV caches excluded)."""
        if self.method == "prefill":
            return (self.tokens, self.positions, self.slots, self.read_slot, self.last_index)
        return (self.tokens, self.positions, self.slots)
