"""Tracing: one torch.export per distinct (unit kind, method, bucket, context), weights lifted to inputs.

The model's `prefill`/`decode` (and `draft`, with MTP modules) are drivers that only call
sub-modules (`embed`, `layers[i]`, `head`, `mtp[i]`: the model's direct children). We run each driver once on fake tensors with forward hooks on those sub-modules, which
records the program — the call sequence with each call's inputs and outputs by name — and gives
every call's example inputs. A unit KIND (e.g. `layer.moe`) is exported the first time it is
called; later calls of the same kind reuse that graph with their own weight and KV bindings.
With `split_layers: false` the whole method is one unit instead.

Value names: the Step fields (`tokens`, `positions`, `slots`, `read_slot`, `last_index`),
`kv.<layer>.<state name>` for the per-layer state the model declares (`model.state_specs`; under a
context bucket c, a view of its first c positions: models/state.py),
weights by their model name, and `<call path>:<output index>` for call outputs.
"""

import itertools
import re
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from deepinfer.models.state import context_view
from deepinfer.runtime.step import STEP_FIELDS, program_key


@dataclass
class Unit:
    key: str  # "<kind>/<program key>", e.g. "layer.moe/decode/4" or "layer.moe/decode/4/1024" (a context bucket)
    module_path: str  # where its nodes live in the model, "layers.*" for a layer kind
    program: torch.export.ExportedProgram
    weight_names: list[str]  # lifted parameter/buffer targets, relative to the unit's module
    arg_specs: list[tuple]  # (shape, dtype) of each tensor argument it was traced with


@dataclass
class UnitCall:
    unit: str  # Unit.key
    path: str  # the called module's path in the model, e.g. "layers.3" ("" for a whole method)
    inputs: list[str]  # names of its (flattened) tensor inputs
    outputs: list[str]
    weights: list[str]  # model weight names bound to the unit's lifted inputs, in order


@dataclass
class TracedProgram:
    method: str
    bucket: int
    context: int | None  # positions its state views hold (None: the whole pool)
    inputs: list[str]
    output: str
    calls: list[UnitCall] = field(default_factory=list)

    @property
    def key(self) -> str:
        return program_key(self.method, self.bucket, self.context)


class _Call(nn.Module):
    """Exports `module(*args)` (or `module.<method>(*step_inputs, state)`, the flat state tensors
    regrouped per layer by `state_sizes`) with the module's weights lifted."""

    def __init__(self, module: nn.Module, method: str | None = None, n_inputs: int = 0, state_sizes: tuple = ()):
        super().__init__()
        self.m, self.method, self.n_inputs, self.state_sizes = module, method, n_inputs, state_sizes

    def forward(self, *args):
        if self.method is None:
            return self.m(*args)
        flat, state = list(args[self.n_inputs :]), []
        for size in self.state_sizes:
            state.append(flat[:size])
            flat = flat[size:]
        return getattr(self.m, self.method)(*args[: self.n_inputs], state)


def example_step_inputs(method: str, bucket: int) -> list[torch.Tensor]:
    """Step inputs of one (method, bucket), in STEP_FIELDS order (int64 index tensors)."""
    sizes = {"tokens": bucket, "positions": bucket, "slots": bucket, "read_slot": 1, "last_index": 1, "targets": bucket}
    return [torch.zeros(sizes[name], dtype=torch.int64) for name in STEP_FIELDS[method]]


def trace_programs(model: nn.Module, buckets: dict[str, list[int]], contexts: dict[str, list[int]], max_seqs: int,
                   max_len: int, split_layers: bool = True) -> tuple[list[TracedProgram], dict[str, Unit]]:
    """Trace every (method, bucket, context) of a model whose weights are fake tensors; a method
    without context buckets is traced on the whole state pool."""
    fake_mode = model.embed.weight.fake_mode
    canonical = _canonical_names(model)
    units: dict[str, Unit] = {}
    programs = []
    specs = model.state_specs(max_seqs, max_len)
    state_names = [[f"kv.{i}.{s.name}" for s in layer] for i, layer in enumerate(specs)]
    with fake_mode, no_stack_traces():
        pool = model.new_state(max_seqs, max_len)
        for method, sizes in buckets.items():
            for bucket, context in itertools.product(sizes, contexts.get(method, [None])):
                state = [[context_view(t, s, context) for t, s in zip(ts, ss)] for ts, ss in zip(pool, specs)]
                inputs = example_step_inputs(method, bucket)
                trace = _record_driver if split_layers else _whole_method
                programs.append(trace(model, TracedProgram(method, bucket, context, list(STEP_FIELDS[method]), ""),
                                      inputs, state, state_names, units, canonical))
    return programs, units


@contextmanager
def no_stack_traces():
    """Export without recording each node's Python stack (a third of V4's trace time): nothing
    downstream reads it, and exported regions drop it anyway."""
    before = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = before


