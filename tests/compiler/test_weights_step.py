"""Compile without weights, then the weights step: the trained tiny V3 over two ranks (export).
The completed bundle is the one-step compile's, byte for byte in its weights and token for token;
an interrupted step resumes without redoing a finished file; a wrong checkpoint changes nothing."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from deepinfer.compiler import add_weights as step
from deepinfer.compiler.add_weights import WeightsStepError, add_weights, parse_ranks
from deepinfer.compiler.build import compile_recipe
from deepinfer.compiler.recipe import load_recipe
from deepinfer.models.checkpoint import CheckpointError
from deepinfer.runtime.errors import BundleError
from deepinfer.runtime.manifest import read_manifest
from deepinfer.runtime.versions import toolchain_versions
from tests.conftest import ROOT

CHECKPOINT = ROOT / "checkpoints" / "tiny-v3-code"
CLI = [sys.executable, "-m", "deepinfer.compiler.cli"]


def recipe(directory, name):
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "name": name, "model": {"checkpoint": str(CHECKPOINT)}, "dtype": "float32",
        "parallel": {"world_size": 2, "tp": 2, "ep": 2}, "methods": {"decode": {"buckets": [2]}, "prefill": {"buckets": [16]}},
        "kv": {"max_seqs": 2, "max_len": 64}, "backend": {"name": "export"}, "output": str(directory / name)}))
    return load_recipe(path)


@pytest.fixture(scope="module")
def bundles(tmp_path_factory, cache_dir):
    """(the one-step compile, a --no-weights compile of the same recipe) as directories to copy."""
    work = tmp_path_factory.mktemp("weights-step")
    whole = compile_recipe(recipe(work, "whole"), cache_dir=cache_dir, progress=False).bundle
    shapes = compile_recipe(recipe(work, "shapes"), cache_dir=cache_dir, progress=False, weights=False).bundle
    return whole, shapes


def copy(bundle, tmp_path):
    shutil.copytree(bundle, tmp_path / "bundle")
    return tmp_path / "bundle"


def run(bundle, *args):
    return subprocess.run([sys.executable, "-m", "deepinfer.runtime.cli", "--bundle", str(bundle), "--prompt", "def add(a, b):",
                           "--max-tokens", "6", "--json", *args], capture_output=True, text=True, timeout=600)


def test_a_bundle_without_weights_is_refused_naming_the_step(bundles):
    _, shapes = bundles
    assert not list((shapes / "weights").iterdir())
    manifest = json.loads((shapes / "manifest.json").read_text())
    assert manifest["weight_specs"] and not any(f.startswith("weights/") for f in manifest["files"])
    done = run(shapes)
    assert done.returncode == 1
    assert "rank 0's weights are not in this bundle yet" in done.stderr and f"deepinfer-compile weights {shapes}" in done.stderr


def test_the_weights_step_completes_it_into_the_one_step_compiles_bundle(bundles, tmp_path):
    whole, shapes = bundles
    bundle = copy(shapes, tmp_path)
    done = subprocess.run([*CLI, "weights", str(bundle), "--checkpoint", str(CHECKPOINT)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        name = f"weights/rank-{rank}.safetensors"
        assert (bundle / name).read_bytes() == (whole / name).read_bytes()
    assert json.loads(run(bundle).stdout)["results"][0]["token_ids"] == json.loads(run(whole).stdout)["results"][0]["token_ids"]


def test_an_interrupted_step_resumes_and_keeps_what_it_finished(bundles, tmp_path, monkeypatch):
    _, shapes = bundles
    bundle = copy(shapes, tmp_path)
    real = step.write_rank_file

    def interrupted_at_rank_1(path, rank, *args):
        if rank == 1:
            path.write_bytes(b"half a file")
            raise KeyboardInterrupt
        return real(path, rank, *args)

    monkeypatch.setattr(step, "write_rank_file", interrupted_at_rank_1)
    with pytest.raises(KeyboardInterrupt):
        add_weights(bundle, CHECKPOINT, progress=False)
    manifest = read_manifest(bundle, toolchain_versions(), rank=0)  # rank 0 is recorded and runs...
    with pytest.raises(BundleError, match="rank 1's weights are not in this bundle yet"):  # ...rank 1 is not
        read_manifest(bundle, toolchain_versions(), rank=1)
    finished = os.stat(bundle / manifest.weight_files[0])
    monkeypatch.setattr(step, "write_rank_file", real)
    assert add_weights(bundle, CHECKPOINT, progress=False) == [1]
    assert os.stat(bundle / manifest.weight_files[0]).st_ino == finished.st_ino  # not written again
    read_manifest(bundle, toolchain_versions())
    assert not (bundle / "weights" / "rank-1.safetensors.partial").exists()
    # A damaged file is written again; whole ones are kept.
    (bundle / "weights" / "rank-0.safetensors").write_bytes(b"x")
    assert add_weights(bundle, CHECKPOINT, progress=False) == [0]
    assert add_weights(bundle, CHECKPOINT, progress=False) == []


def test_each_host_writes_its_own_ranks(bundles, tmp_path):
    _, shapes = bundles
    bundle = copy(shapes, tmp_path)
    assert add_weights(bundle, CHECKPOINT, ranks=[1], progress=False) == [1]
    read_manifest(bundle, toolchain_versions(), rank=1)
    done = run(bundle)  # spawned followers run from this host's bundle: all of it must be there
    assert done.returncode == 1 and "rank 0's weights are not in this bundle yet" in done.stderr
    with pytest.raises(WeightsStepError, match="ranks 0-1"):
        add_weights(bundle, CHECKPOINT, ranks=[2], progress=False)
    assert parse_ranks("0-7") == list(range(8)) and parse_ranks("3") == [3]
    with pytest.raises(WeightsStepError):
        parse_ranks("7-0")


def wrong_checkpoint(tmp_path, edit):
    """A copy of the trained checkpoint with `edit(tensors)` applied."""
    directory = tmp_path / "checkpoint"
    shutil.copytree(CHECKPOINT, directory)
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors")
    return directory


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.layers.1.mlp.gate.weight"), "model.layers.1.mlp.gate.weight' is missing"),
    (lambda t: t.update({"model.layers.0.self_attn.o_proj.weight": torch.zeros(3, 3)}), "'model.layers.0.self_attn.o_proj.weight' has shape"),
])
def test_a_wrong_checkpoint_exits_2_naming_the_tensor_and_changes_nothing(bundles, tmp_path, edit, message):
    _, shapes = bundles
    bundle = copy(shapes, tmp_path)
    before = {p: p.read_bytes() for p in bundle.rglob("*") if p.is_file()}
    done = subprocess.run([*CLI, "weights", str(bundle), "--checkpoint", str(wrong_checkpoint(tmp_path, edit))],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert {p: p.read_bytes() for p in bundle.rglob("*") if p.is_file()} == before


def test_another_models_checkpoint_or_a_signed_bundle_without_the_key_is_refused(bundles, tmp_path):
    _, shapes = bundles
    bundle = copy(shapes, tmp_path)
    other = tmp_path / "other"
    shutil.copytree(CHECKPOINT, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": config["moe_intermediate_size"] * 2}))
    with pytest.raises(CheckpointError, match="moe_intermediate_size: .* in the bundle"):
        add_weights(bundle, other, progress=False)
    (bundle / "manifest.json.hmac").write_text("0" * 64 + "\n")
    with pytest.raises(WeightsStepError, match="--sign-key"):
        add_weights(bundle, CHECKPOINT, progress=False)
    assert not list((bundle / "weights").iterdir())


def test_a_random_weights_recipe_cannot_be_compiled_without_weights(tmp_path):
    from tests.conftest import write_recipe
    from deepinfer.compiler.recipe import RecipeError

    with pytest.raises(RecipeError, match="--no-weights"):
        compile_recipe(load_recipe(write_recipe(tmp_path, "random", backend={"name": "export"})), weights=False)
