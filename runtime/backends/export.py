"""Serialized ExportedPrograms (`.ep.json`), run by PyTorch's eager kernels: the reference backend.

Loaded without `torch.export.load`, whose archive reader unpickles sample inputs and constants
(`torch.load(weights_only=False)` as a fallback): here the JSON is parsed, checked to hold only
operator calls (no guard code, no constants, no custom objects; torch.cond's branches likewise), and deserialized with empty
weights, so a tampered file cannot run Python."""

import json
from pathlib import Path

from torch._export.serde.serialize import SerializedArtifact, deserialize

from ..manifest import BundleError

ALLOWED_TARGETS = ("torch.ops.aten.", "torch.ops.prims.", "torch.ops.deepinfer.", "_operator.getitem")
COND = "torch.ops.higher_order.cond"  # its branches are graphs in its arguments, checked the same way


def load(path):
    path = Path(path)
    data = path.read_bytes()
    _check(path, data)
    module = deserialize(SerializedArtifact(data, {}, {}, None)).module()

    def call(*args):
        return tuple(module(*args))

    return call


def _check(path: Path, data: bytes):
    def refuse(what: str):
        raise BundleError(f"{path}: {what}; an export region is a plain operator graph. The file was not written by "
                             "deepinfer-compile (or was tampered with): recompile the bundle.")

    try:
        program = json.loads(data)
        graph = program["graph_module"]["graph"]
        nodes = graph["nodes"]
    except (ValueError, KeyError, TypeError):
        refuse("not a serialized ExportedProgram (JSON)")
    if program.get("guards_code"):
        refuse("it carries guard code")
    if graph.get("custom_obj_values") or graph.get("constants"):
        refuse("it carries constants or custom objects")
    _check_nodes(nodes, refuse)


def _check_nodes(nodes, refuse):
    if not isinstance(nodes, list):
        refuse("its graph has no node list")
    for node in nodes:
        target = node.get("target") if isinstance(node, dict) else None
        if target == COND:
            branches = [arg.get("arg", {}).get("as_graph") for arg in node.get("inputs") or [] if isinstance(arg, dict)]
            for branch in filter(None, branches):
                _check_nodes(branch.get("graph", {}).get("nodes") if isinstance(branch, dict) else None, refuse)
        elif not isinstance(target, str) or not target.startswith(ALLOWED_TARGETS):
            refuse(f"it calls {target!r}, which is not a PyTorch operator")
