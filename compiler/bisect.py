"""Bisect a backend crash down to the ops that cause it, and the graph boundary that avoids it.

    deepinfer-compile bisect recipes/x.yaml [--region FP] [--timeout S] [--out DIR] [--apply]

For each failing region: reproduce it twice in fresh worker processes (a failure whose signature
changes between runs is reported as non-deterministic, not bisected); then delta-debug its node
sequence — cut the tail (the shortest failing prefix), then the head (the latest start that still
fails) — where every candidate is a standalone graph whose inputs are the live values crossing
into it, compiled in its own process with the timeout, and must fail with the SAME signature.
A boundary before the last op of the minimal span separates the culprits; it is named by op and
module path (so it survives a re-trace), checked by re-planning the recipe with it and compiling
the pieces, and written as a recipe patch. Every trial's result is kept in `state.json`, so an
interrupted bisect resumes where it stopped. Each search round compiles `--jobs` cut points at
once, in parallel worker processes.
"""

import json
import operator
import shlex
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from torch import fx

from . import recipe_yaml
from .backends import backend_module
from .build import compile_regions
from .plan import Plan, plan
from .cache import CompileCache
from .pool import LOCAL, Executor, Job, JobResult
from .recipe import Recipe, RecipeError
from .split import export_region, module_path


RETRY_FACTOR = 4  # a trial that timed out while chasing another signature gets this many times longer


@dataclass
class Finding:
    region: str
    signature: str
    deterministic: bool = True
    ops: list[dict] = field(default_factory=list)  # the minimal failing span: target + module path
    boundary: dict | None = None
    boundary_verified: bool = False
    trials: int = 0
    seconds: float = 0.0
    repro: str = ""


def subgraph(graph_module: fx.GraphModule, nodes: list[fx.Node]) -> fx.GraphModule:
    """A standalone graph of `nodes` (plus the getitems of their tuple outputs): values from
    outside become placeholders; values used outside (or nowhere) become outputs."""
    chosen = set(nodes)
    chosen |= {u for n in nodes for u in n.users if u.target is operator.getitem}
    ordered = [n for n in graph_module.graph.nodes if n in chosen]
    graph, env = fx.Graph(), {}

    def value(node):
        if node not in env and node.op == "get_attr":  # a torch.cond branch travels with the cond
            env[node] = graph.node_copy(node)
        elif node not in env:
            env[node] = graph.placeholder(node.name)
            env[node].meta = dict(node.meta)
        return env[node]

    for node in ordered:
        env[node] = graph.node_copy(node, value)
    outputs = [env[n] for n in ordered
               if isinstance(n.meta.get("val"), torch.Tensor) and (not n.users or any(u not in chosen for u in n.users))]
    if not outputs:
        outputs = [env[n] for n in ordered if isinstance(n.meta.get("val"), torch.Tensor)][-1:]
    graph.output(tuple(outputs))
    return fx.GraphModule(graph_module, graph)


