"""`--executor ray`: region compiles as tasks on a Ray cluster (here a local one of this machine's
cores), isolated like local workers, landing in the cache as local ones do."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.compiler.build import CompileFailed, compile_recipe
from deepinfer.compiler.pool import Executor
from deepinfer.compiler.recipe import load_recipe
from tests.conftest import INDUCTOR_METHODS, write_recipe

pytest.importorskip("ray")

SMALL = {"decode": {"buckets": [1]}, "prefill": {"buckets": [16]}}  # 8 regions split per layer, 2 whole graphs


def recipe_with_fault(tmp_path, name: str, ops: list[str], action: str, split_layers: bool = True) -> Path:
    """The export backend with a fault injected sends every region through a compile worker."""
    return write_recipe(tmp_path, name, methods=SMALL, regions={"split_layers": split_layers, "boundaries": []},
                        backend={"name": "export", "options": {"inject_fault": {"ops": ops, "action": action}}})


@pytest.fixture(scope="module")
def ray_cluster():
    """One local cluster for the in-process compiles (each worker process imports torch: ~3 s)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="error")
    yield
    ray.shutdown()


def files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def recipe_free(manifest: bytes) -> dict:
    """A manifest without the recipe's output directory (and the checksum that covers it)."""
    body = json.loads(manifest)
    del body["recipe"]["output"], body["checksum"]
    return body


def test_a_ray_compile_writes_the_bundle_a_local_compile_writes(tiny_bundle, cache_dir, tmp_path):
    # AOTInductor's artifacts are reproducible (a region compiled again, elsewhere, is the same
    # bytes), though they carry the compile's work directory and thread count, which a Ray
    # task must reproduce (Ray gives a 1-CPU task OMP_NUM_THREADS=1). The session's inductor
    # bundle compiled locally; Ray compiles its smallest region again (the others hit a copy of
    # their cache entries) and must write the same bundle, byte for byte.
    local = tiny_bundle("inductor")
    regions = json.loads((local / "manifest.json").read_text())["regions"]
    assert all(r["backend"] == "inductor" for r in regions.values())
    smallest = sorted(regions, key=lambda fp: (local / regions[fp]["file"]).stat().st_size)[:1]
    for fingerprint in set(regions) - set(smallest):
        shutil.copytree(cache_dir / "regions" / fingerprint, tmp_path / "cache-ray" / "regions" / fingerprint)
    recipe = write_recipe(tmp_path, methods=INDUCTOR_METHODS, backend={"name": "inductor", "options": {}})
    run = subprocess.run([sys.executable, "-m", "deepinfer.compiler.cli", str(recipe), "--out", str(tmp_path / "ray"),
                          "--cache-dir", str(tmp_path / "cache-ray"), "--executor", "ray"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert f"{len(regions)} unique regions ({len(regions) - 1} cache hits, 1 compiled)" in run.stdout, run.stdout
    ray, here = files(tmp_path / "ray"), files(local)
    assert {name: data for name, data in ray.items() if name != "manifest.json"} == \
        {name: data for name, data in here.items() if name != "manifest.json"}  # regions and weights, byte for byte
    assert recipe_free(ray["manifest.json"]) == recipe_free(here["manifest.json"])  # (the recipes' outputs differ)
    assert set(smallest) <= {p.name for p in (tmp_path / "cache-ray" / "regions").iterdir()}  # landed in the driver's cache


def test_a_crash_and_a_hang_on_ray_are_reported_as_locally(tmp_path, ray_cluster):
    ray = Executor("ray")
    with pytest.raises(CompileFailed) as err:
        compile_recipe(load_recipe(recipe_with_fault(tmp_path, "crash", ["aten.sigmoid"], "segfault")),
                       cache_dir=tmp_path / "cache", progress=False, executor=ray)
    assert [f.signature for f in err.value.failures] == ["signal SIGSEGV"] * 2  # the MoE layer, in 2 programs
    assert "[Ray node " in err.value.failures[0].log_tail and "reproduce: " in str(err.value)
    assert len(list((tmp_path / "cache" / "regions").iterdir())) == 6  # the others compiled and were cached

    with pytest.raises(CompileFailed) as err:
        compile_recipe(load_recipe(recipe_with_fault(tmp_path, "hang", ["aten.sigmoid"], "hang", split_layers=False)),
                       cache_dir=tmp_path / "cache", timeout=10, progress=False, executor=ray)
    assert {f.signature for f in err.value.failures} == {"timeout"}
    assert "Every failure is a timeout" in str(err.value)
