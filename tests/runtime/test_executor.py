"""Compiled bundles replay the eager model exactly: same greedy tokens, both backends, V3 and V4."""

import json

import pytest

from deepinfer.compiler.eager import eager_engine
from deepinfer.models import build_model
from deepinfer.runtime.engine import Engine, Request
from deepinfer.runtime.executor import BundleExecutor
from deepinfer.runtime.manifest import Manifest

from ..conftest import compile_tiny_v4

PROMPTS = [[5, 6, 7], list(range(20, 90)), [100] * 17, [9, 8], list(range(200, 230)), [40, 41, 42, 43, 44, 45], [77]]


def same_tokens_as_eager(bundle):
    executor = BundleExecutor(bundle)
    m = executor.manifest
    model = build_model(m.recipe["model"]["arch"], config=m.model_config, seed=m.recipe["model"]["seed"])
    reference = eager_engine(model, m.buckets["prefill"], m.buckets["decode"], m.kv.max_seqs, m.kv.max_len)
    compiled = Engine.for_bundle(executor)
    # 7 prompts over 4 slots and decode buckets [1, 4]: prefill chunks of 64 and 16, full and
    # padded decode batches, and slots reused by queued prompts.
    for batch in (PROMPTS[:1], PROMPTS[:3], PROMPTS):
        requests = [Request(p, max_tokens=12) for p in batch]
        expected = [r.token_ids for r in reference.generate(requests)]
        assert [r.token_ids for r in compiled.generate(requests)] == expected


@pytest.mark.parametrize("backend", ["export", "inductor"])
def test_compiled_tokens_equal_eager_tokens(tiny_bundle, backend):
    same_tokens_as_eager(tiny_bundle(backend))


def test_deepseek_v4_through_aotinductor_equals_eager(tmp_path):
    """AOTInductor compiles V4's math (mHC, compressors, indexer top-k, sinks) to the eager model's
    tokens. One whole-graph region per program keeps this to 2 AOTInductor compiles; V4 through
    the export backend, one region set per layer kind, is test_speculative's world-size-2 test."""
    same_tokens_as_eager(compile_tiny_v4(tmp_path, regions={"split_layers": False, "boundaries": []}))


def test_bundles_from_before_per_layer_state_still_run(tiny_bundle, tmp_path):
    """A V3 bundle written before the manifest listed per-layer state (`kv` alone, values named
    kv.<layer>) loads and replays the same tokens."""
    import shutil

    bundle = tmp_path / "legacy"
    shutil.copytree(tiny_bundle("export"), bundle)
    body = json.loads((bundle / "manifest.json").read_text())
    state = body.pop("state")
    body["kv"]["layers"], body["kv"]["shape"] = len(state), state[0][0]["shape"]
    for program in body["programs"].values():
        for step in program["steps"]:
            step["inputs"] = [n.removesuffix(".latent") if n.startswith("kv.") else n for n in step["inputs"]]
    (bundle / "manifest.json").write_text(Manifest.from_dict(body).to_json())
    assert BundleExecutor(bundle).manifest.state is None
    same_tokens_as_eager(bundle)


def test_no_weights_inside_region_artifacts(tiny_bundle):
    bundle = tiny_bundle("inductor")
    weights = (bundle / "weights" / "rank-0.safetensors").stat().st_size
    experts = 2 * 8 * 3 * 32 * 64 * 4  # the two MoE layers' routed experts in float32
    assert weights > experts
    # A MoE region is used by two layers; were weights baked in, it would carry a layer's experts.
    executor = BundleExecutor(bundle)
    moe_fp = executor.manifest.programs["decode/4"].steps[2].region
    assert moe_fp == executor.manifest.programs["decode/4"].steps[3].region
