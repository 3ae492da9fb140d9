"""The compile cache: entries verified on every hit, stored as each region finishes, work pruned;
artifacts reproducible; Ctrl-C and kill -9 leave no worker behind."""

import os
import signal
import subprocess
import sys
import time

import pytest

from deepinfer.compiler.build import compile_recipe
from deepinfer.compiler.cache import CompileCache
from deepinfer.compiler.recipe import load_recipe
from tests.conftest import write_recipe

SMALL = {"decode": {"buckets": [1]}, "prefill": {"buckets": [16]}}  # 8 regions, 2 of them hold aten.sigmoid


def flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_damaged_entry_is_dropped(tmp_path):
    cache = CompileCache(tmp_path)
    artifact = tmp_path / "x.ep.json"
    artifact.write_bytes(b"artifact")
    stored = cache.put("abc", artifact, {"backend": "export"})
    assert cache.get("abc") == stored
    flip_byte(stored)
    assert cache.get("abc") is None
    assert not (tmp_path / "regions" / "abc").exists() and list((tmp_path / "regions").iterdir()) == []


def test_two_compiles_of_one_region_sharing_a_cache_keep_their_own_scratch(tmp_path):
    """Two compilers on one cache (the default ~/.cache/deepinfer) may compile one region at once:
    the first to finish prunes its scratch, not the other's graph file and log."""
    cache = CompileCache(tmp_path)
    first, second = cache.work_dir("abc"), cache.work_dir("abc")
    (second / "region.ep.pt2").write_bytes(b"graph")
    cache.prune_work(first)
    assert not first.exists() and (second / "region.ep.pt2").read_bytes() == b"graph"


def test_a_tampered_cache_entry_is_recompiled_not_shipped(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path, "small", methods=SMALL, backend={"name": "export"}))
    cache = tmp_path / "cache"
    first = compile_recipe(recipe, cache_dir=cache, progress=False)
    assert first.compiled == 8 and not any((cache / "work").iterdir())  # work pruned once cached
    assert not list((cache / "regions").glob(".*"))  # no staging left
    originals = {p.name: p.read_bytes() for p in (first.bundle / "regions").iterdir()}
    entry = sorted((cache / "regions").iterdir())[0]
    victim = next(entry.glob("artifact.*"))
    victim.write_bytes(victim.read_bytes().replace(b'"as_int": 1', b'"as_int": 2', 1))  # an edited constant
    again = compile_recipe(recipe, cache_dir=cache, progress=False)
    assert (again.compiled, again.cache_hits) == (1, 7)
    # The recompiled region is bit-identical to the first one, so the bundle is too.
    assert {p.name: p.read_bytes() for p in (again.bundle / "regions").iterdir()} == originals


@pytest.fixture(scope="module")
def hang_dir(tmp_path_factory):
    """One recipe and cache for both interrupt tests: the second finds the 6 regions cached."""
    return tmp_path_factory.mktemp("hangs")


def _hanging_compile(tmp_path):
    """A compile whose 2 sigmoid regions hang (3 jobs: the third slot compiles the rest), waited on until
    the other 6 are cached."""
    recipe = write_recipe(tmp_path, "hangs", methods=SMALL,
                          backend={"name": "export", "options": {"inject_fault": {"ops": ["aten.sigmoid"], "action": "hang"}}})
    cache = tmp_path / "cache"
    compiler = subprocess.Popen([sys.executable, "-m", "deepinfer.compiler.cli", str(recipe), "--cache-dir", str(cache),
                                 "--jobs", "3", "--timeout", "3600"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while len(list((cache / "regions").glob("[0-9a-f]*"))) < 6 or len(_workers(cache)) < 2:
        assert compiler.poll() is None and time.monotonic() < deadline, "the compile ended or stalled"
        time.sleep(0.2)
    return compiler, cache


def _workers(cache) -> list[int]:
    """Live worker processes compiling into this cache."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
            log = os.readlink(f"/proc/{pid}/fd/1")  # a worker writes into its job's log in the cache
        except OSError:
            continue
        if "deepinfer.compiler" in cmdline and log.startswith(str(cache)) and state != "Z":
            pids.append(int(pid))
    return pids


def _gone_within(cache, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _workers(cache):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_ctrl_c_stops_at_once_keeps_finished_regions_and_leaves_no_worker(hang_dir):
    tmp_path = hang_dir
    compiler, cache = _hanging_compile(tmp_path)
    os.kill(compiler.pid, signal.SIGINT)
    interrupted = time.monotonic()
    _, stderr = compiler.communicate(timeout=60)  # within seconds here; the margin is for a loaded machine
    print(f"compiler exited {time.monotonic() - interrupted:.2f} s after Ctrl-C")
    assert compiler.returncode == 130 and "interrupted" in stderr and "Traceback" not in stderr
    assert _gone_within(cache, 30)
    assert len(list((cache / "regions").glob("[0-9a-f]*"))) == 6  # the finished regions stay cached
    assert not (tmp_path / "bundles").exists() or not any((tmp_path / "bundles").iterdir())


def test_a_killed_compiler_takes_its_workers_with_it(hang_dir):
    compiler, cache = _hanging_compile(hang_dir)
    os.kill(compiler.pid, signal.SIGKILL)
    compiler.wait(timeout=60)
    assert _gone_within(cache, 30)
