"""Compiler backends, one file each (`compiler/backends/<name>.py`), found by file convention.

The contract every backend module keeps, so the compile worker can drive any of them:

    EXTENSION: str                     file suffix of its artifacts under regions/
    unavailable() -> str | None        why it cannot run here (a missing package), or None
    versions() -> dict                 toolchain versions its artifacts are tied to (cache + manifest)
    options(user: dict) -> dict        the options it will really use (its defaults merged in); these,
                                       not the recipe's, go into fingerprints, so changed defaults miss the cache
    compile(program, options, out)     ExportedProgram of one region (weights are inputs) -> file `out`

Each has a loader of the same name under runtime/backends/ (`load(path) -> callable`).
"""

import importlib

BACKENDS = ("export", "inductor", "neuron")


def backend_module(name: str):
    return importlib.import_module(f"{__name__}.{name}")
