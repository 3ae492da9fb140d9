"""The pjrt backend: regions lowered to StableHLO by torch-mlir and compiled by jaxlib's PJRT CPU
client give the export bundle's greedy tokens; what does not lower is refused at compile time,
naming the op and its module; an executable for another plugin version is refused at load, or
compiled again from the bundle's StableHLO when asked."""

import json
import shutil

import pytest
from safetensors.numpy import load_file, save_file

from deepinfer.compiler.build import compile_recipe
from deepinfer.compiler.recipe import load_recipe
from deepinfer.runtime.engine import Engine, Request
from deepinfer.runtime.errors import BundleError, DeepinferError
from deepinfer.runtime.executor import BundleExecutor
from tests.conftest import write_recipe
from tests.runtime.test_bundle_trust import edit_manifest

pytest.importorskip("torch_mlir")
pytest.importorskip("jax")

# Prefill chunks of 64 take the grouped MoE form (with its overflow passes); decode batches of 4.
METHODS = {"decode": {"buckets": [4]}, "prefill": {"buckets": [64]}}
PROMPTS = [[5, 6, 7], list(range(20, 56))]


def tokens(bundle):
    engine = Engine.for_bundle(BundleExecutor(bundle))
    return [r.token_ids for r in engine.generate([Request(p, 8) for p in PROMPTS])]


def pjrt_recipe(tmp_path, name, overflow):
    return write_recipe(tmp_path, name, model={"expert_overflow": overflow}, methods=METHODS,
                        backend={"name": "pjrt", "options": {}})


@pytest.fixture(scope="module")
def pjrt_bundle(tmp_path_factory, cache_dir):
    work = tmp_path_factory.mktemp("pjrt")
    return compile_recipe(load_recipe(pjrt_recipe(work, "tiny-pjrt", "always")), cache_dir=cache_dir, progress=False).bundle


def test_pjrt_regions_give_the_export_bundles_tokens(pjrt_bundle, tiny_bundle):
    assert tokens(pjrt_bundle) == tokens(tiny_bundle("export"))  # (its overflow passes branch: the same sums)
    manifest = json.loads((pjrt_bundle / "manifest.json").read_text())
    assert {r["backend"] for r in manifest["regions"].values()} == {"pjrt"}
    assert {"torch-mlir", "jaxlib"} <= set(manifest["toolchain"])


def test_a_region_that_does_not_lower_is_refused_at_compile_naming_the_op(tmp_path, cache_dir):
    with pytest.raises(DeepinferError) as failure:
        compile_recipe(load_recipe(pjrt_recipe(tmp_path, "tiny-cond", "branch")), cache_dir=cache_dir, progress=False)
    report = str(failure.value)
    assert "LoweringError: torch.cond does not lower to StableHLO" in report, report
    assert "model.expert_overflow: always" in report, report
    assert not (tmp_path / "bundles" / "tiny-cond").exists()


def test_an_executable_for_another_plugin_version_is_refused_or_recompiled(pjrt_bundle, tmp_path, monkeypatch):
    bundle = tmp_path / "bundle"
    shutil.copytree(pjrt_bundle, bundle)
    for region in (bundle / "regions").iterdir():
        from safetensors import safe_open

        with safe_open(str(region), "np") as f:
            metadata = {**f.metadata(), "platform_version": "cpu 0.0-elsewhere"}
        save_file(load_file(str(region)), str(region), metadata=metadata)
    edit_manifest(bundle, lambda body: None)
    with pytest.raises(BundleError, match="compiled for PJRT platform 'cpu' version 'cpu 0.0-elsewhere'.*"
                                          "DEEPINFER_PJRT_RECOMPILE=1"):
        BundleExecutor(bundle)
    monkeypatch.setenv("DEEPINFER_PJRT_RECOMPILE", "1")
    assert tokens(bundle) == tokens(pjrt_bundle)


def test_deepseek_v4_through_pjrt_gives_the_eager_models_tokens(tmp_path):
    """V4's state (sliding window ring, compressed entries, indexer) through StableHLO: its ring
    positions are Python modulo of negative numbers, which torch-mlir lowers to C's remainder
    (the backend rewrites it)."""
    from tests.conftest import compile_tiny_v4
    from tests.runtime.test_executor import same_tokens_as_eager

    same_tokens_as_eager(compile_tiny_v4(tmp_path, model={**_v4_model(), "expert_overflow": "always"}, backend={"name": "pjrt"}))


def _v4_model() -> dict:
    import yaml

    from tests.conftest import TINY_V4_RECIPE, tiny_v4_config

    return {**yaml.safe_load(TINY_V4_RECIPE.read_text())["model"], "config": tiny_v4_config()}
