"""What a recipe compiles to, before any backend work: programs, schedules, unique regions."""

import json
import runpy
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import yaml

from deepinfer.compiler.backends import inductor
from deepinfer.compiler.plan import plan
from deepinfer.compiler.recipe import load_recipe
from deepinfer.models.deepseek_v4 import InputEmbedding
from tests.conftest import ROOT, TINY_RECIPE, tiny_v4_config, write_recipe

GOLDEN = Path(__file__).parent / "golden" / "tiny_regions.json"


def tiny_config(**changes) -> dict:
    return {**yaml.safe_load(TINY_RECIPE.read_text())["model"]["config"], **changes}


def summarize(the_plan) -> dict:
    return {
        "unique_regions": len(the_plan.regions),
        "programs": {key: [step.region for step in p.steps] for key, p in sorted(the_plan.programs.items())},
    }


def test_identical_layers_share_regions(tmp_path):
    """Dedup must not break on a per-layer constant: 8 layers compile exactly what 3 layers do."""
    three = plan(load_recipe(write_recipe(tmp_path, "three", model={"config": tiny_config(num_hidden_layers=3)})))
    eight = plan(load_recipe(write_recipe(tmp_path, "eight", model={"config": tiny_config(num_hidden_layers=8)})))
    assert set(eight.regions) == set(three.regions)
    assert len(eight.regions) == 4 * 4  # (embed, dense layer, MoE layer, head) x 4 programs
    decode = eight.programs["decode/4"]
    assert len(decode.steps) == 1 + 8 + 1
    moe_region = decode.steps[2].region
    assert all(step.region == moe_region for step in decode.steps[2:-1])
    # ...bound to each layer's own weights and KV cache.
    kv_inputs = [next(n for n in step.inputs if n.startswith("kv.")) for step in decode.steps[1:-1]]
    assert kv_inputs == [f"kv.{i}.latent" for i in range(8)]
    assert "layers.7.mlp.experts_gate_up" in decode.steps[8].inputs


def test_whole_graph_units_and_forced_boundaries(tmp_path):
    whole = plan(load_recipe(write_recipe(tmp_path, "whole", regions={"split_layers": False})))
    assert all(len(p.steps) == 1 for p in whole.programs.values()) and len(whole.regions) == 4
    split = plan(load_recipe(write_recipe(
        tmp_path, "split", regions={"boundaries": [{"op": "aten.sigmoid", "module": "layers.*.mlp.gate"}]})))
    # The router's sigmoid starts a new region, in MoE layers only.
    decode = split.programs["decode/4"].steps
    assert len(decode) == 1 + 1 + 2 * 2 + 1
    assert len(split.regions) == 4 * 5


def test_multi_rank_layer_is_two_regions_between_its_all_reduces(tmp_path):
    """At tp=2 a layer runs region, all-reduce, region, all-reduce: the residual add after each
    all-reduce is inside the next region, never a one-op region of its own."""
    sharded = plan(load_recipe(write_recipe(tmp_path, "tp2", parallel={"world_size": 2, "tp": 2, "ep": 2})))
    kinds = [s.collective["op"] if s.collective else "region" for s in sharded.programs["decode/1"].steps]
    embed, layers, head = kinds[:1], kinds[1:-2], kinds[-2:]
    assert embed == ["region"] and head == ["region", "all_gather"]
    assert layers == ["region", "all_reduce"] * 2 * 3


def golden_summary() -> dict:
    """The tiny recipe's plan with the compiling host's vector ISA pinned: fingerprints carry the
    inductor toolchain, and the golden file is the same on every host."""
    with mock.patch.object(inductor, "vector_isa", lambda: "avx2"):
        return summarize(plan(load_recipe(TINY_RECIPE)))


def test_golden_tiny_regions():
    """Pins what the tiny recipe compiles. When a change to the model or compiler is meant to change
    it, regenerate with `python -m tests.compiler.test_plan` and review the diff."""
    current = golden_summary()
    golden = json.loads(GOLDEN.read_text())
    assert current == golden, "region fingerprints changed; see this test's docstring"


def test_full_size_deepseek_v3_traces_on_fake_weights(tmp_path):
    """The real 671B config (hidden 7168, 61 layers, 256 experts) traces with no weights at all.
    Run in a fresh process so its peak memory is its own."""
    recipe = write_recipe(tmp_path, "v3_671b", model={"config": {}, "seed": 0}, dtype="bfloat16",
                          methods={"decode": {"buckets": [8]}, "prefill": {"buckets": [128]}},
                          kv={"max_seqs": 8, "max_len": 4096})
    script = ("import json, resource, time, sys\n"
              "from deepinfer.compiler.plan import plan\nfrom deepinfer.compiler.recipe import load_recipe\n"
              "t = time.perf_counter(); p = plan(load_recipe(sys.argv[1]))\n"
              "print(json.dumps({'seconds': time.perf_counter() - t, 'peak_rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,"
              " 'regions': len(p.regions), 'steps': {k: len(v.steps) for k, v in p.programs.items()}}))\n")
    run = subprocess.run([sys.executable, "-c", script, str(recipe)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.splitlines()[-1])
    print(f"671B trace at world size 1: {report}")
    assert report["steps"] == {"decode/8": 63, "prefill/128": 63}  # embed + 61 layers + head
    assert report["regions"] == 8
    assert report["peak_rss_mb"] < 4000  # no weights materialized (the bf16 weights alone are ~1.3 TB)


def test_full_size_deepseek_v4_flash_traces_on_fake_weights(tmp_path):
    """V4-Flash (43 layers, 256 experts, head_dim 512, 64K context) traces with no weights and no
    state allocated: 4 layer kinds x 2 programs, plus embed and head. bench/v4_full_size.py reports
    V4-Pro and the state and weight sizes."""
    bench = runpy.run_path(str(ROOT / "bench" / "v4_full_size.py"))
    MODELS, TRACE = bench["MODELS"], bench["TRACE"]

    recipe = {"name": "v4-flash", "model": {"arch": "deepseek_v4", "config": MODELS["flash"]}, "dtype": "bfloat16",
              "methods": {"decode": {"buckets": [8]}, "prefill": {"buckets": [128]}}, "kv": {"max_seqs": 8, "max_len": 65536},
              "backend": {"name": "export"}, "output": str(tmp_path / "out")}
    (tmp_path / "flash.yaml").write_text(yaml.safe_dump(recipe))
    run = subprocess.run([sys.executable, "-c", TRACE, str(tmp_path / "flash.yaml")], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.splitlines()[-1])
    print(f"V4-Flash trace: {report}")
    assert report["steps"] == {"decode/8": 45, "prefill/128": 45}  # embed + 43 layers + head
    assert report["unique_regions"] == 12
    assert report["peak_rss_mib"] < 4000  # 530 GiB of bf16 weights and 3.5 GiB of state were never made


if __name__ == "__main__":
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(golden_summary(), indent=1) + "\n")
    print(f"wrote {GOLDEN}")


