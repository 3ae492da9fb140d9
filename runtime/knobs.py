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
    """DEEPINFER_REGION_TIMING=1 (or =PATH): write a Chrome-trace JSON of region calls (Perfetto)."""
    value = os.environ.get("DEEPINFER_REGION_TIMING", "")
    if value in ("", "0"):
        return None
    return Path("deepinfer-region-trace.json" if value == "1" else value)


def collective_timeout_s() -> float:
    """DEEPINFER_COLLECTIVE_TIMEOUT=SECONDS: how long a rank waits in a collective for the others
    before the job stops with an error (default 300; a rank that stops responding ends the job then)."""
    value = os.environ.get("DEEPINFER_COLLECTIVE_TIMEOUT") or "300"
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise DeepinferError(f"DEEPINFER_COLLECTIVE_TIMEOUT={value!r}: give the seconds a rank may wait in a "
                             "collective as a positive number, e.g. 60, or unset it for the default of 300.")
    return seconds


def cache_dir() -> Path:
    """DEEPINFER_CACHE_DIR: the compile cache (default: $XDG_CACHE_HOME/deepinfer or ~/.cache/deepinfer)."""
    if os.environ.get("DEEPINFER_CACHE_DIR"):
        return Path(os.environ["DEEPINFER_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "deepinfer"
