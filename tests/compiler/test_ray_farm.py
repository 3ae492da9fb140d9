"""`--executor ray`: region compiles as tasks on a Ray cluster (here a local one of this machine's
cores), isolated like local workers, landing in the cache as local ones do."""

import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.compiler.build import CompileFailed, compile_recipe
from deepinfer.compiler.pool import Executor
from deepinfer.compiler.recipe import load_recipe
from tests.conftest import write_recipe

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


def test_a_ray_compile_writes_the_bundle_a_local_compile_writes(tmp_path):
    # AOTInductor (2 whole graphs): its artifacts carry the compile's work directory and thread
    # count, which a Ray task must reproduce (Ray gives a 1-CPU task OMP_NUM_THREADS=1).
    recipe = write_recipe(tmp_path, "farm", methods=SMALL, regions={"split_layers": False, "boundaries": []},
                          backend={"name": "inductor", "options": {}})
    local = compile_recipe(load_recipe(recipe, output=tmp_path / "local"), cache_dir=tmp_path / "cache-local", progress=False)
    run = subprocess.run([sys.executable, "-m", "deepinfer.compiler.cli", str(recipe), "--out", str(tmp_path / "ray"),
                          "--cache-dir", str(tmp_path / "cache-ray"), "--executor", "ray"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "2 unique regions (0 cache hits, 2 compiled)" in run.stdout and local.compiled == 2
    assert files(tmp_path / "ray") == files(local.bundle)  # byte for byte
    assert len(list((tmp_path / "cache-ray" / "regions").iterdir())) == 2  # each landed in the driver's cache


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
