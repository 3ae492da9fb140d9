"""AWS Neuron (Trainium, Inferentia): the pjrt backend's path with Neuron's PJRT plugin.

Each region is lowered to StableHLO exactly as for `pjrt` and compiled by the PJRT client of
platform `neuron`, which libneuronxla (Neuron's PJRT C-API plugin, from AWS's Neuron pip
repository) registers with jax; it runs neuronx-cc, whose flags it reads from the documented
NEURON_CC_FLAGS. The region file is a `.pjrt` like the pjrt backend's (serialized executable,
platform, plugin version, StableHLO), loaded by the same runtime code.

    backend: {name: neuron, options: {compiler_args: ["--target", "trn2", "-O2", "--lnc", "2"]}}

Weights are stored for trn2 (`transform_weight`: fp8 bytes re-encoded for IEEE e4m3 reading, see
neuron_fp8.py). `platform: cpu` compiles the same StableHLO, trn2 weights included, with XLA's
CPU client: the numerics of a Neuron bundle checked off Trainium (everything but neuronx-cc).
"""

import os
import shlex
from importlib.util import find_spec

from . import pjrt
from .neuron_fp8 import to_trn2 as transform_weight  # noqa: F401  (the contract's weight transform)

EXTENSION = pjrt.EXTENSION
PRELOAD = pjrt.PRELOAD
CONTROL_FLOW = pjrt.CONTROL_FLOW
CUSTOM_OPS = pjrt.CUSTOM_OPS
DEFAULTS = {"platform": "neuron", "compiler_args": []}


def unavailable(options: dict):
    missing = pjrt.unavailable(options)
    if missing:
        return missing
    if options.get("platform", "neuron") == "neuron" and find_spec("libneuronxla") is None:
        return ("libneuronxla (Neuron's PJRT plugin, which runs neuronx-cc) is not installed: it comes from AWS's Neuron "
                "pip repository on a Neuron host. Elsewhere compile with --backend pjrt or inductor, or with the neuron "
                "backend's option platform: cpu to check a Neuron bundle's numerics on XLA's CPU client.")
    return None


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = pjrt.versions()
    for package in ("libneuronxla", "neuronx-cc"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:  # (platform: cpu)
            pass
    return out


def options(user: dict) -> dict:
    return {**DEFAULTS, **user}


def options_problem(user: dict) -> str | None:
    unknown = sorted(str(k) for k in set(user) - set(DEFAULTS))
    if unknown:
        return f"the neuron backend takes {sorted(DEFAULTS)}, not {unknown}."
    args = user.get("compiler_args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        return f"compiler_args must be a list of neuronx-cc flags (strings), e.g. ['--target', 'trn2'], not {args!r}."
    if user.get("platform", "neuron") not in ("neuron", "cpu"):
        return f"platform is neuron (Trainium, Inferentia) or cpu (the same StableHLO on XLA's CPU client), not {user['platform']!r}."
    return None


def compile(program, options: dict, out):
    # The compile worker is this region's own process: the variable reaches only its neuronx-cc.
    os.environ["NEURON_CC_FLAGS"] = shlex.join(options["compiler_args"])
    pjrt.compile(program, {"platform": options["platform"]}, out)
