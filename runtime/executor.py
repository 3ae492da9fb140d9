"""Replays a bundle's programs: each Step runs its (method, bucket) program, region after region,
with the collectives between regions run by torch.distributed (on multi-rank bundles).

Everything that can be resolved at load is: a program's value table holds its fixed tensors (the
weights, the KV cache layers) in slots of their own and each step's values in the others, so a
region call costs one itemgetter over the table, the backend call and one slice assignment of its
outputs: ~0.5 us of Python a call (the trained tiny V3's decode step of 10 calls: 5.4 us, where a
list comprehension over arguments and a loop over outputs took 10.0).
"""

import json
import operator
import sys
import time
from pathlib import Path

import torch

from . import huge_pages, knobs
from .backends import backend_module
from .collectives import run_collective
from .errors import BundleError
from .files import BundleFiles
from .host_memory import keep_freed_memory
from .manifest import read_key, read_manifest
from .step import STEP_FIELDS, Step, copy_state
from .trust import Trust
from .versions import layout_problem, toolchain_versions
from .weights import tensors_of


class _Call:
    __slots__ = ("fn", "fingerprint", "take", "outputs")

    def __init__(self, fn, fingerprint, args: list[int], outputs: slice):
        self.fn, self.fingerprint = fn, fingerprint
        # its arguments' value-table slots -> a tuple of them
        self.take = operator.itemgetter(*args) if len(args) > 1 else lambda values, args=args: tuple(values[a] for a in args)
        self.outputs = outputs  # the table's slots for its outputs (new ones, one after the other: each value is written once)


class _Plan:
    def __init__(self, calls, table, output):
        self.calls, self.output = calls, output
        self.table = table  # the value table a step starts from: fixed tensors in their slots, None elsewhere


