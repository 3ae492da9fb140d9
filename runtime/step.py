"""One step of work for every rank: which method, at which bucket, on which padded inputs.

The leader builds it, followers receive it (the shared-memory ring carries exactly these fields),
and every rank's executor replays it. Padding rows and tokens point at the scratch slot."""

from dataclasses import dataclass

import numpy as np
import torch

METHODS = ("stop", "prefill", "decode", "draft", "score", "copy")
# The inputs each method's program reads, in the model's argument order (Step.inputs()). `draft`:
# a speculative decoding draft step (the MTP module), laid out as decode; it returns draft tokens.
# `score`: a prefill chunk that also scores each row's next prompt token (prompt logprobs).
STEP_FIELDS = {"prefill": ("tokens", "positions", "slots", "read_slot", "last_index"), "decode": ("tokens", "positions", "slots"),
               "draft": ("tokens", "positions", "slots"),
               "score": ("tokens", "positions", "slots", "read_slot", "last_index", "targets"),
               "copy": ("tokens", "positions", "slots", "read_slot")}  # (no program: see copy_step)
ROW_FIELDS = ("tokens", "positions", "slots", "targets")  # [bucket] each; the step record carries them all
HEADER_WORDS = 5  # method, bucket, read_slot, last_index, context


@dataclass
class Step:
    method: str  # "prefill" | "decode" | "draft" | "score" | "copy"
    tokens: torch.Tensor  # [bucket] int64
    positions: torch.Tensor  # [bucket] int64
    slots: torch.Tensor  # [bucket] int64: the KV slot each row/token writes (decode, draft: also reads)
    read_slot: torch.Tensor | None = None  # [1] int64, prefill: the sequence whose cache is attended
    last_index: torch.Tensor | None = None  # [1] int64, prefill: the row whose logits are returned
    context: int | None = None  # the context bucket: every position is below it (None: the whole pool)
    targets: torch.Tensor | None = None  # [bucket] int64, score: each row's next prompt token

    @property
    def bucket(self) -> int:
        return self.tokens.shape[0]

    @property
    def key(self) -> str:
        return program_key(self.method, self.bucket, self.context)

    def inputs(self) -> tuple[torch.Tensor, ...]:
        """The method's inputs in the model's argument order (KV caches excluded)."""
        return tuple(getattr(self, name) for name in STEP_FIELDS[self.method])


def copy_step(source: int, target: int, positions: int) -> Step:
    """A step that runs no program: every rank copies the state slot `source` holds for its first
    `positions` positions into slot `target` (prefix caching: a prefix another slot holds). Carried
    as read_slot = source, slots = [target], positions = [positions]; its token is unused."""
    return Step("copy", torch.zeros(1, dtype=torch.int64), torch.tensor([positions]), torch.tensor([target]),
                read_slot=torch.tensor([source]))


def entries_holding(positions: int, positions_per_entry: int | None, row_entries: int) -> int:
    """How many of a state row's `row_entries` entries hold a sequence's first `positions`
    positions: one per positions_per_entry (the last one partly filled included), or the whole row
    for a tensor of a fixed size (a ring, a compressor's buffer: it holds the last positions)."""
    if positions_per_entry is None:
        return row_entries
    return min(-(-positions // positions_per_entry), row_entries)


def copy_state(tensor: torch.Tensor, positions_per_entry: int | None, step: Step):
    """Do a copy step to one state tensor [slots, ...]: the entries holding its first positions."""
    source, target = int(step.read_slot[0]), int(step.slots[0])
    entries = entries_holding(int(step.positions[0]), positions_per_entry, tensor.shape[1])
    tensor[target, :entries].copy_(tensor[source, :entries])


def program_key(method: str, bucket: int, context: int | None) -> str:
    """"decode/4", or "decode/4/1024" for the program over the first 1024 positions of the state."""
    return f"{method}/{bucket}" + (f"/{context}" if context is not None else "")


def payload_words(max_bucket: int) -> int:
    """Size of one encoded step record, in int64 words."""
    return HEADER_WORDS + len(ROW_FIELDS) * max_bucket


def encode(step: Step | None, max_bucket: int) -> np.ndarray:
    """[method, bucket, read_slot, last_index, context, tokens..., positions..., slots..., targets...]
    (each row field padded to max_bucket; -1 for a field the step has not); None means stop."""
    record = np.zeros(payload_words(max_bucket), dtype=np.int64)
    if step is None:
        return record
    n = step.bucket
    context = -1 if step.context is None else step.context
    record[:HEADER_WORDS] = [METHODS.index(step.method), n, _scalar(step.read_slot), _scalar(step.last_index), context]
    for i, name in enumerate(ROW_FIELDS):
        if getattr(step, name) is not None:
            start = HEADER_WORDS + i * max_bucket
            record[start : start + n] = getattr(step, name).numpy()
    return record


def decode(record: np.ndarray, max_bucket: int) -> Step | None:
    method = METHODS[int(record[0])]
    if method == "stop":
        return None
    n = int(record[1])
    fields = {name: torch.from_numpy(record[HEADER_WORDS + i * max_bucket :][:n].copy())
              for i, name in enumerate(ROW_FIELDS) if name in STEP_FIELDS[method]}
    if "read_slot" in STEP_FIELDS[method]:
        fields.update(read_slot=torch.tensor([int(record[2])]), last_index=torch.tensor([int(record[3])]))
    return Step(method, **fields, context=None if record[4] < 0 else int(record[4]))


def _scalar(t: torch.Tensor | None) -> int:
    return -1 if t is None else int(t[0])
