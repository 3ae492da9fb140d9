"""The compile pipeline around the backends: isolation of failures, the cache, the bundle swap."""

import shlex
import subprocess
import sys
import time

import pytest

from deepinfer.compiler.build import CompileFailed, compile_recipe
from deepinfer.compiler.plan import plan
from deepinfer.compiler.cache import CompileCache
from deepinfer.compiler.recipe import load_recipe
from tests.conftest import TINY_RECIPE, write_recipe

SMALL = {"decode": {"buckets": [1]}, "prefill": {"buckets": [16]}}  # 8 regions: quick to fail


def faulty_recipe(tmp_path, action, name="faulty"):
    return write_recipe(tmp_path, name, methods=SMALL,
                        backend={"name": "export", "options": {"inject_fault": {"ops": ["aten.sigmoid"], "action": action}}})


def test_crashing_region_fails_the_compile_with_a_report_and_no_bundle(tmp_path):
    recipe = faulty_recipe(tmp_path, "segfault")
    cache = tmp_path / "cache"
    run = subprocess.run([sys.executable, "-m", "deepinfer.compiler.cli", str(recipe), "--cache-dir", str(cache), "--jobs", "2"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 1
    assert "2 region(s) failed to compile; no bundle was written" in run.stderr  # the MoE layer, in 2 programs
    assert run.stderr.count("signal SIGSEGV") == 2 and "reproduce: " in run.stderr
    bundles = tmp_path / "bundles"
    assert not bundles.exists() or not any(bundles.iterdir())  # no bundle, no staging leftovers
    # The 6 regions that did compile are cached; the failures are not.
    assert len(list((cache / "regions").iterdir())) == 6
    # The printed command reproduces the crash on its own.
    command = next(line for line in run.stderr.splitlines() if "reproduce: " in line).split("reproduce: ", 1)[1]
    assert subprocess.run(shlex.split(command), capture_output=True).returncode == -11  # SIGSEGV


def test_error_and_hang_are_reported_by_signature(tmp_path):
    with pytest.raises(CompileFailed) as err:
        compile_recipe(load_recipe(faulty_recipe(tmp_path, "error")), cache_dir=tmp_path / "cache", progress=False)
    assert {f.signature for f in err.value.failures} == {"exit 3: error: NCC_INJ001: injected compiler fault on ops ['aten.sigmoid']"}

    start = time.perf_counter()
    with pytest.raises(CompileFailed) as err:
        compile_recipe(load_recipe(faulty_recipe(tmp_path, "hang", "hangs")), cache_dir=tmp_path / "cache", timeout=5, progress=False)
    assert {f.signature for f in err.value.failures} == {"timeout"}
    assert time.perf_counter() - start < 120  # the hung workers were killed; the others finished


def test_unchanged_recipe_hits_the_cache_and_a_new_bucket_compiles_only_its_regions(tiny_bundle, cache_dir, tmp_path):
    tiny_bundle("export")  # the session's cache now holds the tiny recipe's regions
    again = compile_recipe(load_recipe(TINY_RECIPE, backend="export", output=tmp_path / "again"), cache_dir=cache_dir, progress=False)
    assert (again.compiled, again.cache_hits, again.unique_regions) == (0, 16, 16)
    wider = load_recipe(write_recipe(tmp_path, "wider", methods={"decode": {"buckets": [1, 2, 4]}}, backend={"name": "export"}))
    the_plan = plan(wider)
    new = {fp for fp in the_plan.regions if CompileCache(cache_dir).get(fp) is None}
    # Only decode/2's regions (embed, dense, MoE, head) can be new; other tests of this session
    # may have compiled the same structures already (fingerprints ignore weight values), the
    # other test process may meanwhile too.
    assert new <= {step.region for step in the_plan.programs["decode/2"].steps}
    summary = compile_recipe(wider, cache_dir=cache_dir, progress=False)
    assert summary.compiled <= len(new) and summary.compiled + summary.cache_hits == 20


def test_cache_entries_are_whole_or_absent(tmp_path):
    cache = CompileCache(tmp_path)
    artifact = tmp_path / "x.ep.pt2"
    artifact.write_bytes(b"artifact")
    assert cache.get("abc") is None
    stored = cache.put("abc", artifact, {"backend": "export"})
    assert stored.read_bytes() == b"artifact" and stored.name == "artifact.ep.pt2"
    assert cache.put("abc", artifact, {}) == stored  # a second writer of the same entry is harmless
    assert [p.name for p in (tmp_path / "regions").iterdir()] == ["abc"]  # no staging dirs left


def test_recompiling_replaces_the_bundle_atomically(tiny_bundle, cache_dir, tmp_path):
    out = tmp_path / "bundle"
    compile_recipe(load_recipe(TINY_RECIPE, backend="export", output=out), cache_dir=cache_dir, progress=False)
    first = (out / "manifest.json").read_text()
    compile_recipe(load_recipe(TINY_RECIPE, backend="export", output=out), cache_dir=cache_dir, progress=False)
    assert (out / "manifest.json").read_text() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]
