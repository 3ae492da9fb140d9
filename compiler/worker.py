"""Compile one region in its own process, so a crashing or hanging backend takes only itself down.

    python -m deepinfer.compiler.worker REGION.ep.pt2 OUT --backend inductor --options '{}'

Exit 0 with OUT written (atomically), or non-zero with the backend's own error on stderr.

`options.inject_fault: {ops: [PREFIX, ...], action: segfault|hang|error|flaky}` is a TESTING AID
for the failure paths (reports, bisect): the worker fails when the region holds, for EVERY prefix,
a node whose target starts with it. `flaky` alternates segfault and error from one run to the
next (a counter file in the temp dir), to exercise non-determinism detection. Production recipes
never need it.
"""

import ctypes
import json
import os
import sys
import tempfile
import time
from pathlib import Path


from deepinfer.runtime.lifetime import die_with_parent

# Die with the compiler that started this worker, however it dies; armed before the slow torch
# import, so a compiler killed at once leaves no worker behind either.
if os.environ.get("DEEPINFER_COMPILER_PID"):
    die_with_parent()
    if os.getppid() != int(os.environ["DEEPINFER_COMPILER_PID"]):  # it died before the prctl took effect
        os._exit(1)

import click  # noqa: E402
import torch  # noqa: E402

import deepinfer.runtime.grouped_matmul  # noqa: E402, F401  (registers the ops a region may call, for torch.export.load)
import deepinfer.runtime.int_matmul  # noqa: E402, F401
from .backends import backend_module  # noqa: E402

INJECTED_ERROR_EXIT = 3


def inject_fault(program: torch.export.ExportedProgram, fault: dict):
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    if not all(any(t.startswith(prefix) for t in targets) for prefix in fault["ops"]):
        return
    action = fault.get("action", "error")
    if action == "flaky":
        counter = Path(tempfile.gettempdir()) / f"deepinfer-flaky-{'-'.join(fault['ops']).replace('/', '_')}"
        runs = int(counter.read_text()) + 1 if counter.exists() else 1
        counter.write_text(str(runs))
        action = "segfault" if runs % 2 else "error"
    if action == "segfault":
        sys.stderr.flush()
        ctypes.string_at(0)  # a real SIGSEGV in this process
    elif action == "hang":
        while True:
            time.sleep(60)
    print(f"error: NCC_INJ001: injected compiler fault on ops {fault['ops']}", file=sys.stderr)
    sys.exit(INJECTED_ERROR_EXIT)


@click.command()
@click.argument("region", type=click.Path(exists=True, dir_okay=False))
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--backend", required=True)
@click.option("--options", "options_json", default="{}")
def main(region, out, backend, options_json):
    options = json.loads(options_json)
    fault = options.pop("inject_fault", None)
    program = torch.export.load(region)
    if fault:
        inject_fault(program, fault)
    out = Path(out)
    # The artifact is written under its final name (in a private directory, then moved): backends
    # may record the file name inside the archive, and the bytes must not depend on this process.
    with tempfile.TemporaryDirectory(prefix=".partial-", dir=out.parent) as private:
        partial = Path(private) / out.name
        backend_module(backend).compile(program, options, partial)
        os.replace(partial, out)


if __name__ == "__main__":
    main()
