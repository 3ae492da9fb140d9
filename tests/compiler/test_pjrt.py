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
from tests.conftest import pjrt_recipe
from tests.runtime.test_bundle_trust import edit_manifest

pytest.importorskip("torch_mlir")
pytest.importorskip("jax")

PROMPTS = [[5, 6, 7], list(range(20, 56))]


def tokens(bundle):
    engine = Engine.for_bundle(BundleExecutor(bundle))
    return [r.token_ids for r in engine.generate([Request(p, 8) for p in PROMPTS])]


def test_pjrt_regions_give_the_export_bundles_tokens(pjrt_bundle, tiny_bundle):
    assert tokens(pjrt_bundle) == tokens(tiny_bundle("export"))  # (its prompt experts take the exact form: the same sums)
    manifest = json.loads((pjrt_bundle / "manifest.json").read_text())
    assert {r["backend"] for r in manifest["regions"].values()} == {"pjrt"}
    assert {"torch-mlir", "jaxlib"} <= set(manifest["toolchain"])


@pytest.mark.parametrize("overflow, refusal", [("branch", "LoweringError: torch.cond does not lower to StableHLO"),
                                               ("exact", "LoweringError: deepinfer.grouped_matmul.default is a host-side op")])
def test_a_region_that_does_not_lower_is_refused_at_compile_naming_the_op(tmp_path, cache_dir, overflow, refusal):
    with pytest.raises(DeepinferError) as failure:
        compile_recipe(load_recipe(pjrt_recipe(tmp_path, "tiny-" + overflow, overflow)), cache_dir=cache_dir, progress=False)
    report = str(failure.value)
    assert refusal in report, report
    assert "model.expert_overflow: always" in report, report
    assert not (tmp_path / "bundles" / ("tiny-" + overflow)).exists()


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


def test_state_is_updated_in_place_in_pjrt_buffers(pjrt_bundle):
    """Each state tensor lives in one PJRT buffer that XLA updates in place: the buffer a call
    donates is the one it returns (same memory), and the torch pool is not copied into."""
    import torch

    from deepinfer.runtime.backends import pjrt

    executor = BundleExecutor(pjrt_bundle)
    engine = Engine.for_bundle(executor)
    engine.generate([Request(PROMPTS[0], 4)])
    before = {name: pjrt._RESIDENT[id(t)] for name, t in executor.state.items()}
    assert len(before) == len(executor.state) > 0
    pointers = {name: a.unsafe_buffer_pointer() for name, a in before.items()}
    engine.generate([Request(PROMPTS[1], 4)])
    after = {name: pjrt._RESIDENT[id(t)] for name, t in executor.state.items()}
    assert all(before[name].is_deleted() and after[name] is not before[name] for name in before)  # donated
    assert {name: a.unsafe_buffer_pointer() for name, a in after.items()} == pointers
    assert all(not t.any() for t in executor.state.values())  # (torch's pool: only the initial value)
    # A context bucket's program binds a narrowed view of the pool: the resident value is written
    # back to the pool first, and the view takes the copy path.
    to_pjrt = pjrt._Arguments(None, torch.from_dlpack)
    pool = torch.zeros(3, 8, 2)
    to_pjrt.updated(pool, to_pjrt(torch.ones(3, 8, 2)))
    assert to_pjrt(pool) is pjrt._RESIDENT[id(pool)] and not pool.any()
    view = pool.narrow(1, 0, 4)
    to_pjrt(view)
    assert id(pool) not in pjrt._RESIDENT and pool.eq(1).all()
    to_pjrt.updated(view, to_pjrt(torch.full((3, 4, 2), 2.0)))
    assert pool[:, :4].eq(2).all() and pool[:, 4:].eq(1).all()


