"""The toolchain a bundle is tied to: stamped by the compiler, checked by every rank at load."""

import platform
from importlib.metadata import PackageNotFoundError, version

import torch

from .int_matmul import INT4_LAYOUT, INT8_LAYOUT


def toolchain_versions() -> dict:
    try:
        ours = version("deepinfer")
    except PackageNotFoundError:
        ours = "unknown"
    python = ".".join(platform.python_version_tuple()[:2])
    return {"torch": torch.__version__, "python": python, "deepinfer": ours}


def layout_problem(model_config: dict) -> str | None:
    """int8 and int4 weights (model.quantize) must be in the layouts this runtime's kernels read
    (runtime/int_matmul.py, recorded as quantization_config.int8_layout and int4_layout; an int4
    bundle holds int8 layers too): a bundle written by an earlier deepinfer holds int8 rows in
    order, for ATen's kernel, and int4 ones maybe packed for ATen's."""
    quantization = model_config.get("quantization_config") or {}
    if quantization.get("weights") not in ("int8", "int4"):
        return None
    expected = {**({"int4_layout": INT4_LAYOUT} if quantization["weights"] == "int4" else {}), "int8_layout": INT8_LAYOUT}
    for key, layout in expected.items():
        if quantization.get(key) != layout:
            found = quantization.get(key) or "an earlier deepinfer's, for ATen's kernels"
            return (f"its {key.split('_')[0]} weights are in the layout {found} (manifest model_config.quantization_config.{key}), "
                    f"and this deepinfer's kernel reads {layout}: it would read them wrong. Compile the recipe again "
                    f"with this deepinfer.")
    return None
