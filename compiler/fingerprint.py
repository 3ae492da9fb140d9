"""Structural fingerprints of regions: equal fingerprints compile to interchangeable artifacts.

Covered: every op and its literal arguments, the wiring between nodes (by position, not name),
input and output shapes, dtypes and strides, the backend, its options, and the toolchain
versions. Ignored: weight VALUES (weights are inputs), node names, source locations and module
paths — so all layers of a kind, and every rank, share one region.
"""

import hashlib
import json

import torch
from torch import fx


def fingerprint(graph_module: fx.GraphModule, backend: str, options: dict, toolchain: dict) -> str:
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
        else:  # get_attr / call_module do not appear in exported regions; refuse rather than hash badly
            raise ValueError(f"cannot fingerprint a {node.op} node ({node.target}) in a region")
    payload = json.dumps({"graph": lines, "backend": backend, "options": options, "toolchain": toolchain}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def _target(target) -> str:
    return str(target) if isinstance(target, torch._ops.OpOverload) else f"{target.__module__}.{target.__qualname__}"


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
