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

SMALL = {"decode": {"buckets": [1]}, "prefill": {"buckets": [16]}}  # 8 regions


def recipe_with_fault(tmp_path, name: str, ops: list[str], action: str) -> Path:
    """The export backend with a fault injected sends every region through a compile worker."""
    return write_recipe(tmp_path, name, methods=SMALL,
                        backend={"name": "export", "options": {"inject_fault": {"ops": ops, "action": action}}})


def files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_ray_compile_writes_the_bundle_a_local_compile_writes(tmp_path):
    recipe = recipe_with_fault(tmp_path, "farm", ["aten.no_such_op"], "error")  # matches nothing: every region compiles
    local = compile_recipe(load_recipe(recipe, output=tmp_path / "local"), cache_dir=tmp_path / "cache-local", progress=False)
    run = subprocess.run([sys.executable, "-m", "deepinfer.compiler.cli", str(recipe), "--out", str(tmp_path / "ray"),
                          "--cache-dir", str(tmp_path / "cache-ray"), "--executor", "ray"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "8 unique regions (0 cache hits, 8 compiled)" in run.stdout and local.compiled == 8
    assert files(tmp_path / "ray") == files(local.bundle)  # byte for byte
    assert len(list((tmp_path / "cache-ray" / "regions").iterdir())) == 8  # each landed in the driver's cache


def test_a_crash_and_a_hang_on_ray_are_reported_as_locally(tmp_path):
    ray = Executor("ray")
    with pytest.raises(CompileFailed) as err:
        compile_recipe(load_recipe(recipe_with_fault(tmp_path, "crash", ["aten.sigmoid"], "segfault")),
                       cache_dir=tmp_path / "cache", progress=False, executor=ray)
    assert [f.signature for f in err.value.failures] == ["signal SIGSEGV"] * 2  # the MoE layer, in 2 programs
    assert "[Ray node " in err.value.failures[0].log_tail and "reproduce: " in str(err.value)
    assert len(list((tmp_path / "cache" / "regions").iterdir())) == 6  # the others compiled and were cached

    with pytest.raises(CompileFailed) as err:
        compile_recipe(load_recipe(recipe_with_fault(tmp_path, "hang", ["aten.sigmoid"], "hang")),
                       cache_dir=tmp_path / "cache", timeout=10, progress=False, executor=ray)
    assert {f.signature for f in err.value.failures} == {"timeout"}
    assert "Every failure is a timeout" in str(err.value)
