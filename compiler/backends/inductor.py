"""AOTInductor: C++ kernels for the CPU packaged as a `.pt2`, loaded with aoti_load_package.
(CUDA bundles are not built yet: they need a GPU to compile and check on.)

`backend.options` are inductor configs (e.g. {"max_autotune": true}), merged over DEFAULTS.
Weights are region inputs, so nothing is baked into the shared object and one artifact serves
every layer."""

import platform

import torch
import torch._inductor

EXTENSION = "aoti.pt2"

# Decode multiplies 1..8 rows by each weight: memory-bound GEMVs, where a BLAS call reads the
# weight at a third of the bandwidth a fused multiply-reduce kernel gets on CPU. Inductor's mm
# decomposition pass makes that kernel (bench/decode_bench.py measures the effect); larger
# prefill chunks keep the BLAS call.
DEFAULTS = {
    "post_grad_fusion_options": {
        "decompose_mm_pass": {"cpu_max_first_dimension_decomposition": 8, "cpu_max_other_dimension_decomposition": 1 << 30},
    },
}


def unavailable():
    return None


def versions() -> dict:
    # CPU artifacts carry the host ISA in their build flags; the machine name keeps caches apart.
    return {"inductor_host": platform.machine()}


def options(user: dict) -> dict:
    return {**DEFAULTS, **user}


def compile(program, options: dict, out):
    from deepinfer.compiler.split import example_inputs

    # The decomposition pass reads its thresholds when its module is first imported, so they are
    # set globally before inductor loads it (this is the region's own worker process).
    torch._inductor.config.post_grad_fusion_options = options.get("post_grad_fusion_options", {})
    program._example_inputs = (example_inputs(program), {})  # AOTInductor insists on having some
    torch._inductor.aoti_compile_and_package(program, package_path=str(out), inductor_configs=dict(options))
