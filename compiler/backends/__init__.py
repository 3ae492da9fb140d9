"""Compiler backends, one file each (`compiler/backends/<name>.py`), found by file convention.

The contract every backend module keeps, so the compile worker can drive any of them:

    EXTENSION: str                     file suffix of its artifacts under regions/
    IN_PROCESS: bool (optional)        it only serializes: compile in the compiler's process, no worker
    PRELOAD: tuple (optional)          modules the workers' fork server imports once (heavy, thread-free)
    CONTROL_FLOW: bool (optional)      False: it compiles no torch.cond, so a recipe that does not say
                                       model.expert_overflow gets the MoE form without it (always)
    CUSTOM_OPS: bool (optional)        False: its regions cannot call deepinfer's compute ops
                                       (runtime/grouped_matmul.py), so a recipe that does not say
                                       model.expert_overflow gets the grouped MoE form (branch or always)
    unavailable(options) -> str | None why it cannot run here with these (the recipe's) options:
                                       a missing package, or None
    versions() -> dict                 toolchain versions its artifacts are tied to (cache + manifest)
    options(user: dict) -> dict        the options it will really use (its defaults merged in); these,
                                       not the recipe's, go into fingerprints, so changed defaults miss the cache
    options_problem(user: dict) -> str | None
                                       what is wrong with the recipe's options (an unknown key), checked
                                       before anything compiles (the testing aid inject_fault is checked
                                       here, by options_problem, and never reaches the backend's)
    compile(program, options, out)     ExportedProgram of one region (weights are inputs) -> file `out`
    compute_note(toolchain, dtype: str, kept_quantized: bool) -> str | None (optional)
                                       what its regions compute a model stored in `dtype` (with fp8/fp4
                                       weights kept quantized) in, given the toolchain its versions()
                                       recorded, where that is worth saying (compile summary and plan)
    transform_weight(name, tensor, scales_for) -> tensor (optional; scales_for: the dtype of the
                                       weight a `_scale_inv` tensor scales, else None)
                                       how the bundle stores a weight for this backend's hardware
                                       (neuron: fp8 re-encoded for trn2), applied as weights are written

Each has a loader of the same name under runtime/backends/ (`load(data, region, where) -> callable`,
and `NATIVE_CODE`: whether its artifacts are machine code).
"""

import importlib

BACKENDS = ("export", "inductor", "neuron", "pjrt")


def backend_module(name: str):
    return importlib.import_module(f"{__name__}.{name}")



FAULT_ACTIONS = ("segfault", "hang", "error", "flaky")


def options_problem(name: str, options: dict) -> str | None:
    """What is wrong with backend `name`'s options from a recipe, or None."""
    options = dict(options)
    fault = options.pop("inject_fault", None)
    if fault is not None and (
            not isinstance(fault, dict) or not set(fault) <= {"ops", "action"} or not isinstance(fault.get("ops"), list)
            or not fault["ops"] or not all(isinstance(op, str) and op for op in fault["ops"])
            or fault.get("action", "error") not in FAULT_ACTIONS):
        return f"inject_fault is {{ops: [OP_PREFIX, ...], action: {' | '.join(FAULT_ACTIONS)}}}, not {fault!r}."
    return backend_module(name).options_problem(options)