class Bisector:
    def __init__(self, recipe: Recipe, the_plan: Plan, fingerprint: str, out: Path, timeout: float, jobs: int = 1,
                 executor: Executor = LOCAL):
        self.recipe, self.plan, self.fp, self.timeout, self.jobs = recipe, the_plan, fingerprint, timeout, max(1, jobs)
        self.lock = threading.Lock()
        self.graph = the_plan.regions[fingerprint]
        self.unit_path = the_plan.region_paths[fingerprint]
        self.sequence = [n for n in self.graph.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
        self.dir = Path(out) / fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)
        self.state_path = self.dir / "state.json"
        self.state = json.loads(self.state_path.read_text()) if self.state_path.exists() else {}
        self.trials = 0
        self.chasing: str | None = None  # the signature being bisected, once reproduced
        self.workers = executor.workers(the_plan.toolchain)
        self._extension = backend_module(recipe.backend).EXTENSION  # backends check their file's suffix

    def trial(self, start: int, end: int, attempt: int = 0) -> str:
        """'ok' or the failure signature of nodes [start, end) compiled on their own (remembered)."""
        key = f"{start}:{end}" + (f"#{attempt}" if attempt else "")
        if key not in self.state:
            result = self._compile(key, start, end)
            with self.lock:  # trials run in parallel threads
                self.state[key] = "ok" if result.ok else result.signature
                tmp = self.state_path.with_suffix(".tmp")
                tmp.write_text(json.dumps(self.state, indent=1))
                tmp.replace(self.state_path)
        return self.state[key]

    def _compile(self, key: str, start: int, end: int) -> JobResult:
        work = self.dir / "trials" / key.replace(":", "-").replace("#", "-")
        work.mkdir(parents=True, exist_ok=True)
        with self.lock:  # tracing is not thread-safe; only the compile workers run in parallel
            self.trials += 1
            torch.export.save(export_region(subgraph(self.graph, self.sequence[start:end])), work / "region.ep.pt2")
        job = Job(f"{self.fp}[{key}]", work / "region.ep.pt2", work / f"artifact.{self._extension}", self.recipe.backend,
                  self.plan.backend_options, work / "compile.log")
        result = self.workers.run(job, self.timeout)
        if result.returncode is None and self.chasing not in (None, "timeout"):
            # Chasing a crash or an error, a trial that ran out of time was slow (a busy machine),
            # not different: give it a longer bound rather than count it as another failure.
            result = self.workers.run(job, self.timeout * RETRY_FACTOR)
        return result

    def run(self) -> Finding:
        try:
            return self._run()
        finally:
            self.workers.close()

    def _run(self) -> Finding:
        start_time = time.perf_counter()
        n = len(self.sequence)
        # The whole region twice, to tell a deterministic failure from a flaky one: side by side when
        # jobs allow (a hang costs the timeout once, not twice), else the second only if it failed.
        if self.jobs > 1:
            with ThreadPoolExecutor(2) as pool, self._kill_workers_on_interrupt():
                signature, repeated = pool.map(lambda attempt: self.trial(0, n, attempt), (0, 1))
        else:
            signature = self.trial(0, n)
            repeated = signature if signature == "ok" else self.trial(0, n, attempt=1)
        self.chasing = signature
        finding = Finding(self.fp, signature)
        if signature == "ok":
            finding.signature = "does not reproduce (the region compiles on its own)"
        elif repeated != signature:
            finding.deterministic = False
            finding.signature = f"non-deterministic: {signature!r}, then {self.state[f'0:{n}#1']!r}"
        else:
            end = self._shortest_failing_prefix(signature)
            begin = self._latest_failing_start(signature, end)
            span = self.sequence[begin:end]
            finding.ops = [{"index": begin + k, "target": str(node.target), "module": module_path(node, self.unit_path)}
                           for k, node in enumerate(span)]
            cut = span[-1] if len(span) > 1 else span[0]
            finding.boundary = {"op": str(cut.target).rsplit(".", 1)[0], "module": module_path(cut, self.unit_path)}
            finding.repro = str(self._write_repro(begin, end, signature))
        finding.trials, finding.seconds = self.trials, time.perf_counter() - start_time
        return finding

    def _smallest(self, lo: int, hi: int, fails) -> int:
        """Smallest x in [lo, hi] with fails(x), for fails monotone and fails(hi) known true. Each
        round tries `jobs` cut points at once (independent trials, in parallel)."""
        with ThreadPoolExecutor(self.jobs) as pool, self._kill_workers_on_interrupt():
            while lo < hi:
                points = sorted({lo + (hi - lo) * t // (self.jobs + 1) for t in range(1, self.jobs + 1)} - {hi}) or [lo]
                results = dict(zip(points, pool.map(fails, points)))
                failing = [p for p in points if results[p]]
                if failing:
                    hi = failing[0]
                    lo = max([p + 1 for p in points if p < hi] + [lo])
                else:
                    lo = points[-1] + 1
        return hi

    @contextmanager
    def _kill_workers_on_interrupt(self):
        """Ctrl-C: kill the running trials' workers, so the pool's threads return at once."""
        try:
            yield
        except BaseException:
            self.workers.kill_all()
            raise

    def _shortest_failing_prefix(self, signature: str) -> int:
        return self._smallest(1, len(self.sequence), lambda end: self.trial(0, end) == signature)

    def _latest_failing_start(self, signature: str, end: int) -> int:
        # Moving the start back only grows the span, so "fails" is monotone in the distance back.
        back = self._smallest(0, end - 1, lambda k: self.trial(end - 1 - k, end) == signature)
        return end - 1 - back

    def _write_repro(self, begin: int, end: int, signature: str) -> Path:
        from deepinfer.runtime.versions import toolchain_versions

        repro = self.dir / "repro"
        repro.mkdir(exist_ok=True)
        program = export_region(subgraph(self.graph, self.sequence[begin:end]))
        torch.export.save(program, repro / "minimal.ep.pt2")
        specs = [{"shape": list(n.meta["val"].shape), "dtype": str(n.meta["val"].dtype)}
                 for n in program.graph.nodes if n.op == "placeholder"]
        (repro / "inputs.json").write_text(json.dumps(specs, indent=1))
        (repro / "backend.json").write_text(json.dumps({"backend": self.recipe.backend, "options": self.plan.backend_options}, indent=1))
        (repro / "versions.json").write_text(json.dumps(toolchain_versions(), indent=1))
        (repro / "graph.txt").write_text(str(program.graph))
        command = Job("", Path("minimal.ep.pt2"), Path(f"out.{self._extension}"), self.recipe.backend, self.plan.backend_options, Path()).command
        (repro / "repro.sh").write_text(f"#!/bin/sh\n# expected: {signature}\ncd \"$(dirname \"$0\")\"\nexec {shlex.join(command)}\n")
        (repro / "repro.sh").chmod(0o755)
        return repro


def verify_boundary(recipe: Recipe, boundary: dict, cache: CompileCache, timeout: float, jobs: int,
                    executor: Executor = LOCAL) -> bool:
    """Re-plan the recipe with the boundary added and compile whatever that changes."""
    from dataclasses import replace

    from .build import CompileFailed

    patched = replace(recipe, boundaries=recipe.boundaries + [boundary])
    try:
        compile_regions(patched, plan(patched), cache, jobs, timeout, progress=False, executor=executor)
        return True
    except CompileFailed:
        return False


def apply_boundaries(recipe_path: Path, boundaries: list[dict]):
    """Add boundaries under `regions.boundaries`, rewriting only the `regions:` block of the file."""
    text = recipe_path.read_text()
    regions = dict((recipe_yaml.load(text)[0] or {}).get("regions") or {})
    merged = list(regions.get("boundaries") or [])
    merged += [b for i, b in enumerate(boundaries) if b not in merged and b not in boundaries[:i]]
    regions["boundaries"] = merged
    block = yaml.safe_dump({"regions": regions}, sort_keys=False, default_flow_style=None).splitlines()
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("regions:")), None)
    if start is None:
        lines += block
    else:
        end = start + 1
        while end < len(lines) and (lines[end].startswith((" ", "\t")) or not lines[end].strip()):
            end += 1
        lines[start:end] = block
    recipe_path.write_text("\n".join(lines) + "\n")


