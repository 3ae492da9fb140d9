"""The eager reference: our PyTorch model behind the same executor interface as a compiled bundle.

    python -m deepinfer.compiler.eager --prompt "hello"       # built-in tiny model, random weights
    python -m deepinfer.compiler.eager --arch deepseek_v4 --prompt "hello"
    python -m deepinfer.compiler.eager --checkpoint DIR --prompt "hello" --max-tokens 16

Compiled bundles are checked against this.
"""

import click
import torch

from deepinfer.compiler.recipe import speculative_buckets
from deepinfer.models import ARCHS, build_model
from deepinfer.models.prompt_scoring import TOP as SCORE_TOP
from deepinfer.models.state import allocate, context_view
from deepinfer.runtime.engine import Engine, Request
from deepinfer.runtime.step import copy_state
from deepinfer.runtime.tokenizer import load_tokenizer


class EagerExecutor:
    """Runs each Step on the eager model with its own state pool."""

    def __init__(self, model, max_seqs: int, max_len: int):
        self.model = model
        self.specs = model.state_specs(max_seqs, max_len)
        self.state = allocate(self.specs)
        self.views = {None: self.state}  # context -> the state views a step of that context runs on

    @torch.inference_mode()
    def run(self, step):
        """A step with a context bucket runs on the same views of the state a bundle binds."""
        if step.method == "copy":
            for tensors, specs in zip(self.state, self.specs):
                for tensor, spec in zip(tensors, specs):
                    copy_state(tensor, spec.positions_per_entry, step)
            return None
        if step.context not in self.views:
            self.views[step.context] = [[context_view(t, s, step.context) for t, s in zip(ts, ss)]
                                        for ts, ss in zip(self.state, self.specs)]
        return getattr(self.model, step.method)(*step.inputs(), self.views[step.context])


def eager_engine(model, prefill_buckets=(16, 64), decode_buckets=(1, 2, 4), max_seqs=4, max_len=256,
                 contexts: dict[str, list[int]] | None = None, prefix_caching: bool = True) -> Engine:
    """Speculative decoding drafts as many tokens a step as the model was built for (build_model(draft_tokens=k));
    prompts can be scored (the eager model has every method)."""
    executor = EagerExecutor(model, max_seqs, max_len)
    k = model.config.draft_tokens
    entries = [s.positions_per_entry for layer in executor.specs for s in layer]
    return Engine(executor, prefill_buckets, speculative_buckets(list(decode_buckets), k), max_seqs, max_len,
                  model.config.eos_token_id, model.config.vocab_size, contexts, k, SCORE_TOP, entries, prefix_caching)


@click.command()
@click.option("--arch", type=click.Choice(sorted(ARCHS)), default="deepseek_v3", show_default=True)
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False), help="HF checkpoint dir (default: built-in tiny model)")
@click.option("--seed", default=0, help="seed of the built-in random model")
@click.option("--prompt", "prompts", multiple=True, default=["Hello, DeepSeek!"])
@click.option("--max-tokens", default=24)
def main(arch, checkpoint, seed, prompts, max_tokens):
    model = build_model(arch, checkpoint=checkpoint, config=None if checkpoint else ARCHS[arch].tiny_config, seed=seed)
    tokenizer = load_tokenizer(checkpoint, model.config.vocab_size)
    engine = eager_engine(model)
    results = engine.generate([Request(tokenizer.encode(p), max_tokens) for p in prompts])
    for prompt, result in zip(prompts, results):
        click.echo(f"{prompt!r} -> {tokenizer.decode(result.token_ids)!r}  ({len(result.token_ids)} tokens, {result.finish_reason})")


if __name__ == "__main__":
    main()
