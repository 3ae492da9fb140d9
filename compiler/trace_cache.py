"""The trace-level cache: a compile whose inputs are those of an earlier one reuses its plan
instead of tracing the model again, when every region the plan names is still in the compile cache.

The key covers everything a plan is made of: the recipe (its checkpoint path aside), the
checkpoint's config.json, the source of deepinfer's models, compiler and runtime (any edit
retraces), the backend and its options, and the toolchain the regions are fingerprinted with
(torch, Python, deepinfer, the backend's versions). A stored plan is the plan without its traced
graphs: schedules, region signatures, state, weight specs and the largest activation (what the
bundle and the fit check need). A region missing from the compile cache needs its graph, so then
the model is traced as on a cold compile. Plans live beside the regions, under `plans/`, written
atomically; one that cannot be read is traced again."""

import functools
import hashlib
import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from deepinfer.models.checkpoint import read_config
from deepinfer.runtime.errors import DeepinferError
from deepinfer.runtime.manifest import KVSpec, Program, StateTensor, typed_value

from .cache import CompileCache
from .plan import Plan, RegionSignature, plan, plan_toolchain, recipe_model
from .recipe import Recipe

PACKAGE = Path(__file__).resolve().parent.parent  # models/, compiler/, runtime/
SOURCE_DIRS = ("models", "compiler", "runtime")


@functools.cache
def source_digest() -> str:
    """sha256 over deepinfer's Python source (the code a plan comes from)."""
    digest = hashlib.sha256()
    for path in sorted(p for d in SOURCE_DIRS for p in (PACKAGE / d).rglob("*.py")):
        digest.update(str(path.relative_to(PACKAGE)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def trace_key(recipe: Recipe) -> str:
    model = {k: v for k, v in recipe.raw["model"].items() if k != "checkpoint"}
    checkpoint = recipe.model["checkpoint"]
    body = {"recipe": {**{k: v for k, v in recipe.raw.items() if k != "output"}, "model": model},
            "config": read_config(Path(checkpoint)) if checkpoint else None,
            "backend": [recipe.backend, recipe.backend_options], "source": source_digest(), "toolchain": plan_toolchain(recipe)}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:32]


def cached_plan(recipe: Recipe, cache: CompileCache, check_weights: bool = True) -> tuple[Plan, bool]:
    """(the plan, whether it came from the trace cache): the stored one when its key matches and
    every region it names is in the compile cache, else a traced one (then stored)."""
    from deepinfer.models import check_checkpoint

    path = cache.root / "plans" / f"{trace_key(recipe)}.json"
    stored = _read(path)
    if stored is not None and all(cache.has(fp) for fp in stored.signatures):
        stored.full_model = recipe_model(recipe, "meta", quantize=False)
        if recipe.model["checkpoint"] and check_weights:
            check_checkpoint(recipe.model["checkpoint"], stored.full_model)
        return stored, True
    the_plan = plan(recipe, check_weights)
    _write(path, _body_of(the_plan))
    return the_plan, False


def _body_of(p: Plan) -> dict:
    return {"programs": {k: asdict(v) for k, v in p.programs.items()},
            "signatures": {fp: asdict(s) for fp, s in p.signatures.items()}, "toolchain": p.toolchain,
            "backend_options": p.backend_options, "region_paths": p.region_paths,
            "weights": [[name, shape, str(dtype).removeprefix("torch.")] for name, shape, dtype in p.weights],
            "kv": asdict(p.kv), "state": [[asdict(t) for t in layer] for layer in p.state], "model_config": p.model_config,
            "decode_bytes": p.decode_bytes, "largest_activation": list(p.largest_activation)}


def _plan_of(body: dict) -> Plan:
    return Plan(programs=typed_value(body["programs"], dict[str, Program], "plan.programs"), regions={},
                signatures=typed_value(body["signatures"], dict[str, RegionSignature], "plan.signatures"),
                toolchain=body["toolchain"], backend_options=body["backend_options"], region_paths=body["region_paths"],
                weights=[(name, shape, getattr(torch, dtype)) for name, shape, dtype in body["weights"]],
                kv=typed_value(body["kv"], KVSpec, "plan.kv"), state=typed_value(body["state"], list[list[StateTensor]], "plan.state"),
                model_config=body["model_config"], decode_bytes=body["decode_bytes"], largest_activation=tuple(body["largest_activation"]), full_model=None)


def _read(path: Path) -> Plan | None:
    """The stored plan (its full_model yet to be built), or None when there is none or it cannot be read."""
    try:
        return _plan_of(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError, DeepinferError):
        return None


def _write(path: Path, body: dict):
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, staged = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(body, f)
    os.replace(staged, path)
