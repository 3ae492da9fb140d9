"""A serialized ExportedProgram: no compilation at all. Fast, and the reference for the others.

The artifact is the program's JSON alone (`.ep.json`): no weights, constants or sample inputs,
so nothing in it is a pickle, and the runtime loads it without unpickling anything."""

from torch._export.serde.serialize import serialize

EXTENSION = "ep.json"
IN_PROCESS = True  # serialization only: nothing that can crash or hang, so no worker process
INT_WEIGHTS = True  # model.quantize int8/int4: our CPU kernels (runtime/int_matmul.py) run in its regions


def unavailable(options: dict):
    return None


def versions() -> dict:
    return {}


def options(user: dict) -> dict:
    return dict(user)


def options_problem(user: dict) -> str | None:
    return f"the export backend takes no options, got {sorted(user)}." if user else None


def compile(program, options: dict, out):
    if options:
        raise ValueError(f"the export backend takes no options, got {sorted(options)}")
    if program.state_dict or program.constants:
        raise ValueError("a region holds weights or constants; they must be inputs")
    for node in program.graph.nodes:
        node.meta.pop("stack_trace", None)  # source paths of this checkout: not part of the program
    with open(out, "wb") as f:
        f.write(serialize(program).exported_program)
