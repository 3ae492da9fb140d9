"""`deepinfer-compile plan`: what a recipe asks of each rank, known before compiling, and the
layouts it refuses."""

import json
import subprocess
import sys

import pytest
from safetensors import safe_open

from deepinfer.compiler.build import compile_recipe
from deepinfer.compiler.recipe import RecipeError, load_recipe
from deepinfer.compiler.weights import PADDING
from deepinfer.runtime.manifest import read_manifest
from deepinfer.runtime.versions import toolchain_versions
from tests.conftest import ROOT, TINY_RECIPE, write_recipe


def plan_command(recipe, *flags) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepinfer.compiler.cli", "plan", str(recipe), *flags],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)  # (recipes name relative paths)


def test_plan_json_counts_what_the_compiled_bundle_holds(tiny_bundle):
    run = plan_command(TINY_RECIPE, "--json")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)  # one JSON object, nothing else on stdout
    bundle = tiny_bundle("export")
    manifest = read_manifest(bundle, toolchain_versions())
    assert sorted(row["program"] for row in report["programs"]) == sorted(manifest.programs)
    for row in report["programs"]:
        steps = manifest.programs[row["program"]].steps
        assert row["region_calls"] == len(steps) == 5  # embed, 3 layers, head
        assert row["unique_regions"] == len({s.region for s in steps}) == 4
    assert report["unique_regions"] == len(manifest.regions)
    (rank,) = report["ranks"]
    with safe_open(bundle / manifest.weight_files[0], "pt") as f:  # the bytes the bundle really stores
        assert rank["weight_bytes"] == sum(f.get_tensor(k).nbytes for k in f.keys() if not k.startswith(PADDING))
    # the latent cache: 3 layers x (4 slots + scratch) x 256 positions x (32 + 8) floats
    assert rank["state_bytes"] == 3 * 5 * 256 * 40 * 4 and rank["state_bytes_per_slot"] == 3 * 256 * 40 * 4
    assert rank["activation"].startswith("[") and "prefill/64" in rank["activation"]  # the longest chunk's
    assert report["fits"] is None and report["problem"] is None  # no device_memory_gib in the recipe


def test_plan_refuses_a_layout_that_does_not_fit_and_so_does_the_compile(tmp_path):
    recipe = write_recipe(tmp_path, "small-device", parallel={"device_memory_gib": 0.001})
    run = plan_command(recipe)
    assert run.returncode == 2, run.stderr
    assert "DOES NOT FIT" in run.stdout
    assert "parallel.device_memory_gib=0.001" in run.stderr and "weights" in run.stderr and "kv.max_seqs=4" in run.stderr
    with pytest.raises(RecipeError, match="device_memory_gib"):
        compile_recipe(load_recipe(recipe), cache_dir=tmp_path / "cache", progress=False)
    assert not (tmp_path / "bundles").exists()  # refused before anything was written
    fits = plan_command(write_recipe(tmp_path, "big-device", parallel={"device_memory_gib": 1}), "--json")
    assert fits.returncode == 0 and json.loads(fits.stdout)["fits"] is True


def test_plan_for_a_backend_not_installed_here(tmp_path):
    recipe = write_recipe(tmp_path, "for-trainium", backend={"name": "neuron", "options": {}})
    run = plan_command(recipe, "--json")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["backend"] == "neuron"
    with pytest.raises(RecipeError, match="not available here"):  # compiling it still needs the backend
        load_recipe(recipe)


def test_plan_of_full_size_deepseek_v3_over_64_ranks():
    """recipes/full-size/deepseek-v3-671b.yaml from its config.json alone (no weights here). By hand, a rank
    holds 4 of the 256 fp8 experts of 58 MoE layers (9.5 GiB + 0.3 GiB of scales), the bf16
    embedding (1.7 GiB), an eighth of attention's heads and of the dense MLPs (~2.7 GiB): ~14.4 GiB."""
    run = plan_command("recipes/full-size/deepseek-v3-671b.yaml", "--json")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert len(report["ranks"]) == 64 and report["fits"] is True
    assert 13.5 < report["ranks"][0]["weight_bytes"] / 2**30 < 15.5
    # the MLA latent cache, on every rank: 61 layers x 8192 positions x (512 + 64) bf16 a slot
    assert report["ranks"][0]["state_bytes_per_slot"] == 61 * 8192 * 576 * 2