class BundleExecutor:
    def __init__(self, bundle: str | Path, rank: int = 0, trust: Trust = Trust(), progress: bool = False):
        """`trust`: what this deployment accepts (a deploy key the signature must match, native code);
        `progress`: a progress bar on stderr over the bytes of weights and regions loaded."""
        keep_freed_memory()  # the next step reuses what this one frees, instead of faulting fresh pages in
        self.bundle = Path(bundle)
        self.manifest, loaders = admit(self.bundle, rank, trust)
        m = self.manifest
        bar = _loading_bar(m, rank) if progress else None
        # Every file is read through this: hashed as read.
        self.files = BundleFiles(self.bundle, m.files, m.sizes, on_read=bar.update if bar else None)
        self.rank = rank
        weights = tensors_of(self.files.tensor(m.weight_files[rank]), str(self.bundle / m.weight_files[rank]))
        self.state = self._allocate_state()
        # Each state tensor's positions per entry on axis 1 (None: a fixed size, or a legacy pool, taken whole).
        self.entry_ratios = {f"kv.{i}.{t.name}": t.positions_per_entry for i, layer in enumerate(m.state or []) for t in layer}
        # Backends that may hold the state in memory of their own (a PJRT buffer): told before the
        # runtime changes it outside a region.
        self.state_holders = [module for module in set(loaders.values()) if hasattr(module, "release_state")]
        views = {context: self._state_views(context) for context in {p.context for p in m.programs.values()}}
        fixed = {key: {**weights, **views[program.context]} for key, program in m.programs.items()}
        # Every tensor a region will read or write is checked against the specs it was compiled
        # for BEFORE any region is loaded: a compiled region indexes memory without bounds checks.
        for key, program in m.programs.items():
            self._check_shapes(key, program, fixed[key])
        functions = {fp: loaders[fp].load(self.files.bytes(r.file), r, str(self.bundle / r.file)) for fp, r in m.regions.items()}
        self.plans = {key: self._resolve(key, program, functions, fixed[key]) for key, program in m.programs.items()}
        if bar:
            bar.close()
        self.host_seconds: dict[str, float] | None = {} if knobs.host_timing() else None
        self.trace_events: list | None = [] if knobs.region_trace_path() else None

    def _allocate_state(self) -> dict[str, torch.Tensor]:
        """Every layer's state pool (the KV cache and what else the model keeps per sequence slot)."""
        specs = self.manifest.state_tensors()
        try:
            return {name: huge_pages.empty(s.shape, getattr(torch, s.dtype)).zero_() for name, s in specs.items()}
        except RuntimeError as err:  # out of memory
            size = sum(torch.Size(s.shape).numel() * getattr(torch, s.dtype).itemsize for s in specs.values())
            raise BundleError(f"{self.bundle}: the state pool ({len(specs)} tensors, {size / 2**30:.1f} GiB) does not fit "
                              f"in this host's memory ({str(err).splitlines()[0]}). Recompile with a smaller kv.max_seqs "
                              "or kv.max_len.") from None

    def _state_views(self, context: int | None) -> dict[str, torch.Tensor]:
        """The state a program for `context` positions binds: each position-indexed tensor narrowed
        to its first context / positions_per_entry entries (a view: writes land in the pool)."""
        if context is None:
            return self.state
        return {name: t.narrow(1, 0, context // self.entry_ratios[name]) if self.entry_ratios.get(name) else t
                for name, t in self.state.items()}

    def _check_shapes(self, key: str, program, fixed: dict):
        """Walk the program with (shape, dtype) per value: step inputs from the bucket, weights and
        KV layers as loaded, region outputs as declared; every region input must match its spec."""
        where = f"{self.bundle}/manifest.json: program {key}"
        method, bucket = program.method, program.bucket
        expected_inputs = list(STEP_FIELDS.get(method, ()))
        if program.inputs != expected_inputs or key != program.key:
            raise BundleError(f"{where} takes {program.inputs}, but a {method!r} step gives {expected_inputs}; recompile the bundle.")
        known = {name: ([1] if name in ("read_slot", "last_index") else [bucket], "int64") for name in expected_inputs}
        known.update({name: (list(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in fixed.items()})
        for n, step in enumerate(program.steps):
            got = []
            for name in step.inputs:
                if name not in known:
                    raise BundleError(f"{where} reads {name!r} before anything writes it (a weight missing from "
                                      f"{self.manifest.weight_files[self.rank]}?); recompile the bundle.")
                got.append(known[name])
            if step.collective:
                outputs = [_collective_output(step.collective, spec, f"{where}, step {n}") for spec in got]
            else:
                region = self.manifest.regions[step.region]
                wanted = [(s.shape, s.dtype) for s in region.inputs]
                if got != wanted:
                    bad = next((i for i, (g, w) in enumerate(zip(got, wanted)) if g != w), min(len(got), len(wanted)))
                    what = (f"input {bad} ({step.inputs[bad]}) is {got[bad]} but the region was compiled for {wanted[bad]}"
                            if bad < min(len(got), len(wanted)) else f"it passes {len(got)} inputs to a region of {len(wanted)}")
                    raise BundleError(f"{where}, step {n} (region {step.region}): {what}. Running it would read or write "
                                      "out of bounds; the bundle's weights or manifest do not match its regions. Recompile it.")
                outputs = [(s.shape, s.dtype) for s in region.outputs]
            if len(outputs) != len(step.outputs):
                raise BundleError(f"{where}, step {n}: {len(step.outputs)} outputs named for {len(outputs)} produced.")
            bound = [name for i, name in enumerate(step.outputs) if name in known or name in step.outputs[:i]]
            if bound:
                raise BundleError(f"{where}, step {n}: output {bound[0]!r} is already bound (a weight, a step input or an "
                                  "earlier output), and each value is written once. Recompile the bundle.")
            known.update(zip(step.outputs, outputs))
        if method == "draft":  # k draft tokens for each block of k + 1 rows
            k = self.manifest.speculative
            wanted, what = ([bucket // (k + 1), k], "int64"), "draft tokens"
        elif method == "score":  # per row 2 top + 1 scores, then the last row's logits (models/prompt_scoring.py)
            width = bucket * (2 * self.manifest.prompt_logprobs + 1) + self.manifest.vocab_size
            wanted, what = ([width], "float32"), "scores and logits"
        else:
            wanted, what = ([1 if method == "prefill" else bucket, self.manifest.vocab_size], "float32"), "logits"
        if known.get(program.output) != wanted:
            raise BundleError(f"{where}: its output {program.output!r} is not the {wanted[1]} {wanted[0]} {what} the "
                              "engine reads; recompile the bundle.")

    def _resolve(self, key, program, functions, fixed) -> _Plan:
        slots = {name: i for i, name in enumerate(program.inputs)}
        held = {}  # slot -> the fixed tensor in it
        calls = []
        for step in program.steps:
            for name in step.inputs:
                if name in fixed and name not in slots:
                    slots[name] = len(slots)
                    held[slots[name]] = fixed[name]
            args = [slots[name] for name in step.inputs]
            first = len(slots)
            slots.update((name, first + i) for i, name in enumerate(step.outputs))
            outputs = slice(first, len(slots))
            if step.collective:
                spec = step.collective
                label = f"{spec['op']}:{spec['group']}"
                calls.append(_Call(lambda *xs, spec=spec: run_collective(spec, *xs), label, args, outputs))
            else:
                calls.append(_Call(functions[step.region], step.region, args, outputs))
        table = [held.get(slot) for slot in range(len(slots))]
        return _Plan(calls, table, slots[program.output])

    def run(self, step: Step) -> torch.Tensor | None:
        if step.method == "copy":  # (no program: the runtime copies the state itself)
            for name, tensor in self.state.items():
                for holder in self.state_holders:
                    holder.release_state(tensor)
                copy_state(tensor, self.entry_ratios.get(name), step)
            return None
        plan = self.plans.get(step.key)
        if plan is None:
            contexts = self.manifest.contexts.get(step.method)
            raise BundleError(f"{self.bundle}: no program for {step.method} with bucket {step.bucket}"
                              + (f" and context {step.context}" if step.context is not None else "")
                              + f"; compiled buckets are {self.manifest.buckets.get(step.method)}"
                              + (f", context buckets {contexts}." if contexts else "."))
        values = plan.table.copy()
        inputs = step.inputs()
        values[: len(inputs)] = inputs
        timed = self.host_seconds is not None or self.trace_events is not None
        for call in plan.calls:
            if timed:
                start = time.perf_counter()
                results = call.fn(*call.take(values))
                self._record(call.fingerprint, step, start, time.perf_counter())
            else:
                results = call.fn(*call.take(values))
            values[call.outputs] = results  # (as many as its slots: load checked the counts)
        return values[plan.output]

    def _record(self, fingerprint: str, step: Step, start: float, end: float):
        if self.host_seconds is not None:
            self.host_seconds[fingerprint] = self.host_seconds.get(fingerprint, 0.0) + end - start
        if self.trace_events is not None:
            self.trace_events.append({"name": fingerprint[:12], "cat": step.key, "ph": "X",
                                      "ts": start * 1e6, "dur": (end - start) * 1e6, "pid": self.rank, "tid": 0})

    def write_trace(self, path: Path):
        """Chrome trace format (load it in Perfetto or chrome://tracing)."""
        Path(path).write_text(json.dumps({"traceEvents": self.trace_events, "displayTimeUnit": "ms"}))


def _loading_bar(m, rank: int):
    """A bar over the bytes rank `rank` reads at load: its weights, then every region."""
    from tqdm import tqdm

    files = [m.weight_files[rank], *(r.file for r in m.regions.values())]
    return tqdm(total=sum(m.sizes[f] for f in files), unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                desc=f"loading {m.name}: weights and {len(m.regions)} regions", mininterval=0.5)


def _collective_output(spec: dict, value: tuple[list[int], str], where: str) -> tuple[list[int], str]:
    """(shape, dtype) after a collective: an all-reduce keeps it, an all-gather grows one dim."""
    shape, dtype = value
    if spec.get("op") == "all_gather":
        dim, size = spec.get("dim"), spec.get("group_size")
        if not isinstance(dim, int) or not isinstance(size, int) or not -len(shape) <= dim < len(shape) or size < 1:
            raise BundleError(f"{where}: all_gather {spec} has a bad dim or group_size; recompile the bundle.")
        shape = list(shape)
        shape[dim] *= size
    return shape, dtype


def admit(bundle: Path, rank: int, trust: Trust):
    """(manifest, each region's loader module) of a bundle this host and deployment accept, before
    anything loads: the manifest's signature and toolchain, the deployment's native-code policy
    over the whole bundle, and each backend's host check (kernels built for CPU features the host lacks)."""
    verify_key = read_key(trust.verify_key_file) if trust.verify_key_file else None
    manifest = read_manifest(bundle, toolchain_versions(), rank, verify_key)
    where = f"{bundle}/manifest.json"
    loaders = {fp: backend_module(r.backend, f"{where}: region {fp}") for fp, r in manifest.regions.items()}
    native = sorted({r.backend for fp, r in manifest.regions.items() if loaders[fp].NATIVE_CODE})
    refusal = trust.native_refusal(native) if native else None
    if refusal:
        raise BundleError(f"{where}: {refusal}")
    for module in set(loaders.values()):
        problem = module.host_problem(manifest.toolchain) if hasattr(module, "host_problem") else None
        if problem:
            raise BundleError(f"{where}: rank {rank}: {problem}")
    problem = layout_problem(manifest.model_config)
    if problem:
        raise BundleError(f"{where}: rank {rank}: {problem}")
    return manifest, loaders
