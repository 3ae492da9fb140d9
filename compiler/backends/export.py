"""A serialized ExportedProgram: no compilation at all. Fast, and the reference for the others."""

import torch

EXTENSION = "ep.pt2"


def unavailable():
    return None


def versions() -> dict:
    return {}


def options(user: dict) -> dict:
    return dict(user)


def compile(program, options: dict, out):
    if options:
        raise ValueError(f"the export backend takes no options, got {sorted(options)}")
    torch.export.save(program, str(out))
