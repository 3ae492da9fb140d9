"""Helpers that drive our model's prefill/decode directly, without the engine."""

import pytest
import torch

MAX_SEQS, MAX_LEN = 4, 128


def prefill(model, kv, slot: int, ids: list[int], start: int = 0, chunk: int = 16) -> torch.Tensor:
    """Prefill ids at positions start.. in chunks of `chunk` tokens (the last one padded).
    Padding tokens write to the scratch slot. Returns the last real token's logits [V]."""
    scratch = kv[0][0].shape[0] - 1
    for lo in range(0, len(ids), chunk):
        piece = ids[lo : lo + chunk]
        n = len(piece)
        tokens = torch.tensor(piece + [0] * (chunk - n))
        positions = torch.arange(start + lo, start + lo + chunk).clamp(max=MAX_LEN - 1)
        write_slots = torch.tensor([slot] * n + [scratch] * (chunk - n))
        logits = model.prefill(tokens, positions, write_slots, torch.tensor([slot]), torch.tensor([n - 1]), kv)
    return logits[0]


def greedy(model, prompt: list[int], steps: int, chunk: int = 16, slot: int = 0):
    """Greedy continuation through our KV cache: (tokens, logits [steps, V] that chose them)."""
    kv = model.new_state(MAX_SEQS, MAX_LEN)
    logits = [prefill(model, kv, slot, prompt, chunk=chunk)]
    tokens = [int(logits[-1].argmax())]
    for i in range(steps - 1):
        pos = len(prompt) + i
        out = model.decode(torch.tensor([tokens[-1]]), torch.tensor([pos]), torch.tensor([slot]), kv)
        logits.append(out[0])
        tokens.append(int(out[0].argmax()))
    return tokens, torch.stack(logits)


@pytest.fixture
def tiny_model():
    from deepinfer.models import TINY_CONFIG, build_model

    return build_model(config=TINY_CONFIG, seed=0)
