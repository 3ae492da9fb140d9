"""AOTInductor: C++ (CPU) or CUDA kernels packaged as a `.pt2`, loaded with aoti_load_package.

`backend.options` are passed as `inductor_configs` (e.g. {"max_autotune": true}). Weights are
region inputs, so nothing is baked into the shared object and one artifact serves every layer."""

import platform

import torch
import torch._inductor

EXTENSION = "aoti.pt2"


def unavailable():
    return None


def versions() -> dict:
    # CPU artifacts carry the host ISA in their build flags; the machine name keeps caches apart.
    return {"inductor_host": platform.machine()}


def compile(program, options: dict, out):
    from deepinfer.compiler.split import example_inputs

    program._example_inputs = (example_inputs(program), {})  # AOTInductor insists on having some
    torch._inductor.aoti_compile_and_package(program, package_path=str(out), inductor_configs=dict(options))
