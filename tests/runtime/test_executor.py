"""Compiled bundles replay the eager model exactly: same greedy tokens, both backends."""

import pytest

from deepinfer.compiler.eager import eager_engine
from deepinfer.models import build_model
from deepinfer.runtime.engine import Engine, Request
from deepinfer.runtime.executor import BundleExecutor

PROMPTS = [[5, 6, 7], list(range(20, 90)), [100] * 17, [9, 8], list(range(200, 230)), [40, 41, 42, 43, 44, 45], [77]]


@pytest.mark.parametrize("backend", ["export", "inductor"])
def test_compiled_tokens_equal_eager_tokens(tiny_bundle, backend):
    executor = BundleExecutor(tiny_bundle(backend))
    m = executor.manifest
    model = build_model(config=m.model_config, seed=m.recipe["model"]["seed"])
    reference = eager_engine(model, m.buckets["prefill"], m.buckets["decode"], m.kv.max_seqs, m.kv.max_len)
    compiled = Engine(executor, m.buckets["prefill"], m.buckets["decode"], m.kv.max_seqs, m.kv.max_len, m.eos_token_id)
    # 7 prompts over 4 slots and decode buckets [1, 4]: prefill chunks of 64 and 16, full and
    # padded decode batches, and slots reused by queued prompts.
    for batch in (PROMPTS[:1], PROMPTS[:3], PROMPTS):
        requests = [Request(p, max_tokens=12) for p in batch]
        expected = [r.token_ids for r in reference.generate(requests)]
        assert [r.token_ids for r in compiled.generate(requests)] == expected


def test_no_weights_inside_region_artifacts(tiny_bundle):
    bundle = tiny_bundle("inductor")
    weights = (bundle / "weights" / "rank-0.safetensors").stat().st_size
    experts = 2 * 8 * 3 * 32 * 64 * 4  # the two MoE layers' routed experts in float32
    assert weights > experts
    # A MoE region is used by two layers; were weights baked in, it would carry a layer's experts.
    executor = BundleExecutor(bundle)
    moe_fp = executor.manifest.programs["decode/4"].steps[2].region
    assert moe_fp == executor.manifest.programs["decode/4"].steps[3].region
