"""Our DeepSeek-V3 against HF transformers on the same weights (saved with save_pretrained).

Prefill then decode through our KV cache must give HF's full-forward logits (max abs diff < 1e-4,
float32) and the same greedy tokens, except at genuine near-ties (HF top-2 margin < 1e-4)."""

import math

import pytest
import torch

from deepinfer.models import build_model

from .conftest import greedy

transformers = pytest.importorskip("transformers")

BASE = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    n_group=4, topk_group=2, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=40, qk_rope_head_dim=8,
    qk_nope_head_dim=16, v_head_dim=12, max_position_embeddings=256, routed_scaling_factor=2.5,
)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
CONFIGS = {
    "yarn_groups_interleave": dict(BASE, rope_parameters=YARN, rope_interleave=True),
    "no_qlora_tied_rotate_half": dict(BASE, q_lora_rank=None, tie_word_embeddings=True, rope_interleave=False,
                                      rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                                      norm_topk_prob=False, n_shared_experts=2, first_k_dense_replace=0),
    "yarn_mscale_bias_sharded": dict(BASE, rope_parameters=dict(YARN, mscale=0.7, mscale_all_dim=1.0, factor=8.0),
                                     attention_bias=True, n_group=2, topk_group=1, num_experts_per_tok=3,
                                     routed_scaling_factor=1.0),
}
PROMPTS = [[5, 17, 42, 99, 7], list(range(10, 40)), [3] * 12 + [250, 251]]
STEPS = 16


def decisive_init(model: torch.nn.Module, seed: int):
    """HF's std=0.02 init gives near-uniform logits; scale like a trained model instead. (V4's
    hash tables send each token to distinct experts; its mHC scales stay near 1.)"""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in sorted(list(model.named_parameters()) + list(model.named_buffers())):
            if "inv_freq" in name:
                continue
            if name.endswith("tid2eid"):
                experts = model.config.n_routed_experts
                tensor.copy_(torch.stack([torch.randperm(experts, generator=gen)[: tensor.shape[1]] for _ in range(tensor.shape[0])]))
            elif "norm" in name or name.endswith("scale"):
                tensor.copy_(1.0 + 0.1 * torch.randn(tensor.shape, generator=gen))
            elif name.endswith(("base", "sinks")):
                tensor.copy_(0.3 * torch.randn(tensor.shape, generator=gen))
            elif name.endswith("e_score_correction_bias") or name.endswith(".bias"):
                tensor.copy_(0.1 * torch.randn(tensor.shape, generator=gen))
            else:
                fan_in = 1 if "embed_tokens" in name else tensor.shape[-1]
                tensor.copy_(torch.randn(tensor.shape, generator=gen) / math.sqrt(fan_in))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    """(HF model, our model loaded from its save_pretrained directory)."""
    name = request.param
    config = transformers.DeepseekV3Config(**CONFIGS[name])
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(config).eval()
    hf.config._attn_implementation = "eager"
    decisive_init(hf, seed=1)
    directory = tmp_path_factory.mktemp(name)
    hf.save_pretrained(directory, max_shard_size="100KB" if "sharded" in name else "1GB")
    if "sharded" in name:
        assert len(list(directory.glob("*.safetensors"))) > 1
    return name, hf, build_model(checkpoint=directory)


@pytest.mark.parametrize("chunk", [8, 32], ids=["absorbed", "expanded"])
@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "long", "repeat"])
def test_prefill_then_decode_matches_hf_full_forward(pair, prompt, chunk):
    """Chunks of 8 attend in the latent space; chunks of 32 expand each head's keys and values
    from the cached latents (32 queries, past BASE's 24.9)."""
    name, hf, ours = pair
    assert ours.layers[0].self_attn.expands(chunk, 1) == (chunk == 32)
    tokens, our_logits = greedy(ours, prompt, STEPS, chunk=chunk)
    with torch.no_grad():
        hf_logits = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]  # [STEPS, V]
    diff = (our_logits - hf_logits).abs().max().item()
    print(f"{name} prompt_len={len(prompt)} max_abs_diff={diff:.2e}")
    assert diff < 1e-4
    top2 = hf_logits.topk(2, dim=-1).values
    for step, token in enumerate(tokens):
        if token != int(hf_logits[step].argmax()):
            margin = (top2[step, 0] - top2[step, 1]).item()
            assert margin < 1e-4, f"step {step}: ours {token}, HF {int(hf_logits[step].argmax())}, margin {margin}"
