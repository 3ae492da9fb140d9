"""Session fixtures: compiled tiny bundles shared by every test (AOTInductor costs ~15 s a region)."""

import copy
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
TINY_RECIPE = ROOT / "recipes" / "tiny.yaml"


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


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("compile-cache")


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory, cache_dir):
    """tiny_bundle(backend) -> directory of the tiny recipe compiled with that backend (once a session)."""
    from deepinfer.compiler.build import compile_recipe
    from deepinfer.compiler.recipe import load_recipe

    bundles = {}

    def get(backend: str) -> Path:
        if backend not in bundles:
            out = tmp_path_factory.mktemp("bundles") / f"tiny-{backend}"
            compile_recipe(load_recipe(TINY_RECIPE, backend=backend, output=out), cache_dir=cache_dir, progress=False)
            bundles[backend] = out
        return bundles[backend]

    return get
