"""Compiler backends, one file each (`compiler/backends/<name>.py`), found by file convention.

The contract every backend module keeps, so the compile worker can drive any of them:

    EXTENSION: str                     file suffix of its artifacts under regions/
    unavailable() -> str | None        why it cannot run here (a missing package), or None
    versions() -> dict                 toolchain versions its artifacts are tied to (cache + manifest)
    options(user: dict) -> dict        the options it will really use (its defaults merged in); these,
                                       not the recipe's, go into fingerprints, so changed defaults miss the cache
    options_problem(user: dict) -> str | None
                                       what is wrong with the recipe's options (an unknown key), checked
                                       before anything compiles
    compile(program, options, out)     ExportedProgram of one region (weights are inputs) -> file `out`

Each has a loader of the same name under runtime/backends/ (`load(path) -> callable`).
"""

import importlib

BACKENDS = ("export", "inductor", "neuron")


def backend_module(name: str):
    return importlib.import_module(f"{__name__}.{name}")


FAULT_ACTIONS = ("segfault", "hang", "error", "flaky")


def fault_problem(fault) -> str | None:
    """What is wrong with a testing `inject_fault: {ops: [PREFIX, ...], action: ...}`, or None."""
    if (not isinstance(fault, dict) or not set(fault) <= {"ops", "action"} or not isinstance(fault.get("ops"), list)
            or not fault["ops"] or not all(isinstance(op, str) and op for op in fault["ops"])
            or fault.get("action", "error") not in FAULT_ACTIONS):
        return f"inject_fault is {{ops: [OP_PREFIX, ...], action: {' | '.join(FAULT_ACTIONS)}}}, not {fault!r}."
    return None
