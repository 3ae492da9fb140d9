"""Every DEEPINFER_* environment variable, read in this one place (each is listed in the README)."""

import os
from pathlib import Path

from .errors import DeepinferError


def _flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def host_timing() -> bool:
    """DEEPINFER_HOST_TIMING=1: add the host seconds spent in each region to --json's timing."""
    return _flag("DEEPINFER_HOST_TIMING")


def region_trace_path() -> Path | None:
    """DEEPINFER_REGION_TIMING=1 (or =PATH): write a Chrome-trace JSON of region calls (Perfetto).
    A PATH whose directory does not exist is an error here, before anything runs."""
    value = os.environ.get("DEEPINFER_REGION_TIMING", "")
    if value in ("", "0"):
        return None
    path = Path("deepinfer-region-trace.json" if value == "1" else value)
    if not path.parent.is_dir() or path.is_dir():
        raise DeepinferError(f"DEEPINFER_REGION_TIMING={value!r}: {path.parent} is not an existing directory to write "
                             "the trace file in; give a file path in one, or 1 for ./deepinfer-region-trace.json.")
    return path


def shared_memory_collectives() -> bool:
    """DEEPINFER_SHM_COLLECTIVES=0: keep the collectives of ranks on one host on gloo's sockets
    instead of shared memory (to compare, or to rule the transport out); each group's first rank's value counts."""
    return os.environ.get("DEEPINFER_SHM_COLLECTIVES", "1") != "0"


def collective_timeout_s() -> float:
    """DEEPINFER_COLLECTIVE_TIMEOUT=SECONDS: how long a rank waits in a collective for the others
    before the job stops with an error (default 300; a rank that stops responding ends the job then)."""
    return _seconds("DEEPINFER_COLLECTIVE_TIMEOUT", 300, "a rank may wait in a collective")


def startup_timeout_s() -> float:
    """DEEPINFER_STARTUP_TIMEOUT=SECONDS: how long ranks wait for each other to start, load their
    shard and meet (default 600; loading a large bundle on a busy host takes a while)."""
    return _seconds("DEEPINFER_STARTUP_TIMEOUT", 600, "ranks may take to start and meet")


def _seconds(name: str, default: float, what: str) -> float:
    value = os.environ.get(name) or str(default)
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < 1e9:
        raise DeepinferError(f"{name}={value!r}: give the seconds {what} as a positive number, e.g. 60, "
                             f"or unset it for the default of {default}.")
    return seconds


def cache_dir() -> Path:
    """DEEPINFER_CACHE_DIR: the compile cache (default: $XDG_CACHE_HOME/deepinfer or ~/.cache/deepinfer)."""
    if os.environ.get("DEEPINFER_CACHE_DIR"):
        return Path(os.environ["DEEPINFER_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "deepinfer"


def kernel_march() -> str:
    """DEEPINFER_KERNEL_MARCH: the -march the kernels built on the host (runtime/int_matmul.cpp)
    are compiled for: native (the default: this CPU), or e.g. haswell (AVX2) or x86-64 (none)."""
    return os.environ.get("DEEPINFER_KERNEL_MARCH") or "native"


def pjrt_recompile() -> bool:
    """DEEPINFER_PJRT_RECOMPILE=1: a pjrt region compiled for another plugin version is compiled
    here from the bundle's StableHLO at load (instead of refused)."""
    return _flag("DEEPINFER_PJRT_RECOMPILE")
