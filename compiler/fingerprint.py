"""Structural fingerprints of regions: equal fingerprints compile to interchangeable artifacts.

Covered: every op and its literal arguments, the wiring between nodes (by position, not name),
input and output shapes, dtypes and strides, the backend, its options, and the toolchain
versions; a torch.cond branch by its own graph. Ignored: weight VALUES (weights are inputs), node names, source locations and module
paths — so all layers of a kind, and every rank, share one region.
"""

import hashlib
import json

import torch
from torch import fx


def fingerprint(graph_module: fx.GraphModule, backend: str, options: dict, toolchain: dict) -> str:
    payload = json.dumps({"graph": _graph(graph_module), "backend": backend, "options": options, "toolchain": toolchain},
                         sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def _graph(graph_module: fx.GraphModule) -> list:
    index = {}
    lines = []
    for i, node in enumerate(graph_module.graph.nodes):
        index[node] = i
        value = node.meta.get("val")
        if node.op == "placeholder":
            lines.append(["in", _tensor(value)])
        elif node.op == "output":
            lines.append(["out", _literal(node.args, index)])
        elif node.op == "call_function":
            lines.append([_target(node.target), _literal(node.args, index), _literal(node.kwargs, index), _value(value)])
        elif node.op == "get_attr" and isinstance(getattr(graph_module, node.target, None), fx.GraphModule):
            lines.append(["subgraph", _graph(getattr(graph_module, node.target))])  # a torch.cond branch: by its content
        else:  # weights are inputs, so nothing else is held; refuse rather than hash badly
            raise ValueError(f"cannot fingerprint a {node.op} node ({node.target}) in a region")
    return lines


def _target(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    if isinstance(target, torch._ops.HigherOrderOperator):  # torch.cond
        return f"higher_order.{target.name()}"
    return f"{target.__module__}.{target.__qualname__}"


def _tensor(value) -> list:
    if not isinstance(value, torch.Tensor):
        return [repr(value)]
    return [list(value.shape), str(value.dtype), list(value.stride()), str(value.device.type)]


def _value(value):
    if isinstance(value, (tuple, list)):
        return [_value(v) for v in value]
    return _tensor(value) if isinstance(value, torch.Tensor) else repr(value)


def _literal(arg, index):
    if isinstance(arg, fx.Node):
        return ["%", index[arg]]
    if isinstance(arg, (tuple, list)):
        return [_literal(a, index) for a in arg]
    if isinstance(arg, dict):
        return {k: _literal(v, index) for k, v in sorted(arg.items())}
    if isinstance(arg, (bool, int, float, str)) or arg is None:
        return arg
    return repr(arg)  # dtypes, devices, memory formats, layouts
