"""A bfloat16 bundle compiled for a CPU without native bf16 math (AVX2: the compile is held to it
with ATEN_CPU_CAPABILITY) stores bf16 and computes its matrix products in float32; its greedy
tokens are transformers' in bf16 on the same weights (bf16's coarse logits allow a near-tie)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from deepinfer.runtime.engine import Engine, Request
from deepinfer.runtime.executor import BundleExecutor
from tests.conftest import write_recipe
from tests.models.hf_tiny import hf_greedy, tiny_hf_checkpoint

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 17, 42, 99, 7], list(range(10, 40))]
MAX_TOKENS = 8
NEAR_TIE = 0.125  # bf16 logits of magnitude ~8-16 are 1/16-1/8 apart


def first_divergence_is_a_near_tie(hf, prompt, ours, theirs) -> bool:
    i = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + theirs[:i]])).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1]) <= NEAR_TIE and ours[i] in logits.topk(2).indices.tolist()


def test_bf16_bundle_on_an_avx2_host_matches_transformers_bf16(tmp_path):
    hf, directory = tiny_hf_checkpoint(tmp_path / "hf", seed=3)
    hf = hf.to(torch.bfloat16)
    hf.save_pretrained(directory)  # the checkpoint in bf16: both sides read the same bf16 values
    recipe = write_recipe(tmp_path, "tiny-bf16", model={"checkpoint": str(directory), "config": None}, dtype="bfloat16",
                          methods={"decode": {"buckets": [1]}, "prefill": {"buckets": [16]}},
                          regions={"split_layers": False, "boundaries": []})
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run([sys.executable, "-m", "deepinfer.compiler.cli", str(recipe), "--cache-dir", str(tmp_path / "cache")],
                         env=env, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr
    assert "bfloat16 stored, matrix products computed in float32 (inductor ISA avx2" in out.stdout, out.stdout
    bundle = tmp_path / "bundles" / "tiny-bf16"
    toolchain = json.loads((bundle / "manifest.json").read_text())["toolchain"]
    assert toolchain["inductor_isa"] == "avx2" and toolchain["inductor_bf16_products"] == "float32"

    engine = Engine.for_bundle(BundleExecutor(bundle))
    ours = [r.token_ids for r in engine.generate([Request(p, max_tokens=MAX_TOKENS, ignore_eos=True) for p in PROMPTS])]
    for prompt, tokens in zip(PROMPTS, ours):
        theirs = hf_greedy(hf, prompt, MAX_TOKENS)
        assert tokens == theirs or first_divergence_is_a_near_tie(hf, prompt, tokens, theirs), (prompt, tokens, theirs)
