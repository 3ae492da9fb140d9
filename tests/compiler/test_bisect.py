"""deepinfer-compile bisect against injected backend faults: the right ops, a boundary between them
that makes the recipe compile, a resumable state, and honesty about non-deterministic failures."""

import json
import subprocess
import sys
import time

import yaml

from deepinfer.compiler.bisect import Bisector, bisect
from deepinfer.compiler.build import compile_recipe
from deepinfer.compiler.plan import plan
from deepinfer.compiler.cache import CompileCache
from deepinfer.compiler.recipe import load_recipe
from deepinfer.runtime.engine import Engine, Request
from deepinfer.runtime.executor import BundleExecutor
from tests.conftest import write_recipe

SMALL = {"decode": {"buckets": [1]}, "prefill": {"buckets": [16]}}


def faulty(tmp_path, ops, action, name="faulty"):
    return write_recipe(tmp_path, name, methods=SMALL,
                        backend={"name": "export", "options": {"inject_fault": {"ops": ops, "action": action}}})


def tokens(bundle):
    engine = Engine.for_bundle(BundleExecutor(bundle))
    return [r.token_ids for r in engine.generate([Request([5, 6, 7], 8), Request(list(range(20, 40)), 8)])]


def test_segfault_on_sigmoid_and_gather_is_bisected_applied_and_fixed(tmp_path, cache_dir):
    recipe_path = faulty(tmp_path, ["aten.sigmoid", "aten.gather"], "segfault")
    original = recipe_path.read_text()
    run = subprocess.run([sys.executable, "-m", "deepinfer.compiler.cli", "bisect", str(recipe_path), "--out", str(tmp_path / "out"),
                          "--cache-dir", str(cache_dir), "--timeout", "120", "--apply"], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    [finding] = json.loads((tmp_path / "out" / "report.json").read_text())
    assert finding["signature"] == "signal SIGSEGV"
    targets = [op["target"] for op in finding["ops"]]
    assert targets[0] == "aten.sigmoid.default" and targets[-1] == "aten.gather.default"
    assert all(op["module"] == "layers.*.mlp.gate" for op in finding["ops"])
    assert finding["boundary"] == {"op": "aten.gather", "module": "layers.*.mlp.gate"} and finding["boundary_verified"]
    repro = tmp_path / "out" / finding["region"] / "repro"
    assert {p.name for p in repro.iterdir()} >= {"minimal.ep.pt2", "inputs.json", "backend.json", "versions.json", "repro.sh"}
    assert subprocess.run([str(repro / "repro.sh")], capture_output=True).returncode == -11
    assert "recipe.patch.yaml" in {p.name for p in (tmp_path / "out").iterdir()}

    # --apply changed only the regions: block, and the recipe now compiles with the fault still injected...
    patched = recipe_path.read_text()
    assert [l for l in patched.splitlines() if not l.startswith(("regions:", " ", "-"))] == \
           [l for l in original.splitlines() if not l.startswith(("regions:", " ", "-"))]
    assert yaml.safe_load(patched)["regions"]["boundaries"] == [{"op": "aten.gather", "module": "layers.*.mlp.gate"}]
    fixed = compile_recipe(load_recipe(recipe_path), cache_dir=cache_dir, progress=False)
    # ...and generates the tokens of a bundle compiled with no fault.
    clean = compile_recipe(load_recipe(write_recipe(tmp_path, "clean", methods=SMALL, backend={"name": "export"})),
                           cache_dir=cache_dir, progress=False)
    assert tokens(fixed.bundle) == tokens(clean.bundle)


def test_error_on_ops_far_apart_is_cut_between_them(tmp_path, cache_dir):
    recipe = load_recipe(faulty(tmp_path, ["aten.index_put_", "aten.sigmoid"], "error"))
    findings = bisect(recipe, tmp_path / "r.yaml", tmp_path / "out", None, 120, 2, CompileCache(cache_dir), apply=False)
    [finding] = findings
    assert finding.signature.startswith("exit 3: error: NCC_INJ001")
    assert finding.ops[0]["target"] == "aten.index_put_.default" and finding.ops[-1]["target"] == "aten.sigmoid.default"
    assert len(finding.ops) > 20  # the whole attention half lies between them
    assert finding.boundary == {"op": "aten.sigmoid", "module": "layers.*.mlp.gate"} and finding.boundary_verified


def test_hang_is_bisected_by_timeout_and_resumes_from_state(tmp_path, cache_dir):
    recipe = load_recipe(faulty(tmp_path, ["aten.cos", "aten.sin"], "hang"))
    the_plan = plan(recipe)
    embed = the_plan.programs["decode/1"].steps[0].region
    # Every hanging trial costs the whole timeout: bound trials at 3x what one that cannot hang (a
    # single op, in a fresh worker) takes on this machine now, rather than at a fixed worst case.
    probe = Bisector(recipe, the_plan, embed, tmp_path / "probe", timeout=300)
    began = time.perf_counter()
    assert probe.trial(0, 1) == "ok"
    probe.workers.close()
    timeout = max(5.0, 3 * (time.perf_counter() - began))
    first = Bisector(recipe, the_plan, embed, tmp_path / "out", timeout=timeout, jobs=2).run()
    assert first.signature == "timeout"
    assert [op["target"] for op in first.ops][0] == "aten.cos.default" and first.ops[-1]["target"] == "aten.sin.default"
    assert first.boundary == {"op": "aten.sin", "module": "embed"}
    # An interrupted bisect resumes: forget the last two trials (as if stopped during them); only
    # those are compiled again (each hanging one costs the whole timeout, so not more of them).
    state_file = tmp_path / "out" / embed / "state.json"
    state = json.loads(state_file.read_text())
    kept = dict(list(state.items())[:-2])
    state_file.write_text(json.dumps(kept))
    again = Bisector(recipe, the_plan, embed, tmp_path / "out", timeout=timeout, jobs=2).run()
    assert (again.ops, again.boundary) == (first.ops, first.boundary)
    assert again.trials == len(state) - len(kept)


def test_a_failure_that_changes_between_runs_is_reported_not_bisected(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the flaky action's run counter lives there
    recipe = load_recipe(faulty(tmp_path, ["aten.cos"], "flaky"))
    the_plan = plan(recipe)
    embed = the_plan.programs["decode/1"].steps[0].region
    finding = Bisector(recipe, the_plan, embed, tmp_path / "out", timeout=60).run()
    assert not finding.deterministic and finding.boundary is None and finding.trials == 2
    assert "non-deterministic" in finding.signature and "SIGSEGV" in finding.signature and "exit 3" in finding.signature


def test_a_trial_without_the_fault_compiles_and_one_with_it_fails(tmp_path):
    recipe = load_recipe(faulty(tmp_path, ["aten.sigmoid"], "error"))
    the_plan = plan(recipe)
    fp = next(fp for fp, gm in the_plan.regions.items() if any("sigmoid" in str(n.target) for n in gm.graph.nodes))
    bisector = Bisector(recipe, the_plan, fp, tmp_path / "out", timeout=300)
    first_sigmoid = next(i for i, n in enumerate(bisector.sequence) if "sigmoid" in str(n.target))
    assert bisector.trial(0, first_sigmoid) == "ok"
    assert bisector.trial(0, first_sigmoid + 1).startswith("exit 3: error: NCC_INJ001")
    bisector.workers.close()
