"""Region loaders, one file per backend (`runtime/backends/<name>.py`), each with
`load(data, region, where) -> callable` and `NATIVE_CODE`: whether its artifacts carry machine code;
optionally `release_state(tensor)`, for a backend that keeps state tensors in memory of its own:
put the current value back in the torch tensor, which the runtime is about to change itself; and
`host_problem(toolchain) -> str | None`: what this host lacks to run code compiled with the
manifest's toolchain (the CPU features its kernels were built for), checked before anything loads.

The callable takes the region's inputs positionally and returns a tuple of outputs. `data` is the
region file's bytes, already checked against the manifest (the bytes verified are the bytes
loaded). Loading needs no compiler: the runtime never imports deepinfer.compiler."""

import contextlib
import importlib
import pkgutil
import tempfile
from pathlib import Path

from ..errors import BundleError


def backend_names() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def backend_module(backend: str, where: str):
    """The loader module a manifest's backend name names; only the files in this folder qualify."""
    names = backend_names()
    if backend not in names:
        raise BundleError(f"{where}: backend {backend!r} is not one this runtime loads ({', '.join(names)}). The "
                          "manifest was not written by deepinfer-compile, or by a newer one: recompile the bundle.")
    return importlib.import_module(f"{__name__}.{backend}")


@contextlib.contextmanager
def private_copy(data: bytes, suffix: str):
    """`data` as a file in a directory only this user can reach, for loaders that need a path;
    removed afterwards (so what is loaded is the verified bytes, not the bundle's file again)."""
    with tempfile.TemporaryDirectory(prefix="deepinfer-region-") as directory:
        path = Path(directory) / f"region{suffix}"
        path.write_bytes(data)
        yield path
