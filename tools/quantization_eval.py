"""What int8 and int4 weights (recipe `model.quantize`) cost the trained tiny DeepSeek-V3 in quality:
its held-out loss in float32, bfloat16, int8 and int4, and how often greedy continuations of code
prompts equal float32's.

    .venv/bin/python tools/quantization_eval.py                       # checkpoints/tiny-v3-code, ~1 minute

The held-out text is tools/train_tiny.py's: the stdlib files it never trained on. The loss is the
mean next-token cross-entropy (nats) over `--spans` spans of `--length` tokens (fixed seed), each
one prefill of the model as the compiler traces it (models/), with the weights each variant
stores: the same codes the compiler writes into a bundle (models/int_weights.py). A linear whose
inputs the int4 group does not divide stays int8 (the bytes a token reads show how much is int4).
DeepSeek-V3 checkpoints only: it calls the V3 model's prefill of every row, whose arguments V4's
differ from.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tiny import corpus, span, token_stream  # noqa: E402

from deepinfer.models import build_model  # noqa: E402
from deepinfer.models.decode_reads import weight_bytes_per_token  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {"float32": {}, "bfloat16": {"dtype": "bfloat16"}, "int8": {"quantize": "int8"},
            "int4 g32": {"quantize": "int4", "quantize_group": 32}, "int4 g64": {"quantize": "int4", "quantize_group": 64},
            "int4 g128": {"quantize": "int4", "quantize_group": 128}}


def heldout_stream(checkpoint: Path) -> torch.Tensor:
    return token_stream(Tokenizer.from_file(str(checkpoint / "tokenizer.json")), corpus()[1])


def all_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """One prefill of `tokens` [T] in slot 0 -> float32 logits [T, V] of every row."""
    T = tokens.numel()
    state = model.new_state(1, T)
    zeros = torch.zeros(T, dtype=torch.long)
    return model._prefill(tokens, torch.arange(T), zeros, zeros[:1], state).float()


@torch.no_grad()
def heldout_loss(model, stream: torch.Tensor, spans: int, length: int) -> float:
    generator = torch.Generator().manual_seed(1234)
    total = 0.0
    for _ in range(spans):
        tokens = span(stream, length, generator)
        total += F.cross_entropy(all_logits(model, tokens)[:-1], tokens[1:]).item()
    return total / spans


@torch.no_grad()
def greedy(model, prompt: torch.Tensor, tokens: int) -> list[int]:
    """Greedy continuation of `prompt` [T] by prefill then one decode step a token."""
    T = prompt.numel()
    state = model.new_state(1, T + tokens)
    zeros = torch.zeros(T, dtype=torch.long)
    logits = model.prefill(prompt, torch.arange(T), zeros, zeros[:1], torch.tensor([T - 1]), state)
    out = []
    for i in range(tokens):
        out.append(int(logits[0].argmax()))
        logits = model.decode(torch.tensor(out[-1:]), torch.tensor([T + i]), torch.zeros(1, dtype=torch.long), state)
    return out


def prompts(stream: torch.Tensor, count: int, length: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(99)
    return [span(stream, length, generator) for _ in range(count)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=ROOT / "checkpoints" / "tiny-v3-code")
    parser.add_argument("--spans", type=int, default=32)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    torch.manual_seed(0)
    stream = heldout_stream(args.checkpoint)
    code_prompts = prompts(stream, args.prompts, 48)
    print(f"{args.checkpoint.name}: held-out loss over {args.spans} spans of {args.length} tokens; greedy agreement with "
          f"float32 over {args.prompts} code prompts of 48 tokens, {args.tokens} tokens each\n")
    print("| weights | MiB read a token | held-out loss (nats) | vs float32 | prompts continued exactly as float32 | tokens equal |")
    print("|---|---|---|---|---|---|")
    reference = None
    for name, options in VARIANTS.items():
        model = build_model(checkpoint=args.checkpoint, **options)
        loss = heldout_loss(model, stream, args.spans, args.length)
        continuations = [greedy(model, p, args.tokens) for p in code_prompts]
        if reference is None:
            reference = (loss, continuations)
        same = sum(c == r for c, r in zip(continuations, reference[1]))
        tokens = sum(a == b for c, r in zip(continuations, reference[1]) for a, b in zip(c, r))
        specs = [(n, list(p.shape), p.dtype) for n, p in model.named_parameters()]
        print(f"| {name} | {weight_bytes_per_token(model, specs, 1) / 2**20:.2f} | {loss:.4f} | {loss - reference[0]:+.4f} | {same}/{len(code_prompts)} | "
              f"{tokens}/{len(code_prompts) * args.tokens} |", flush=True)


if __name__ == "__main__":
    main()
