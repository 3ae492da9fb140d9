"""PJRT: each region lowered to StableHLO by torch-mlir's FX importer, then compiled ahead of time
by a PJRT plugin: jaxlib's XLA CPU client here; on Trainium the Neuron plugin (libneuronxla), on
NVIDIA GPUs jax's CUDA plugin -- the same StableHLO, another `platform` (the `xla` extra).

    backend: {name: pjrt, options: {platform: cpu}}

The artifact (runtime/backends/pjrt.py) keeps the serialized executable with the platform and
plugin version it was compiled for, and the StableHLO, which any PJRT platform can compile again.

Static-graph discipline: what cannot lower fails here, at compile time, by region, naming the op
(`deepinfer-compile bisect` then names its module) -- never at run time. Forms torch-mlir's
StableHLO lowering lacks or gets wrong are rewritten to equivalents (REWRITES: `topk(sorted=False)`,
whose order is unspecified, as a sorted one; `one_hot` as a comparison with `arange`; Python's
remainder; right shifts as floor division; unsigned compares widened); `torch.cond` (the MoE's overflow passes) has no
lowering: a recipe gets the form without it (`model.expert_overflow: always`) unless it says `branch`."""

import hashlib
import json
from importlib.metadata import version
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file

EXTENSION = "pjrt"
PRELOAD = ("torch_mlir.fx", "jax", "jax._src.lib.xla_client")  # ~1.6 s a worker otherwise
CONTROL_FLOW = False  # torch-mlir's importer lowers no torch.cond
CUSTOM_OPS = False  # nor a Python op (the MoE's exact form: runtime/grouped_matmul.py)
DEFAULTS = {"platform": "cpu"}
COND = torch.ops.higher_order.cond


class LoweringError(RuntimeError):
    """A region that does not lower to StableHLO; the message names the ops (one line: the
    compile report quotes the last line of the worker's log)."""


def unavailable(options: dict):
    missing = [name for name in ("torch_mlir", "jax", "jaxlib") if find_spec(name) is None]
    if missing:
        return f"{' and '.join(missing)} not installed: pip install 'deepinfer[xla]' (torch-mlir, jax and jaxlib)."
    return None


def versions() -> dict:
    # This file's rewrites change what a region lowers to: its source hash keys the cache too.
    source = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
    return {"torch-mlir": version("torch-mlir"), "jaxlib": version("jaxlib"), "pjrt_backend": source}


def options(user: dict) -> dict:
    return {**DEFAULTS, **user}


def options_problem(user: dict) -> str | None:
    unknown = sorted(str(k) for k in set(user) - set(DEFAULTS))
    if unknown:
        return f"the pjrt backend takes {sorted(DEFAULTS)}, not {unknown}."
    platform = user.get("platform", "cpu")
    if not isinstance(platform, str) or not platform.isidentifier():
        return f"platform is a PJRT platform name (cpu, cuda, neuron), not {platform!r}."
    return None


def _sorted_topk(x, k, dim=-1, largest=True, sorted=True):
    values, indices = torch.sort(x, dim, descending=largest)
    return values.narrow(dim, 0, k), indices.narrow(dim, 0, k)


def _one_hot(x, num_classes=-1):
    return (x.unsqueeze(-1) == torch.arange(num_classes, device=x.device)).to(torch.int64)


def _remainder(x, other):
    """Python's modulo (the divisor's sign): torch-mlir lowers aten.remainder to StableHLO's
    remainder, which is C's (the dividend's sign), wrong for negative operands."""
    return x - torch.div(x, other, rounding_mode="floor") * other


def _right_shift(x, bits):
    """x >> bits as floor division by 2 ** bits (the same for signed and unsigned integers):
    torch-mlir has no StableHLO lowering for shifts (V4's fp4 experts unpack two codes a byte)."""
    return torch.div(x, 1 << bits, rounding_mode="floor")


UNSIGNED = (torch.uint8, torch.uint16, torch.uint32)


def _widened(compare):
    """`compare` of unsigned integers made on them widened to int64: torch-mlir emits StableHLO
    compares of unsigned operands as SIGNED, which XLA's verifier refuses (V4's e8m0 scales: byte
    255 is NaN). Other operands: NotImplemented, so the op stays as it is."""
    def widened(x, other):
        unsigned = [isinstance(v, torch.Tensor) and v.dtype in UNSIGNED for v in (x, other)]
        if not any(unsigned):
            return NotImplemented
        return compare(*(v.to(torch.int64) if u else v for v, u in zip((x, other), unsigned)))
    return widened


COMPARISONS = [getattr(getattr(torch.ops.aten, name), form)
               for name in ("eq", "ne", "lt", "le", "gt", "ge") for form in ("Scalar", "Tensor")]