def write_reports(out: Path, findings: list[Finding]):
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps([f.__dict__ for f in findings], indent=1))
    md = ["# deepinfer-compile bisect", ""]
    for f in findings:
        md += [f"## region {f.region}", "", f"- signature: `{f.signature}`", f"- trials: {f.trials}, {f.seconds:.1f} s"]
        if f.ops:
            md += ["- smallest failing ops:"] + [f"  - `{o['target']}` in `{o['module']}`" for o in f.ops]
        if f.boundary:
            md += [f"- boundary: `{f.boundary}` ({'verified: every piece compiles' if f.boundary_verified else 'NOT verified'})",
                   f"- repro: `{f.repro}/repro.sh`"]
        md.append("")
    patch = [f.boundary for f in findings if f.boundary and f.boundary_verified]
    if patch:
        (out / "recipe.patch.yaml").write_text(yaml.safe_dump({"regions": {"boundaries": patch}}, sort_keys=False))
        md += ["Recipe patch (`recipe.patch.yaml`, or rerun with `--apply`):", "", "```yaml",
               yaml.safe_dump({"regions": {"boundaries": patch}}, sort_keys=False).strip(), "```"]
    (out / "report.md").write_text("\n".join(md) + "\n")


def bisect(recipe: Recipe, recipe_path: Path, out: Path, region: str | None, timeout: float, jobs: int,
           cache: CompileCache, apply: bool, executor: Executor = LOCAL) -> list[Finding]:
    from .build import CompileFailed

    the_plan = plan(recipe)
    if region:
        if region not in the_plan.regions:
            raise RecipeError(f"--region {region}: no such region in {recipe_path}; its regions are {sorted(the_plan.regions)}.")
        failing = [region]
    else:
        try:
            compile_regions(recipe, the_plan, cache, jobs, timeout, progress=True, executor=executor)
            failing = []
        except CompileFailed as err:
            failing = [f.job.name for f in err.failures]
    findings = []
    for fp in failing:
        finding = Bisector(recipe, the_plan, fp, out, timeout, jobs, executor).run()
        if finding.boundary:
            # Verification compiles the whole recipe with the boundary: when it passes, the other
            # failing regions (often the same layer kind at other buckets) are fixed by it too.
            finding.boundary_verified = verify_boundary(recipe, finding.boundary, cache, timeout, jobs, executor)
        findings.append(finding)
        if finding.boundary_verified:
            break
    write_reports(out, findings)
    if apply:
        apply_boundaries(recipe_path, [f.boundary for f in findings if f.boundary and f.boundary_verified])
    return findings
