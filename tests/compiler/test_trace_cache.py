"""The trace-level cache: an unchanged compile reuses its plan (nothing traced) and writes the same
bundle; a changed recipe, config or source is another key; a region gone from the cache or a
damaged plan traces again."""

import json
import shutil

import pytest

from deepinfer.compiler import trace, trace_cache
from deepinfer.compiler.build import compile_recipe
from deepinfer.compiler.recipe import load_recipe
from tests.conftest import ROOT, write_recipe

SMALL = {"decode": {"buckets": [2]}, "prefill": {"buckets": [16]}}


def tiny(tmp_path, **changes):
    return load_recipe(write_recipe(tmp_path, "tiny", **{"methods": SMALL, "backend": {"name": "export"}, **changes}))


def test_an_unchanged_compile_reuses_its_plan_and_writes_the_same_bundle(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cold = compile_recipe(tiny(tmp_path), cache_dir=cache, progress=False)
    manifest = (cold.bundle / "manifest.json").read_bytes()
    assert not cold.plan_reused and len(list((cache / "plans").glob("*.json"))) == 1
    assert set(cold.phases) == {"plan", "export", "backend (regions summed)", "write"} and cold.phases["plan"] > 0
    assert cold.longest_region[1] in json.loads(manifest)["regions"] and "slowest region" in cold.where_the_time_went()
    real = trace.trace_programs
    monkeypatch.setattr(trace, "trace_programs", lambda *a, **k: pytest.fail("traced"))
    warm = compile_recipe(tiny(tmp_path), cache_dir=cache, progress=False)
    assert warm.plan_reused and warm.cache_hits == warm.unique_regions and "plan from the trace cache" in str(warm)
    assert (warm.bundle / "manifest.json").read_bytes() == manifest
    assert warm.phases["plan"] < cold.phases["plan"] and warm.longest_region == (0.0, "")  # (nothing traced or compiled)

    monkeypatch.setattr(trace, "trace_programs", real)
    shutil.rmtree(next((cache / "regions").iterdir()))  # a region the plan names is gone: its graph is needed
    again = compile_recipe(tiny(tmp_path), cache_dir=cache, progress=False)
    assert not again.plan_reused and again.compiled == 1 and (again.bundle / "manifest.json").read_bytes() == manifest
    next((cache / "plans").glob("*.json")).write_text('{"signatures": ')
    damaged = compile_recipe(tiny(tmp_path), cache_dir=cache, progress=False)
    assert not damaged.plan_reused and (damaged.bundle / "manifest.json").read_bytes() == manifest


def test_what_a_plan_is_made_of_is_in_its_key(tmp_path, monkeypatch):
    key = trace_cache.trace_key(tiny(tmp_path))
    elsewhere = load_recipe(write_recipe(tmp_path, "tiny", methods=SMALL, backend={"name": "export"}), output=tmp_path / "elsewhere")
    assert trace_cache.trace_key(elsewhere) == key  # where the bundle goes is not
    assert trace_cache.trace_key(tiny(tmp_path, kv={"max_seqs": 2, "max_len": 128})) != key
    assert trace_cache.trace_key(tiny(tmp_path, backend={"name": "export", "options": {"inject_fault": {"ops": ["aten.mm"], "action": "error"}}})) != key
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(ROOT / "checkpoints" / "tiny-v3-code", checkpoint)
    with_checkpoint = trace_cache.trace_key(tiny(tmp_path, model={"checkpoint": str(checkpoint), "config": None}))
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    assert trace_cache.trace_key(tiny(tmp_path, model={"checkpoint": str(checkpoint), "config": None})) != with_checkpoint
    monkeypatch.setattr(trace_cache, "source_digest", lambda: "edited source")
    assert trace_cache.trace_key(tiny(tmp_path)) != key