REWRITES = {torch.ops.aten.topk.default: _sorted_topk, torch.ops.aten.one_hot.default: _one_hot,
            torch.ops.aten.remainder.Scalar: _remainder, torch.ops.aten.remainder.Tensor: _remainder,
            torch.ops.aten.__rshift__.Scalar: _right_shift, torch.ops.aten.bitwise_right_shift.Tensor_Scalar: _right_shift,
            **{op: _widened(op) for op in COMPARISONS}}


def compile(program, options: dict, out):
    from torch_mlir import fx

    from deepinfer.runtime.backends.pjrt import compile_stablehlo, pjrt_client, plugin_version

    _refuse_control_flow(program)
    table = torch.export.default_decompositions()
    table.update(REWRITES)
    program = program.run_decompositions(table)
    mutated = _mutated_inputs(program)
    try:
        module = fx.export_and_import(program, output_type="stablehlo")
    except Exception as err:  # torch-mlir's lowering errors name IR, not the op: find the op
        raise LoweringError(_what_does_not_lower(program, err)) from None
    text = _aliased(module, mutated)
    client = pjrt_client(options["platform"])
    executable = client.serialize_executable(compile_stablehlo(client, text))
    save_file({"executable": np.frombuffer(executable, np.uint8), "stablehlo": np.frombuffer(text.encode(), np.uint8)},
              str(out), metadata={"platform": options["platform"], "platform_version": plugin_version(client),
                                  "mutated_inputs": json.dumps(mutated)})


def _refuse_control_flow(program):
    for node in program.graph.nodes:
        if node.target is COND:
            raise LoweringError(
                "torch.cond does not lower to StableHLO (a data-dependent "
                "branch; torch-mlir's importer has none): choose the model form without it in the recipe "
                "(the MoE's overflow passes: model.expert_overflow: always).")
        if getattr(node.target, "namespace", None) == "deepinfer":
            raise LoweringError(
                f"{node.target} is a host-side op of deepinfer's (the MoE's exact form) that does not lower to "
                "StableHLO: choose the grouped form in the recipe (model.expert_overflow: always).")


def _mutated_inputs(program) -> list[int]:
    """The input index of each state tensor the region updates: XLA programs are functional, so
    these come first among its outputs (torch.export puts mutations before user outputs)."""
    inputs = [spec.arg.name for spec in program.graph_signature.input_specs]
    specs = program.graph_signature.output_specs
    kinds = [spec.kind.name for spec in specs]
    if kinds != sorted(kinds, key=lambda kind: kind != "USER_INPUT_MUTATION"):
        raise LoweringError(f"output kinds {kinds}: state updates must precede the region's outputs.")
    return [inputs.index(spec.target) for spec in specs if spec.kind.name == "USER_INPUT_MUTATION"]


def _aliased(module, mutated: list[int]) -> str:
    """The StableHLO text with each updated state input marked as the same buffer as its new
    value (`tf.aliasing_output`: input `mutated[j]` is output j), so XLA writes the update in
    place into a buffer the runtime donates (runtime/backends/pjrt.py), instead of a new pool."""
    from torch_mlir import ir

    main = next(op for op in module.body.operations if op.operation.name == "func.func")
    with module.context:
        i32 = ir.IntegerType.get_signless(32)
        output_of = {index: ir.IntegerAttr.get(i32, j) for j, index in enumerate(mutated)}
        main.attributes["arg_attrs"] = ir.ArrayAttr.get(
            [ir.DictAttr.get({"tf.aliasing_output": output_of[k]} if k in output_of else {})
             for k in range(len(main.arguments))])
    return str(module)


def _what_does_not_lower(program, err: Exception) -> str:
    """Each distinct op of the region lowered on its own (its first use: seconds, where every
    use of every op took minutes on a V4 layer), to name the ones that fail."""
    from torch_mlir import fx

    failing, tried = [], set()
    for node in program.graph.nodes:
        if (node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload)
                or not isinstance(node.meta.get("val"), (torch.Tensor, tuple, list))  # (checks: no value of their own)
                or node.target in tried):
            continue
        tried.add(node.target)
        inputs = node.all_input_nodes
        try:
            fx.export_and_import(_OneOp(node), *[torch.zeros(n.meta["val"].shape, dtype=n.meta["val"].dtype) for n in inputs],
                                 output_type="stablehlo")
        except Exception:
            failing.append(str(node.target))
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if failing:
        return f"does not lower to StableHLO: {', '.join(sorted(set(failing)))} ({first})"
    return f"does not lower to StableHLO, though each op does alone: {first}"


class _OneOp(torch.nn.Module):
    """`node`'s call on its own, its tensor operands as arguments."""

    def __init__(self, node):
        super().__init__()
        self.node = node

    def forward(self, *tensors):
        position = {n: i for i, n in enumerate(self.node.all_input_nodes)}
        args, kwargs = torch.fx.node.map_arg((self.node.args, self.node.kwargs), lambda n: tensors[position[n]])
        return self.node.target(*args, **kwargs)
