"""The tiny recipe's DeepSeek-V3 in HF transformers, saved as a checkpoint, and its greedy tokens:
the outside reference compiled bundles are checked against."""

import torch
import yaml

from tests.conftest import TINY_RECIPE

from .test_hf_parity import decisive_init


def tiny_hf_checkpoint(directory, seed: int):
    """(HF model, directory): recipes/tiny.yaml's config with decisive random weights, saved there."""
    import transformers

    config = dict(yaml.safe_load(TINY_RECIPE.read_text())["model"]["config"], num_key_value_heads=4)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**config)).eval()
    hf.config._attn_implementation = "eager"
    decisive_init(hf, seed=seed)
    hf.save_pretrained(directory)
    return hf, directory


def hf_greedy(hf, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens by full forwards (no cache)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
