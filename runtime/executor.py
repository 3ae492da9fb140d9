"""Replays a bundle's programs: each Step runs its (method, bucket) program, region after region,
with the collectives between regions run by torch.distributed (on multi-rank bundles).

Everything that can be resolved at load is: each region call's arguments are either a fixed
tensor (a weight, a KV cache layer) or a slot in a small per-step value table, so a region call
costs one list comprehension and the backend call.
"""

import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from . import knobs
from .collectives import run_collective
from .backends import load_region
from .manifest import BundleError, read_manifest
from .step import Step
from .versions import toolchain_versions


class _Call:
    __slots__ = ("fn", "fingerprint", "args", "outputs")

    def __init__(self, fn, fingerprint, args, outputs):
        self.fn, self.fingerprint = fn, fingerprint
        self.args = args  # per argument: a tensor, or an int index into the step's value table
        self.outputs = outputs  # value-table index of each output


class _Plan:
    def __init__(self, calls, n_values, output):
        self.calls, self.n_values, self.output = calls, n_values, output


class BundleExecutor:
    def __init__(self, bundle: str | Path, rank: int = 0):
        self.bundle = Path(bundle)
        self.manifest = m = read_manifest(self.bundle, toolchain_versions(), rank)
        self.rank = rank
        functions = {fp: load_region(r.backend, self.bundle / r.file) for fp, r in m.regions.items()}
        weights = load_file(self.bundle / m.weight_files[rank])
        dtype = getattr(torch, m.kv.dtype)
        self.kv = [torch.zeros(m.kv.shape, dtype=dtype) for _ in range(m.kv.layers)]
        fixed = {**weights, **{f"kv.{i}": t for i, t in enumerate(self.kv)}}
        self.plans = {key: self._resolve(key, program, functions, fixed) for key, program in m.programs.items()}
        self.host_seconds: dict[str, float] | None = {} if knobs.host_timing() else None
        self.trace_events: list | None = [] if knobs.region_trace_path() else None

    def _resolve(self, key, program, functions, fixed) -> _Plan:
        slots = {name: i for i, name in enumerate(program.inputs)}
        calls = []
        for step in program.steps:
            args = []
            for name in step.inputs:
                if name in fixed:
                    args.append(fixed[name])
                elif name in slots:
                    args.append(slots[name])
                else:
                    raise BundleError(f"{self.bundle}/manifest.json: program {key} reads {name!r} before anything writes it.")
            outputs = [slots.setdefault(name, len(slots)) for name in step.outputs]
            if step.collective:
                spec = step.collective
                label = f"{spec['op']}:{spec['group']}"
                calls.append(_Call(lambda *xs, spec=spec: run_collective(spec, *xs), label, args, outputs))
            else:
                calls.append(_Call(functions[step.region], step.region, args, outputs))
        return _Plan(calls, len(slots), slots[program.output])

    def run(self, step: Step) -> torch.Tensor:
        plan = self.plans.get(f"{step.method}/{step.bucket}")
        if plan is None:
            raise BundleError(f"{self.bundle}: no program for {step.method} with bucket {step.bucket}; "
                              f"compiled buckets are {self.manifest.buckets.get(step.method)}.")
        values = [None] * plan.n_values
        inputs = step.inputs()
        values[: len(inputs)] = inputs
        timed = self.host_seconds is not None or self.trace_events is not None
        for call in plan.calls:
            args = [values[a] if type(a) is int else a for a in call.args]
            if timed:
                start = time.perf_counter()
                results = call.fn(*args)
                self._record(call.fingerprint, step, start, time.perf_counter())
            else:
                results = call.fn(*args)
            for index, value in zip(call.outputs, results):
                values[index] = value
        return values[plan.output]

    def _record(self, fingerprint: str, step: Step, start: float, end: float):
        if self.host_seconds is not None:
            self.host_seconds[fingerprint] = self.host_seconds.get(fingerprint, 0.0) + end - start
        if self.trace_events is not None:
            self.trace_events.append({"name": fingerprint[:12], "cat": f"{step.method}/{step.bucket}", "ph": "X",
                                      "ts": start * 1e6, "dur": (end - start) * 1e6, "pid": self.rank, "tid": 0})

    def write_trace(self, path: Path):
        """Chrome trace format (load it in Perfetto or chrome://tracing)."""
        Path(path).write_text(json.dumps({"traceEvents": self.trace_events, "displayTimeUnit": "ms"}))
