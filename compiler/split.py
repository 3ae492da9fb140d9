"""Splitting a traced unit into regions: at collective ops and at the recipe's forced boundaries.

A boundary is `{op: PREFIX, module: GLOB}`: a new region starts before every node whose target
(`aten.topk.default`) starts with PREFIX and, when given, whose module path matches GLOB. Module
paths are model paths with a layer kind's index as `*` (`layers.*.mlp.gate`), so a boundary
survives a re-trace and applies to every layer of the kind.

Every deepinfer collective (all_reduce, all_gather) becomes a piece of its own, which the
schedule runs as a collective step instead of compiling. Each region is a standalone GraphModule
whose inputs are the live values crossing into it.
`torch.fx.passes.split_module` does the cutting with keep_original_order=True, which keeps the
in-place KV store ahead of the reads that follow it.
"""

from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module

from deepinfer.runtime.collectives import COLLECTIVE_OPS

from .trace import no_stack_traces


@dataclass
class RegionGraph:
    graph_module: fx.GraphModule  # returns a tuple
    inputs: list[tuple]  # per input: ("unit", i) a unit input, or ("region", r, j) output j of region r
    n_outputs: int
    collective: dict | None = None  # {"op", "group", ...} when this piece is one collective, not a region


@dataclass
class UnitRegions:
    regions: list[RegionGraph]
    outputs: list[tuple]  # per unit output: ("region", r, j) or ("unit", i)


def module_path(node: fx.Node, unit_path: str) -> str:
    """'layers.*.mlp.gate' for a node traced inside `m.mlp.gate` of a unit at 'layers.*'."""
    stack = node.meta.get("nn_module_stack") or {}
    inner = list(stack.values())[-1][0] if stack else ""
    inner = inner.removeprefix("m").removeprefix(".")
    return ".".join(p for p in (unit_path, inner) if p)


def matches(node: fx.Node, boundary: dict, unit_path: str) -> bool:
    if node.op != "call_function" or not str(node.target).startswith(boundary["op"]):
        return False
    return "module" not in boundary or fnmatchcase(module_path(node, unit_path), boundary["module"])


def boundary_matches(graph_module: fx.GraphModule, boundary: dict, unit_path: str) -> bool:
    """Whether a boundary matches any node of a traced unit."""
    return any(matches(node, boundary, unit_path) for node in graph_module.graph.nodes)


def collective_of(node: fx.Node) -> dict | None:
    """{"op": "all_reduce", "group": "tp", ...} for a deepinfer collective node, else None."""
    op = COLLECTIVE_OPS.get(str(node.target)) if node.op == "call_function" else None
    if op is None:
        return None
    schema = node.target._schema.arguments
    return {"op": op, **{arg.name: value for arg, value in zip(schema[1:], node.args[1:])}}


def split_unit(graph_module: fx.GraphModule, unit_path: str, boundaries: list[dict], state_free_from: str | None = None,
               context_inputs: frozenset[int] = frozenset()) -> UnitRegions:
    """Cut before every boundary match, and around every collective (which becomes its own piece).

    Under context buckets, also cut where a region that read a context-sized state input (the
    placeholders at `context_inputs`) enters module `state_free_from` (a glob): what follows reads
    no state, so it is the same graph for every context and compiles once."""
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    context_nodes = {placeholders[i] for i in context_inputs}
    partition, has_compute, after_collective, read_context = 0, False, False, False
    partition_of = {}
    for node in graph_module.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        collective = collective_of(node) is not None
        leaves_state = (read_context and state_free_from is not None and node.op == "call_function"
                        and fnmatchcase(module_path(node, unit_path), state_free_from))
        if has_compute and (collective or after_collective or leaves_state or any(matches(node, b, unit_path) for b in boundaries)):
            partition, has_compute, read_context = partition + 1, False, False
        partition_of[node] = partition
        has_compute = has_compute or node.op == "call_function"
        read_context = read_context or any(a in context_nodes for a in node.all_input_nodes)
        after_collective = collective

    split = split_module(graph_module, None, lambda node: partition_of[node], keep_original_order=True)
    placeholders = {node: i for i, node in enumerate(n for n in split.graph.nodes if n.op == "placeholder")}
    region_of = {}  # call_module node -> region index
    regions = []

    def ref(arg) -> tuple:
        if arg in placeholders:
            return ("unit", placeholders[arg])
        if arg in region_of:
            return ("region", region_of[arg], 0)
        if arg.op == "call_function" and arg.args[0] in region_of:  # getitem(submod, j)
            return ("region", region_of[arg.args[0]], arg.args[1])
        raise AssertionError(f"unexpected value {arg} between regions")

    for node in split.graph.nodes:
        if node.op == "call_module":
            submodule = getattr(split, node.target)
            n_outputs = _outputs_as_tuple(submodule)
            calls = [n for n in submodule.graph.nodes if n.op == "call_function"]
            collective = collective_of(calls[0]) if len(calls) == 1 else None
            regions.append(RegionGraph(submodule, [ref(a) for a in node.args], n_outputs, collective))
            region_of[node] = len(regions) - 1
    (returned,) = split.graph.output_node().args
    outputs = [ref(a) for a in (returned if isinstance(returned, (tuple, list)) else [returned])]
    return UnitRegions(regions, outputs)


def _outputs_as_tuple(graph_module: fx.GraphModule) -> int:
    """Make the region return a tuple even for one output, so every backend sees the same calling
    convention; returns the number of outputs."""
    output = graph_module.graph.output_node()
    (returned,) = output.args
    if not isinstance(returned, (tuple, list)):
        output.args = ((returned,),)
        graph_module.recompile()
        return 1
    return len(returned)


class _RegionModule(nn.Module):
    def __init__(self, graph_module: fx.GraphModule):
        super().__init__()
        self.graph_module = graph_module

    def forward(self, *args):
        return tuple(self.graph_module(*args))


def input_values(graph_module: fx.GraphModule) -> list:
    """The fake tensors recorded on the region's placeholders."""
    return [n.meta["val"] for n in graph_module.graph.nodes if n.op == "placeholder"]


def output_values(graph_module: fx.GraphModule) -> list:
    (returned,) = graph_module.graph.output_node().args
    return [n.meta["val"] for n in returned]


def export_region(graph_module: fx.GraphModule) -> torch.export.ExportedProgram:
    """The region as a standalone ExportedProgram with no weights inside (all are inputs)."""
    with no_stack_traces():
        program = torch.export.export(_RegionModule(graph_module), tuple(input_values(graph_module)), strict=False)
    program._example_inputs = None  # fake tensors: not serializable, and no backend needs them
    return program


def example_inputs(program: torch.export.ExportedProgram) -> tuple:
    """Zero tensors with the region's input shapes, for backends that trace with real inputs."""
    specs = [n.meta["val"] for n in program.graph.nodes if n.op == "placeholder"]
    return tuple(torch.zeros(v.shape, dtype=v.dtype) for v in specs)
