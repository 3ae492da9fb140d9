"""Our DeepSeek-V4 against HF transformers on the same weights (saved with save_pretrained).

Every sequence runs through our fixed state pool (chunked prefill, batched decode through the
engine, slots reused) and must give transformers' FULL forward (no cache) on the same tokens:
logits within 1e-4 in float32 and the same greedy tokens, except at genuine near-ties.

Ties: the Lightning indexer keeps the top-k of sum_h w_h * ReLU(q_h . k_e). With few index
heads and tiny random weights, many entries score exactly 0 (every ReLU zero), and top-k then
breaks the tie by position in a tensor whose length differs between runs: even transformers'
cached and uncached paths disagree by O(1) logits. These configs use 8 index heads, which makes
an all-zero score (and so a tie at the top-k boundary) rare enough that none occurs here.
"""

import pytest
import torch

from deepinfer.compiler.eager import eager_engine
from deepinfer.models import build_model
from deepinfer.runtime.engine import Request

from .conftest import greedy
from .test_hf_parity import decisive_init

transformers = pytest.importorskip("transformers")

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
BASE = dict(
    vocab_size=128, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4, head_dim=16,
    q_lora_rank=24, partial_rotary_factor=0.5, n_routed_experts=4, num_experts_per_tok=2,
    layer_types=[SLIDING, CSA, HCA, CSA], mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    compress_rates={CSA: 4, HCA: 8}, sliding_window=8, o_groups=2, o_lora_rank=8, index_n_heads=8, index_head_dim=8,
    index_topk=2, hc_mult=2, max_position_embeddings=256,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1},
)
CONFIGS = {
    "every_type_hc2": BASE,
    "sigmoid_hc4_legacy_ratios": dict(
        {k: v for k, v in BASE.items() if k != "layer_types"}, scoring_func="sigmoid", hc_mult=4, compress_ratios=[128, 4, 0, 128],
        compress_rates={CSA: 4, HCA: 128}, num_hidden_layers=4, mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        index_topk=3, hc_sinkhorn_iters=7),
}
PROMPTS = [[5, 17, 42], list(range(3, 40)), [9] * 12 + [100, 101]]
STEPS = 20
MAX_LEN = 128


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    """(name, HF model, our model loaded from its save_pretrained directory)."""
    name = request.param
    torch.manual_seed(0)
    hf = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**CONFIGS[name])).eval()
    hf.config._attn_implementation = "eager"
    decisive_init(hf, seed=1)
    directory = tmp_path_factory.mktemp(name)
    hf.save_pretrained(directory)
    return name, hf, build_model("deepseek_v4", checkpoint=directory)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]  # [T, V], full forward, no cache


def check_tokens(hf_rows: torch.Tensor, ours: list[int]):
    """Greedy tokens equal HF's argmax, except where HF's top-2 margin is a near-tie."""
    top2 = hf_rows.topk(2, dim=-1)
    for step, token in enumerate(ours):
        if top2.values[step, 0] - top2.values[step, 1] > 1e-4:
            assert token == int(top2.indices[step, 0]), f"step {step}"


@pytest.mark.parametrize("prompt", PROMPTS, ids=["shorter_than_a_window", "closes_many_windows", "repeat"])
@pytest.mark.parametrize("chunk", [6, 64], ids=["chunks_straddle_windows", "one_chunk"])
def test_prefill_then_decode_matches_hf_full_forward(pair, prompt, chunk):
    name, hf, ours = pair
    tokens, our_logits = greedy(ours, prompt, STEPS, chunk=chunk)  # 20 decode steps close 2+ HCA windows of 8
    reference = hf_logits(hf, prompt + tokens[:-1])[len(prompt) - 1 :]
    diff = (our_logits - reference).abs().max().item()
    print(f"{name} prompt_len={len(prompt)} chunk={chunk} max_abs_diff={diff:.2e}")
    assert diff < 1e-4
    check_tokens(reference, tokens)


def test_batched_decode_and_reused_slots_match_hf(pair):
    """6 prompts over 2 slots through the engine: decode batches with padding rows, and every slot
    reused by later sequences, which must not see their predecessors' state."""
    name, hf, ours = pair
    prompts = [list(range(10, 31)), [7, 8], [50] * 9, list(range(60, 66)), [3, 1, 4, 1, 5, 9, 2, 6], [111]]
    engine = eager_engine(ours, prefill_buckets=(8,), decode_buckets=(1, 4), max_seqs=2, max_len=MAX_LEN)
    results = engine.generate([Request(p, max_tokens=12) for p in prompts])
    for prompt, result in zip(prompts, results):
        reference = hf_logits(hf, prompt + result.token_ids[:-1])[len(prompt) - 1 :]
        check_tokens(reference, result.token_ids)


def test_upstream_names_load_the_same_model(pair, tmp_path):
    """DeepSeek's own checkpoint names (`layers.0.attn.wq_a.weight`, `embed.weight`, `hc_head_fn`)
    read into the same model as transformers' save_pretrained layout."""
    from safetensors.torch import load_file, save_file

    name, hf, ours = pair
    hf_dir = tmp_path / "hf"
    hf.save_pretrained(hf_dir)
    renames = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
               "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
               "model.hc_head.hc_scale": "hc_head_scale"}
    weights = {renames.get(k, k.removeprefix("model.")): v for k, v in load_file(hf_dir / "model.safetensors").items()}
    upstream = tmp_path / "upstream"
    upstream.mkdir()
    save_file(weights, upstream / "model.safetensors")
    (upstream / "config.json").write_text((hf_dir / "config.json").read_text())
    theirs = build_model("deepseek_v4", checkpoint=upstream)
    for (n, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert torch.equal(a, b), n