def _record_driver(model, program: TracedProgram, inputs, state, state_names, units, canonical) -> TracedProgram:
    paths = driver_modules(model)
    recorded = []  # (module, args, outputs) in call order
    running = []  # the driver-level call in progress: a sub-module it calls (an MTP module's embed) is inside it

    def enter(module, args):
        running.append(module)

    def leave(module, args, outputs):
        running.pop()
        if not running:
            recorded.append((module, args, outputs if isinstance(outputs, tuple) else (outputs,)))

    handles = [h for m in paths for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    try:
        with run_each_layer_kind_once(model.layers):
            result = getattr(model, program.method)(*inputs, state)
    finally:
        for handle in handles:
            handle.remove()

    names = {id(t): n for n, t in zip(program.inputs, inputs)}
    names.update({id(t): n for layer, layer_names in zip(state, state_names) for t, n in zip(layer, layer_names)})
    for module, args, outputs in recorded:
        path = paths[module]
        kind = f"layer.{module.kind}" if path.startswith("layers.") else path
        key = f"{kind}/{program.key}"
        if any(id(a) not in names for a in args):
            raise RuntimeError(f"{type(model).__name__}.{program.method}: {path} got a tensor no sub-module produced; "
                               "the driver must only call sub-modules (embed, layers, head).")
        if key not in units:
            units[key] = _export(_Call(module), args, key, re.sub(r"\.\d+$", ".*", path))
        elif units[key].arg_specs != _arg_specs(args):
            first, now = units[key].arg_specs, _arg_specs(args)
            i = next(i for i, (a, b) in enumerate(zip(first, now)) if a != b)
            said = [f"{list(shape)} {str(dtype).removeprefix('torch.')}" for shape, dtype in (now[i], first[i])]
            raise RuntimeError(f"{type(model).__name__}.{program.method}: {path} ({kind}) gets argument {i} as {said[0]} where an "
                               f"earlier layer of its kind got {said[1]}. Every layer of a kind must take the same shapes and "
                               "dtypes: its compiled region is shared.")
        out_names = [f"{path}:{j}" for j in range(len(outputs))]
        names.update({id(t): n for t, n in zip(outputs, out_names)})
        weights = [canonical[id(tensor_at(module, w))] for w in units[key].weight_names]
        program.calls.append(UnitCall(key, path, [names[id(a)] for a in args], out_names, weights))
    program.output = names[id(result)]
    return program


def driver_modules(model: nn.Module) -> dict[nn.Module, str]:
    """The sub-modules a driver calls, by path: each direct child of the model, a ModuleList's
    entries one by one ("layers.3", "mtp.0")."""
    paths = {}
    for name, child in model.named_children():
        entries = enumerate(child) if isinstance(child, nn.ModuleList) else [(None, child)]
        paths.update({module: name if i is None else f"{name}.{i}" for i, module in entries})
    return paths


@contextmanager
def run_each_layer_kind_once(layers: nn.ModuleList):
    """While the driver runs on fake tensors, a layer whose kind already ran on arguments of the
    same shapes returns new fake tensors shaped like that run's outputs instead of running again:
    its unit is traced once anyway, and running all 61 layers of a full-size model through fake
    tensors took most of a plan's time."""
    first_outputs = {}

    def memoized(layer, forward):
        def run(*args):
            key = (layer.kind, tuple((tuple(a.shape), a.dtype, a.stride()) for a in args))
            if key not in first_outputs:
                first_outputs[key] = forward(*args)
                return first_outputs[key]
            outputs = first_outputs[key]
            return tuple(map(torch.empty_like, outputs)) if isinstance(outputs, tuple) else torch.empty_like(outputs)
        return run

    for layer in layers:
        layer.forward = memoized(layer, layer.forward)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward  # the class's forward again


def _whole_method(model, program: TracedProgram, inputs, state, state_names, units, canonical) -> TracedProgram:
    key = f"model/{program.key}"
    flat = [t for layer in state for t in layer]
    wrapper = _Call(model, program.method, len(inputs), tuple(len(layer) for layer in state))
    units[key] = _export(wrapper, (*inputs, *flat), key, "")
    weights = [canonical[id(tensor_at(model, w))] for w in units[key].weight_names]
    arg_names = program.inputs + [n for layer in state_names for n in layer]
    program.calls.append(UnitCall(key, "", arg_names, ["model:0"], weights))
    program.output = "model:0"
    return program


def _export(wrapper: _Call, args, key: str, module_path: str) -> Unit:
    program = torch.export.export(wrapper, tuple(args), strict=False)
    weight_names = [spec.target.removeprefix("m.") for spec in program.graph_signature.input_specs
                    if spec.kind.name in ("PARAMETER", "BUFFER")]
    if any(spec.kind.name not in ("PARAMETER", "BUFFER", "USER_INPUT") for spec in program.graph_signature.input_specs):
        raise RuntimeError(f"{key}: the traced graph lifted a constant tensor; make it a buffer so it binds as a weight.")
    return Unit(key, module_path, program, weight_names, _arg_specs(args))


def _arg_specs(args) -> list[tuple]:
    return [(tuple(a.shape), a.dtype) for a in args]


def tensor_at(module: nn.Module, name: str) -> torch.Tensor:
    """The parameter or buffer `name` (dotted) of module."""
    owner, _, leaf = name.rpartition(".")
    return getattr(module.get_submodule(owner), leaf)


def _canonical_names(model: nn.Module) -> dict[int, str]:
    """Tensor id -> the one name it is stored under (tied weights share a name)."""
    names = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        names.setdefault(id(tensor), name)
    return names