def test_a_prefix_copied_between_slots_reaches_the_pjrt_buffers(pjrt_bundle):
    """Prefix caching copies a running sequence's state into another slot outside any region: the
    resident buffers' values go back to the torch pool first, and the next call takes it again."""
    from deepinfer.runtime.backends import pjrt

    engine = Engine.for_bundle(BundleExecutor(pjrt_bundle))
    results = engine.generate([Request(PROMPTS[1], 8)] * 2)
    assert engine.prefix_copies == 1 and results[1].cached_tokens == len(PROMPTS[1]) - 1
    assert results[0].token_ids == results[1].token_ids == tokens(pjrt_bundle)[1]
    assert all(id(t) in pjrt._RESIDENT for t in engine.executor.state.values())  # (resident again)


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
    to_device = pjrt._Arguments(jax.devices("cpu")[0], pjrt._from_host)
    weight = torch.randn(4, 4)
    kept = to_device(weight)
    assert to_device(weight) is kept and to_device(weight.add_(1)) is not kept
    for _ in range(10):
        to_device(torch.randn(3))
    assert len(to_device.copies) == 1
    for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.int64):
        tensor = torch.randn(3, 5).mul(100).to(dtype)[:, 1:]  # (not contiguous)
        assert torch.equal(pjrt._from_host(jax.device_put(pjrt._to_host(tensor))).view(torch.uint8), tensor.contiguous().view(torch.uint8))


def test_a_region_file_of_another_region_is_refused_at_load(pjrt_bundle, tmp_path):
    """Two regions' files swapped (each re-checksummed in the manifest): the executable's own
    parameters are not the manifest's specs, so the bundle is refused at load, naming the file --
    not at its first step, where a server would fail every request in flight."""
    bundle = tmp_path / "bundle"
    shutil.copytree(pjrt_bundle, bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    first, second = sorted((r["file"] for r in manifest["regions"].values()), key=lambda f: (bundle / f).stat().st_size)[-2:]
    data = (bundle / first).read_bytes()
    (bundle / first).write_bytes((bundle / second).read_bytes())
    (bundle / second).write_bytes(data)
    edit_manifest(bundle, lambda body: None)
    with pytest.raises(BundleError, match=r"regions/\w+\.pjrt: the compiled program's inputs number \d+, but the manifest's "
                                          r"region has \d+ .*recompile the bundle"):
        BundleExecutor(bundle)


def test_the_jaxlib_a_bundle_was_compiled_with_is_checked(pjrt_bundle, tmp_path, monkeypatch):
    """The CPU client's platform_version is "cpu" whatever the jaxlib: the toolchain's jaxlib and
    the one each executable records must be this host's, or the StableHLO is compiled here."""
    bundle = tmp_path / "bundle"
    shutil.copytree(pjrt_bundle, bundle)
    edit_manifest(bundle, lambda body: body["toolchain"].update(jaxlib="0.0.1"))
    with pytest.raises(BundleError, match=r"compiled with jaxlib 0.0.1 \(toolchain.jaxlib\), and this host has jaxlib "):
        BundleExecutor(bundle)
    monkeypatch.setenv("DEEPINFER_PJRT_RECOMPILE", "1")
    assert tokens(bundle) == tokens(pjrt_bundle)
    monkeypatch.delenv("DEEPINFER_PJRT_RECOMPILE")
    with pytest.raises(BundleError, match=r"version 'cpu \(jaxlib 0.0.1\)', but this host's plugin is 'cpu \(jaxlib "):
        BundleExecutor(relabelled(pjrt_bundle, tmp_path, platform_version="cpu (jaxlib 0.0.1)"))


@pytest.mark.parametrize("metadata, message", [({"platform": ""}, "platform '' is not a PJRT platform name"),
                                               ({"mutated_inputs": "[0, 0]"}, r"mutated_inputs \[0, 0\] does not fit")])
def test_pjrt_metadata_out_of_range_is_refused(pjrt_bundle, tmp_path, metadata, message):
    with pytest.raises(BundleError, match=message):
        BundleExecutor(relabelled(pjrt_bundle, tmp_path, **metadata))
