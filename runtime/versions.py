"""The toolchain a bundle is tied to: stamped by the compiler, checked by every rank at load."""

import platform
from importlib.metadata import PackageNotFoundError, version

import torch


def toolchain_versions() -> dict:
    try:
        ours = version("deepinfer")
    except PackageNotFoundError:
        ours = "unknown"
    python = ".".join(platform.python_version_tuple()[:2])
    return {"torch": torch.__version__, "python": python, "deepinfer": ours}


def packing_problem(model_config: dict) -> str | None:
    """int4 weights (model.quantize: int4) are packed for the CPU kernel ATen picked where they
    were written (AVX-512 and AVX2 lay the codes out differently), recorded in the model config's
    quantization_config.packed_for; ATen here must pick the same one, or it reads them wrong."""
    quantization = model_config.get("quantization_config") or {}
    wanted, here = quantization.get("packed_for"), torch.backends.cpu.get_cpu_capability()
    if wanted is None or wanted == here:
        return None
    return (f"its int4 weights are packed for ATen's {wanted} kernel (manifest model_config.quantization_config.packed_for), "
            f"and ATen picks its {here} kernel on this host: it would read them wrong. Compile the recipe (or run "
            f"`deepinfer-compile weights`) on a host like this one, or run where ATen picks {wanted} "
            f"(ATEN_CPU_CAPABILITY={wanted.lower()} holds a newer CPU to it).")
