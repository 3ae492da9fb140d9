"""AWS Neuron (Trainium/Inferentia): a region traced by torch-neuronx into a NEFF.

Written against the documented `torch_neuronx.trace(module, example_inputs, compiler_args=...)`
API; it cannot run where torch-neuronx and neuronx-cc are absent (PyPI holds placeholders only),
and then says so instead of producing anything. `backend.options.compiler_args` is passed through
to neuronx-cc (e.g. ["--target", "trn2", "-O2", "--lnc", "2"])."""

import importlib.util

import torch

from .neuron_fp8 import to_trn2 as transform_weight  # noqa: F401  (the contract's weight transform)

EXTENSION = "neff.pt"


def unavailable():
    missing = [name for name in ("torch_neuronx", "neuronxcc") if importlib.util.find_spec(name) is None]
    if missing:
        return (f"{' and '.join(missing)} not installed. The neuron backend needs torch-neuronx and neuronx-cc from "
                "AWS's pip repository on a Neuron host; compile with --backend inductor or export elsewhere.")
    return None


def versions() -> dict:
    from importlib.metadata import version

    return {"torch-neuronx": version("torch-neuronx"), "neuronx-cc": version("neuronx-cc")}


def options(user: dict) -> dict:
    return dict(user)


def options_problem(user: dict) -> str | None:
    unknown = sorted(str(k) for k in set(user) - {"compiler_args"})
    if unknown:
        return f"the neuron backend takes compiler_args (a list of neuronx-cc flags), not {unknown}."
    args = user.get("compiler_args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        return f"compiler_args must be a list of strings, e.g. ['--target', 'trn2'], not {args!r}."
    return None


def compile(program, options: dict, out):
    import torch_neuronx

    from deepinfer.compiler.split import example_inputs

    traced = torch_neuronx.trace(program.module(), example_inputs(program), compiler_args=options.get("compiler_args", []))
    torch.jit.save(traced, str(out))
