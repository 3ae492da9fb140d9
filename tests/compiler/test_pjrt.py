"""The pjrt backend: regions lowered to StableHLO by torch-mlir and compiled by jaxlib's PJRT CPU
client give the export bundle's greedy tokens; what does not lower is refused at compile time,
naming the op and its module; an executable for another plugin version is refused at load, or
compiled again from the bundle's StableHLO when asked. (DeepSeek-V4 through pjrt, its fp4 experts
and world size 2: tests/models/test_fp4_checkpoint.py; kept fp8 at world size 2:
tests/models/test_fp8_checkpoint.py.)"""

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


def relabelled(pjrt_bundle, directory, **metadata):
    """A copy of the bundle whose region files say `metadata` (re-signed in the manifest)."""
    from safetensors import safe_open

    bundle = directory / "bundle"
    shutil.rmtree(bundle, ignore_errors=True)
    shutil.copytree(pjrt_bundle, bundle)
    for region in (bundle / "regions").iterdir():
        with safe_open(str(region), "np") as f:
            changed = {**f.metadata(), **metadata}
        save_file(load_file(str(region)), str(region), metadata=changed)
    edit_manifest(bundle, lambda body: None)
    return bundle


def test_an_executable_for_another_plugin_is_refused_or_recompiled(pjrt_bundle, tmp_path, monkeypatch):
    bundle = relabelled(pjrt_bundle, tmp_path, platform_version="cpu 0.0-elsewhere")
    with pytest.raises(BundleError, match="compiled for PJRT platform 'cpu' version 'cpu 0.0-elsewhere'.*"
                                          "DEEPINFER_PJRT_RECOMPILE=1"):
        BundleExecutor(bundle)
    monkeypatch.setenv("DEEPINFER_PJRT_RECOMPILE", "1")
    assert tokens(bundle) == tokens(pjrt_bundle)
    # A Trainium bundle on a host without Neuron's plugin: refused, naming what to install.
    with pytest.raises(BundleError, match="no PJRT plugin for platform 'neuron' on this host.*libneuronxla"):
        BundleExecutor(relabelled(pjrt_bundle, tmp_path, platform="neuron"))


def test_a_platform_without_dlpack_copies_and_gives_the_same_tokens(pjrt_bundle, monkeypatch):
    """Neuron's plugin has no DLPack: tensors go by host-to-device copies (weights once, kept) and
    outputs come back by copies; bf16 and fp8, which numpy lacks, as ml_dtypes. Forced here on the
    CPU client."""
    import jax
    import torch

    from deepinfer.runtime.backends import pjrt

    by_dlpack = tokens(pjrt_bundle)
    monkeypatch.setattr(pjrt, "DLPACK_PLATFORMS", ())
    assert tokens(pjrt_bundle) == by_dlpack
    # Copies are kept while their tensor lives and is unchanged, and go with it (a step's inputs).
    to_device = pjrt._Arguments(jax.devices("cpu")[0])
    weight = torch.randn(4, 4)
    kept = to_device(weight)
    assert to_device(weight) is kept and to_device(weight.add_(1)) is not kept
    for _ in range(10):
        to_device(torch.randn(3))
    assert len(to_device.copies) == 1
    for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.int64):
        tensor = torch.randn(3, 5).mul(100).to(dtype)[:, 1:]  # (not contiguous)
        assert torch.equal(pjrt._from_host(jax.device_put(pjrt._to_host(tensor))).view(torch.uint8), tensor.contiguous().view(torch.uint8))