def test_every_layer_of_a_kind_takes_the_same_dtypes(tmp_path, monkeypatch):
    """Found compiling V4-Flash in bf16 (bench/full_size_numerics.py): the embedding handed layer 0
    its mHC weights in bf16 where every later layer hands them on in float32, and layer 0's region,
    shared by its kind, was then called with float32 (a bundle that could not load). Two layers of
    one kind from layer 0 on share one region now; an argument that differs is refused at trace."""
    config = {**tiny_v4_config(), "layer_types": ["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                                                  "heavily_compressed_attention"]}
    recipe = write_recipe(tmp_path, "v4-bf16", model={"arch": "deepseek_v4", "config": config}, dtype="bfloat16",
                          methods={"decode": {"buckets": [2]}, "prefill": {"buckets": [16]}})
    decode = plan(load_recipe(recipe)).programs["decode/2"]
    assert decode.steps[1].region == decode.steps[2].region

    forward = InputEmbedding.forward
    monkeypatch.setattr(InputEmbedding, "forward", lambda self, *args: (lambda h, post, *rest: (h, post.to(h.dtype), *rest))(
        *forward(self, *args)))
    with pytest.raises(RuntimeError, match=r"layers\.1 .*argument 1 as \[16, 2\] float32 where an earlier layer of its kind got \[16, 2\] bfloat16"):
        plan(load_recipe(recipe))


def test_a_boundary_that_matches_no_node_is_refused(tmp_path):
    from deepinfer.compiler.recipe import RecipeError

    recipe = load_recipe(write_recipe(tmp_path, "typo", regions={"boundaries": [{"op": "aten.topk", "module": "layers.*.mlp.gat"}]}))
    with pytest.raises(RecipeError, match=r"regions.boundaries\[0\] .* matches no node"):
        plan(recipe)


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v4"])
def test_context_parallel_ranks_compute_only_their_rows(tmp_path, arch):
    """cp 2: a prefill chunk of 16 rows enters every layer as the rank's own 8 (its projections,
    attention queries, MLP); 16-row activations are only what a collective brought (the chunk's
    queries and keys and the attention partials gathered over the cp group, the MoE's input
    gathered and its output all-reduced: its experts are split over every rank). Decode rows are
    every rank's; a rank's cache holds every 2nd position (V4: every 2nd compressed entry)."""
    v4 = {"model": {"arch": arch, "config": tiny_v4_config()}} if arch == "deepseek_v4" else {}
    the_plan = plan(load_recipe(write_recipe(tmp_path, "cp2", parallel={"world_size": 2, "tp": 1, "ep": 2, "cp": 2},
                                             methods={"decode": {"buckets": [4]}, "prefill": {"buckets": [16]}}, **v4)))
    D, T = 64, 16
    if v4:  # [sliding window], [window, entries, buffer, index entries, index buffer] (CSA: rate 4), ...
        assert [t.shape for t in the_plan.state[1]] == [[5, 16, 32], [5, 256 // 4 // 2, 32], [5, 8, 128],
                                                        [5, 256 // 4 // 2, 16], [5, 8, 64]]
    else:
        assert [t.shape for t in the_plan.state[0]] == [[5, 128, 40]]  # 256 positions / 2; latent 32 + rope 8
    gathered = {name for s in the_plan.programs[f"prefill/{T}"].steps if s.collective for name in s.outputs}
    rows = {"own": set(), "gathered": set()}
    for step in the_plan.programs[f"prefill/{T}"].steps:
        if step.collective or not the_plan.region_paths[step.region].startswith("layers"):
            continue
        for name, spec in zip(step.inputs, the_plan.signatures[step.region].inputs):
            if is_activation(name) and spec.shape[-1] == D:  # [rows, D], V4's streams [rows, n, D]
                rows["gathered" if name in gathered else "own"].add(spec.shape[0])
    assert rows == {"own": {T // 2}, "gathered": {T}}
    decode_rows = {spec.shape[0] for s in the_plan.programs["decode/4"].steps if not s.collective
                   for name, spec in zip(s.inputs, the_plan.signatures[s.region].inputs) if is_activation(name) and spec.shape[-1] == D}
    assert decode_rows == {4}


def is_activation(name: str) -> bool:
    """A value a step computed (`layers.3:0`, `layers.3#2.0`), not an input, state or weight."""
    return ":" in name or "#" in name
