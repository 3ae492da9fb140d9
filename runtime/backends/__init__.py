"""Region loaders, one file per backend (`runtime/backends/<name>.py`), each with `load(path) -> callable`.

The callable takes the region's inputs positionally and returns a tuple of outputs. Loading
needs no compiler: the runtime never imports deepinfer.compiler."""

import importlib

from ..errors import DeepinferError


def load_region(backend: str, path):
    try:
        module = importlib.import_module(f"{__name__}.{backend}")
    except ModuleNotFoundError:
        raise DeepinferError(f"{path}: no runtime loader for backend {backend!r} (runtime/backends/{backend}.py).") from None
    return module.load(path)
