"""Context buckets: each step runs the program for the smallest context that holds its longest
sequence, and gives the tokens of the whole-pool model (eager) and of transformers; the regions
that read no state (MLP, MoE, embedding, head) compile once for every context. DeepSeek-V4's
compressed entries under context buckets, over 2 ranks: test_speculative's V4 world-size-2 test."""

import json

import pytest

from deepinfer.compiler.build import compile_recipe
from deepinfer.compiler.eager import eager_engine
from deepinfer.compiler.recipe import load_recipe
from deepinfer.models import build_model
from deepinfer.runtime.engine import Engine, Request
from deepinfer.runtime.executor import BundleExecutor
from tests.conftest import write_recipe
from tests.models.hf_tiny import hf_greedy, tiny_hf_checkpoint

transformers = pytest.importorskip("transformers")

# Lengths chosen so generation crosses context edges (17 + 12 > 16 tokens, 30 + 12 > 32, 70 + 12 > 64)
# and decode batches mix sequences of different context buckets.
PROMPTS = [[5, 6, 7], list(range(20, 90)), [100] * 17, [9, 8], list(range(200, 230)), [40, 41, 42, 43, 44, 45], [77]]
MAX_TOKENS = 12
METHODS = {"decode": {"buckets": [1, 4], "context": [16, 32, 64]}, "prefill": {"buckets": [16, 64], "context": [32]}}


class RecordingExecutor:
    """A bundle executor that remembers each step's program and positions."""

    def __init__(self, executor):
        self.inner, self.manifest, self.steps = executor, executor.manifest, []

    def run(self, step):
        self.steps.append((step.method, step.context, step.positions.tolist()))
        return self.inner.run(step)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_hf_checkpoint(tmp_path_factory.mktemp("hf-tiny"), seed=5)


@pytest.fixture(scope="module")
def bundle(checkpoint, tmp_path_factory, cache_dir):
    work = tmp_path_factory.mktemp("contexts")
    # The grouped experts' form at expert_capacity 0.25: 4 places per expert in the first grouped pass
    # of a 64-token chunk (an even share is 16), so prompts take the extra passes, and must still
    # give the reference tokens.
    recipe = write_recipe(work, "tiny-contexts", model={"checkpoint": str(checkpoint[1]), "config": None,
                                                        "expert_overflow": "branch", "expert_capacity": 0.25},
                          backend={"name": "export"}, methods=METHODS)
    return compile_recipe(load_recipe(recipe), cache_dir=cache_dir, progress=False).bundle


def test_tokens_equal_eager_and_transformers_across_context_edges(bundle, checkpoint):
    hf, directory = checkpoint
    recorder = RecordingExecutor(BundleExecutor(bundle))
    compiled = Engine.for_bundle(recorder)
    assert compiled.contexts == {"decode": [16, 32, 64, 256], "prefill": [32, 256]}  # kv.max_len joins both
    requests = [Request(p, max_tokens=MAX_TOKENS, ignore_eos=True) for p in PROMPTS]
    tokens = [r.token_ids for r in compiled.generate(requests)]

    eager = eager_engine(build_model("deepseek_v3", checkpoint=directory), (16, 64), (1, 4), 4, 256)  # whole pool
    assert tokens == [r.token_ids for r in eager.generate(requests)]
    assert tokens == [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]

    used = {(method, context) for method, context, _ in recorder.steps}
    assert used == {("decode", c) for c in (16, 32, 64, 256)} | {("prefill", 32), ("prefill", 256)}
    for method, context, positions in recorder.steps:  # the smallest context holding the step's positions
        smaller = [c for c in compiled.contexts[method] if c < context]
        assert max(positions) < context and (not smaller or max(positions) >= smaller[-1])
    def bucket(position):
        return next(c for c in compiled.contexts["decode"] if c > position)

    mixed = [p for method, _, p in recorder.steps if method == "decode" and len({bucket(q) for q in p if q > 0}) > 1]
    assert mixed, "no decode batch mixed rows of different context buckets"  # (position 0: a padding row)


def test_regions_without_state_compile_once_for_every_context(bundle):
    manifest = json.loads((bundle / "manifest.json").read_text())
    for bucket in METHODS["decode"]["buckets"]:
        per_context = [manifest["programs"][f"decode/{bucket}/{c}"]["steps"] for c in (16, 32, 64, 256)]
        stateless = [{s["region"] for s in steps if not any(n.startswith("kv.") for n in s["inputs"])} for steps in per_context]
        stateful = [{s["region"] for s in steps if any(n.startswith("kv.") for n in s["inputs"])} for steps in per_context]
        assert all(s == stateless[0] for s in stateless) and len(stateless[0]) >= 4  # embed, MLP, MoE, head
        assert sum(map(len, stateful)) == len(set().union(*stateful))  # attention: one set per context



@pytest.mark.parametrize("edit, message", [
    (lambda m: m["contexts"].update(decode=[16, 32]), r"contexts.decode \[16, 32\] must be increasing positive integers ending at kv.max_len=256"),
    (lambda m: m["contexts"].update(decode=[32, 16, 256]), r"contexts.decode .* must be increasing"),
    (lambda m: m["contexts"].update(verify=[256]), r"contexts \['decode', 'prefill', 'verify'\] names a method"),
    (lambda m: m["state"][0][0].update(positions_per_entry=2), r"state tensor latent holds 256 entries of 2 positions"),
    (lambda m: m["programs"].pop("decode/4/32"), r"no program for decode/4/32"),
    (lambda m: m["programs"]["decode/1/16"].update(context=32), r"program decode/1/16 is filed under the wrong key"),
])
def test_tampered_context_fields_are_refused(bundle, tmp_path, edit, message):
    import shutil

    from deepinfer.runtime.manifest import BundleError, _checksum

    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    body = json.loads((copy / "manifest.json").read_text())
    edit(body)
    body["checksum"] = _checksum(body)
    (copy / "manifest.json").write_text(json.dumps(body))
    with pytest.raises(BundleError, match=message):
        BundleExecutor(copy)
