"""Session fixtures: compiled tiny bundles shared by every test (AOTInductor costs ~15 s a region)."""

import copy
import os
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
TINY_RECIPE = ROOT / "recipes" / "tiny.yaml"
TINY_V4_RECIPE = ROOT / "recipes" / "tiny-v4.yaml"
# The session's AOTInductor bundle of the tiny recipe keeps one bucket a method: each bucket is 4
# more AOTInductor compiles (~15 s each here); the export bundle keeps the recipe's two.
INDUCTOR_METHODS = {"decode": {"buckets": [4]}, "prefill": {"buckets": [16]}}


def write_recipe(directory: Path, name: str = "tiny", **changes) -> Path:
    """recipes/tiny.yaml with top-level keys replaced (nested dicts merged one level deep)."""
    recipe = copy.deepcopy(yaml.safe_load(TINY_RECIPE.read_text()))
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(recipe.get(key), dict):
            recipe[key] = {**recipe[key], **value}
        else:
            recipe[key] = value
    recipe["name"] = name
    recipe["output"] = str(directory / "bundles" / name)
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def tiny_v4_config() -> dict:
    """The tiny V4 of recipes/tiny-v4.yaml with 2 Sinkhorn iterations instead of 20: the same ops,
    18 fewer unrolled rounds of them in every traced and compiled layer (tests pay for each)."""
    return {**yaml.safe_load(TINY_V4_RECIPE.read_text())["model"]["config"], "hc_sinkhorn_iters": 2}


def compile_tiny_v4(directory, **changes):
    """recipes/tiny-v4.yaml (tiny_v4_config) with one bucket a method (prefill 16, decode 4: chunked
    prompts, padded decode batches) and `changes`; V4 traces slower than V3, so tests keep to these
    two programs."""
    from deepinfer.compiler.build import compile_recipe
    from deepinfer.compiler.recipe import load_recipe

    recipe = yaml.safe_load(TINY_V4_RECIPE.read_text())
    recipe["model"]["config"] = tiny_v4_config()
    recipe.update({"methods": {"decode": {"buckets": [4]}, "prefill": {"buckets": [16]}}, "output": str(directory / "bundle"), **changes})
    (directory / "v4.yaml").write_text(yaml.safe_dump(recipe))
    return compile_recipe(load_recipe(directory / "v4.yaml"), cache_dir=directory / "cache", progress=False).bundle


def pjrt_recipe(directory: Path, name: str, overflow: str) -> Path:
    """The tiny recipe through the pjrt backend (jaxlib's CPU client), prefill chunks of 64 (the
    grouped MoE form, with its overflow passes as `overflow` says) and decode batches of 4."""
    return write_recipe(directory, name, model={"expert_overflow": overflow}, backend={"name": "pjrt", "options": {}},
                        methods={"decode": {"buckets": [4]}, "prefill": {"buckets": [64]}})


@pytest.fixture(scope="session")
def pjrt_bundle(tmp_path_factory, cache_dir):
    """The tiny recipe's pjrt bundle (pjrt_recipe, overflow passes always run), once a session."""
    pytest.importorskip("torch_mlir")
    pytest.importorskip("jax")
    from deepinfer.compiler.build import compile_recipe
    from deepinfer.compiler.recipe import load_recipe

    work = tmp_path_factory.mktemp("pjrt")
    return compile_recipe(load_recipe(pjrt_recipe(work, "tiny-pjrt", "always")), cache_dir=cache_dir, progress=False).bundle


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """The session's compile cache; under pytest-xdist one for all its test processes (the parent
    of their temp dirs is this run's), so a region one of them compiled is a hit for the other."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return tmp_path_factory.getbasetemp().parent / "compile-cache"
    return tmp_path_factory.mktemp("compile-cache")


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory, cache_dir):
    """tiny_bundle(backend, recipe=TINY_RECIPE) -> directory of that recipe compiled with that backend
    (once a session; the tiny recipe with INDUCTOR_METHODS for inductor)."""
    from deepinfer.compiler.build import compile_recipe
    from deepinfer.compiler.recipe import load_recipe

    bundles = {}

    def get(backend: str, recipe: Path = TINY_RECIPE) -> Path:
        if (backend, recipe) not in bundles:
            work = tmp_path_factory.mktemp("bundles")
            out = work / f"{recipe.stem}-{backend}"
            source = write_recipe(work, methods=INDUCTOR_METHODS) if (backend, recipe) == ("inductor", TINY_RECIPE) else recipe
            compile_recipe(load_recipe(source, backend=backend, output=out), cache_dir=cache_dir, progress=False)
            bundles[backend, recipe] = out
        return bundles[backend, recipe]

    return get
