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
