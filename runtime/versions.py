"""The toolchain a bundle is tied to: stamped by the compiler, checked by every rank at load."""

import platform
from importlib.metadata import PackageNotFoundError, version

import torch

from .int4_matmul import LAYOUT


def toolchain_versions() -> dict:
    try:
        ours = version("deepinfer")
    except PackageNotFoundError:
        ours = "unknown"
    python = ".".join(platform.python_version_tuple()[:2])
    return {"torch": torch.__version__, "python": python, "deepinfer": ours}


def layout_problem(model_config: dict) -> str | None:
    """int4 weights (model.quantize: int4) must be in the layout this runtime's kernel reads
    (runtime/int4_matmul.LAYOUT, recorded as quantization_config.int4_layout): a bundle written
    by an earlier deepinfer holds them packed for ATen's kernel instead."""
    quantization = model_config.get("quantization_config") or {}
    if quantization.get("weights") != "int4" or quantization.get("int4_layout") == LAYOUT:
        return None
    found = quantization.get("int4_layout") or f"ATen's, packed for its {quantization.get('packed_for')} kernel"
    return (f"its int4 weights are in the layout {found} (manifest model_config.quantization_config.int4_layout), "
            f"and this deepinfer's int4 kernel reads {LAYOUT}: it would read them wrong. Compile the recipe again "
            f"with this deepinfer.")
