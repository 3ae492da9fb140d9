"""Numerics of the released models' full-size regions: every unique region of DeepSeek-V3 671B,
V4-Flash and V4-Pro at 64 ranks, compiled through the Neuron path's StableHLO by XLA's CPU client
(`backend: neuron` with `platform: cpu`), run against the same region run by PyTorch's eager
kernels (the export backend: the graphs our parity tests hold to transformers), on random weights
of a rank's real shapes, for rank 0 and the last rank.

    .venv/bin/python bench/full_size_numerics.py                    # all three, bf16 as released: ~25 minutes
    .venv/bin/python bench/full_size_numerics.py deepseek-v3-671b --dtype float32

A rank's weights at full size do not fit here (V4-Pro: 34 GiB), and do not need to: every layer
of a kind compiles to the same region, so the model is cut to its first layers, enough to hold
every layer kind (V3: the 3 dense layers and 2 MoE; V4: its hash-routed and learned-routed layers
of each attention kind), and the bench checks that the cut model's unique regions ARE the full
model's (same fingerprints, so the same compiled programs). Each program (a prefill chunk, then a
decode step at every context bucket) runs region after region on the eager outputs; each region
also runs compiled on the same inputs, and the row is its worst output or state tensor over every
call: max |compiled - eager| / max |eager|. Collectives are replaced by their single-rank value
(an all-reduce returns the rank's partial, an all-gather repeats it): both sides see the same
inputs, which is what a region's numerics need. Integer outputs (the routers' top-k) must agree
exactly except at near-ties; the row counts the entries that differ.

Random weights as released: fp8 weights from a unit normal with block scales of 1/sqrt(fan_in),
fp4 experts from random bytes with e8m0 scales of about 1/sqrt(fan_in), the rest as the model's
own init_random, per rank (the expert range a rank owns from models.parallel.rank_buffers).
"""

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch
import yaml

from deepinfer.compiler import backends as compiler_backends
from deepinfer.compiler.build import compile_regions
from deepinfer.compiler.cache import CompileCache
from deepinfer.compiler.plan import plan, recipe_layout
from deepinfer.compiler.recipe import load_recipe
from deepinfer.compiler.split import export_region
from deepinfer.compiler.trace import tensor_at
from deepinfer.models import ARCHS, arch_of, model_config
from deepinfer.models.checkpoint import init_buffers
from deepinfer.models.parallel import rank_buffers
from deepinfer.models.quantization import E8M0, FP4, FP8, SCALE_SUFFIX
from deepinfer.runtime.backends import backend_module
from deepinfer.runtime.backends.pjrt import release_state
from deepinfer.runtime.manifest import Region
from deepinfer.runtime.step import Step

ROOT = Path(__file__).resolve().parent.parent
# model -> layers kept: V3's 3 dense and 2 MoE layers; V4's first layers hold its 3 hash-routed
# layers and both attention kinds with learned routing after them.
MODELS = {"deepseek-v3-671b": 5, "deepseek-v4-flash": 6, "deepseek-v4-pro": 5}
TOLERANCE = {"bfloat16": 3e-2, "float32": 1e-4}  # of max |eager|, per tensor


def cut_recipe(model: str, dtype: str | None, layers: int | None, work: Path):
    """The full-size recipe (its config.json alone: --no-weights), backend neuron on XLA CPU, no
    per-rank memory check, the model cut to its first `layers` (None: whole)."""
    raw = yaml.safe_load((ROOT / "recipes" / "full-size" / f"{model}.yaml").read_text())
    config = json.loads((ROOT / raw["model"]["checkpoint"] / "config.json").read_text())
    if layers is not None:
        config["num_hidden_layers"] = layers
        if config.get("layer_types"):
            config["layer_types"] = config["layer_types"][:layers]
    checkpoint = work / f"{model}-{layers or 'all'}"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(config))
    raw["model"]["checkpoint"] = str(checkpoint)
    raw["parallel"].pop("device_memory_gib", None)
    raw.update(backend={"name": "neuron", "options": {"platform": "cpu"}}, output=str(work / "bundle"), dtype=dtype or raw["dtype"])
    path = checkpoint / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_recipe(path)


def rank_weights(recipe, the_plan, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s weights and buffers, by the names and shapes the plan's schedules read."""
    arch, layout = recipe.model["arch"], recipe_layout(recipe)
    config = model_config(arch, recipe.model["checkpoint"])
    with torch.device("meta"):
        model = arch_of(arch).model(config, layout)  # rank 0's shard shapes: every rank's
    model.to_empty(device="cpu").requires_grad_(False)
    ARCHS[arch].init_random(model, seed=rank)
    generator = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dtype in (FP8, FP4) or name.endswith(SCALE_SUFFIX):
                param.copy_(released_like(name, param, generator))
    init_buffers(model)
    own = rank_buffers(layout, config, rank)  # the experts this rank owns, its shared-expert share
    return {name: own.get(name.rpartition(".")[2], tensor_at(model, name)).to(dtype) for name, _, dtype in the_plan.weights}


def released_like(name: str, tensor: torch.Tensor, generator) -> torch.Tensor:
    """fp8 weights N(0, 1) with 1/sqrt(fan_in) block scales; fp4 codes uniform with e8m0 scales near
    1/sqrt(fan_in)."""
    if name.endswith(SCALE_SUFFIX):
        fan_in = tensor.shape[-1] * 128 if tensor.dtype != E8M0 else tensor.shape[-1] * 32
        if tensor.dtype == E8M0:  # 2 ** (byte - 127)
            return torch.full(tensor.shape, 127 + round(math.log2(1 / math.sqrt(fan_in))), dtype=E8M0)
        return (1 + 0.1 * torch.rand(tensor.shape, generator=generator)) / math.sqrt(fan_in)
    if tensor.dtype == FP8:
        return torch.randn(tensor.shape, generator=generator).clamp(-448, 448).to(FP8)
    return torch.randint(0, 256, tensor.shape, generator=generator, dtype=torch.uint8)  # fp4: two codes a byte


def region_pairs(recipe, the_plan, work: Path) -> dict[str, tuple]:
    """fingerprint -> (eager, compiled): the region as the export backend's runtime loads it, and
    compiled by the neuron backend (XLA CPU) in compile workers, as deepinfer-compile does."""
    compiled = compile_regions(recipe, the_plan, CompileCache(work / "cache"), jobs=2, timeout=3600, progress=True)
    export = compiler_backends.backend_module("export")
    pairs = {}
    for fp, signature in the_plan.signatures.items():
        region = Region(f"regions/{fp}", recipe.backend, signature.inputs, signature.outputs)
        graph = work / f"{fp}.ep.json"
        export.compile(export_region(the_plan.regions[fp]), {}, graph)
        pairs[fp] = (backend_module("export", fp).load(graph.read_bytes(), region, str(graph)),
                     backend_module(recipe.backend, fp).load(compiled.artifacts[fp].read_bytes(), region, fp))
    return pairs


def steps(recipe, vocab: int, generator) -> list[Step]:
    """A prefill chunk of slot 0 from position 0, then a decode step at every compiled decode bucket
    and context bucket: slot 0 goes on after its prompt, the other rows sit at random positions of
    the context (their state random, as a longer history would leave it)."""
    chunk, out = recipe.buckets["prefill"][-1], []
    out.append(Step("prefill", torch.randint(0, vocab, (chunk,), generator=generator), torch.arange(chunk),
                    torch.zeros(chunk, dtype=torch.int64), read_slot=torch.tensor([0]), last_index=torch.tensor([chunk - 1])))
    for bucket in recipe.buckets["decode"]:
        for context in recipe.contexts.get("decode") or [None]:
            top = context or recipe.kv["max_len"]
            positions = torch.cat([torch.tensor([chunk]), torch.randint(chunk, top, (bucket - 1,), generator=generator)])
            out.append(Step("decode", torch.randint(0, vocab, (bucket,), generator=generator), positions,
                            torch.arange(bucket) % recipe.kv["max_seqs"], context=context))
    return out


def random_state(the_plan, generator) -> dict[str, torch.Tensor]:
    state = {}
    for i, layer in enumerate(the_plan.state):
        for t in layer:
            dtype = getattr(torch, t.dtype)
            value = torch.randn(t.shape, generator=generator) if dtype.is_floating_point else torch.zeros(t.shape)
            state[f"kv.{i}.{t.name}"] = value.to(dtype)
    return state


def state_view(tensor: torch.Tensor, spec, context: int | None) -> torch.Tensor:
    return tensor.narrow(1, 0, context // spec.positions_per_entry) if context and spec.positions_per_entry else tensor


def single_rank(spec: dict, *xs):
    """A collective's value were every rank to hold what this one does (an all-reduce's partial
    kept as it is: the inputs both sides see are what matters here)."""
    if spec["op"] == "all_gather":
        return tuple(torch.cat([x] * spec["group_size"], dim=spec["dim"]) for x in xs)
    return xs


class Worst:
    """A region's worst tensor over its calls: max |compiled - eager| / max |eager|, and how many
    rows (entries of dim 0: tokens, for activations) are over the tolerance: a bf16 near-tie in a
    router flips one token's expert and moves that row alone; a wrong lowering moves them all."""

    def __init__(self, tolerance: float):
        self.tolerance, self.error, self.where, self.calls = tolerance, 0.0, "", 0
        self.rows_over, self.rows = 0, 0  # in the worst tensor
        self.int_differ, self.int_total = 0, 0

    def add(self, what: str, eager: torch.Tensor, compiled: torch.Tensor):
        if not eager.dtype.is_floating_point:
            self.int_differ += int((eager != compiled).sum())
            self.int_total += eager.numel()
            return
        scale = eager.abs().max().float().item() or 1.0
        per_row = (compiled.float() - eager.float()).abs().reshape(max(1, eager.shape[0] if eager.dim() else 1), -1).amax(dim=1) / scale
        error = per_row.max().item()
        if not error <= self.error:  # (a NaN is the worst)
            self.error, self.where = error, what
            self.rows_over, self.rows = int((~(per_row <= self.tolerance)).sum()), per_row.numel()


@torch.no_grad()
def run_rank(recipe, the_plan, pairs, rank: int, worst: dict, tolerance: float) -> float:
    """Every step's program region after region on rank `rank`'s weights; returns the seconds."""
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(1000 + rank)
    weights = rank_weights(recipe, the_plan, rank)
    state = random_state(the_plan, generator)
    specs = {f"kv.{i}.{t.name}": t for i, layer in enumerate(the_plan.state) for t in layer}
    for step in steps(recipe, the_plan.model_config["vocab_size"], generator):
        program = the_plan.programs[step.key]
        values = dict(zip(program.inputs, step.inputs()))
        values.update(weights)
        values.update({name: state_view(t, specs[name], step.context) for name, t in state.items()})
        for call in program.steps:
            args = [values[name] for name in call.inputs]
            if call.collective:
                values.update(zip(call.outputs, single_rank(call.collective, *args)))
                continue
            eager, compiled = pairs[call.region]
            for name, arg, spec in zip(call.inputs, args, the_plan.signatures[call.region].inputs):
                if (list(arg.shape), str(arg.dtype).removeprefix("torch.")) != (spec.shape, spec.dtype):
                    raise SystemExit(f"{step.key}: {name} is {list(arg.shape)} {arg.dtype}, region {call.region} wants {spec}")
            mutable = [i for i, name in enumerate(call.inputs) if name in state]
            theirs = list(args)
            for i in mutable:
                theirs[i] = args[i].clone()  # (the compiled side updates its own copy of the state)
            got = compiled(*theirs)
            want = eager(*args)
            row = worst.setdefault(call.region, Worst(tolerance))
            row.calls += 1
            for name, w, g in zip(call.outputs, want, got):
                row.add(f"{step.key} {name}", w, g)
            for i in mutable:
                release_state(theirs[i])
                # (less the last slot, the scratch one: it takes every write a rank discards, padding
                # rows and under cp the entries of other ranks' stripes, several to one place in no
                # defined order, and is never read)
                row.add(f"{step.key} {call.inputs[i]} (written)", args[i][:-1], theirs[i][:-1])
            values.update(zip(call.outputs, want))
    return time.perf_counter() - started


def check_model(model: str, dtype: str | None, ranks: str) -> None:
    with tempfile.TemporaryDirectory(prefix="deepinfer-numerics-") as work:
        work = Path(work)
        full = plan(cut_recipe(model, dtype, None, work), check_weights=False)
        recipe = cut_recipe(model, dtype, MODELS[model], work)
        the_plan = plan(recipe, check_weights=False)
        missing = set(full.signatures) - set(the_plan.signatures)
        if missing:
            raise SystemExit(f"{model}: the first {MODELS[model]} layers miss {len(missing)} of the full model's unique regions "
                             f"({', '.join(sorted(full.region_paths[fp] for fp in missing))}): keep more layers.")
        pairs = region_pairs(recipe, the_plan, work)
        last = recipe.parallel["world_size"] - 1
        tolerance = TOLERANCE[recipe.dtype]
        for rank in (0, last) if ranks == "both" else (int(ranks),):
            worst = {}
            seconds = run_rank(recipe, the_plan, pairs, rank, worst, tolerance)
            print(f"\n{model}, rank {rank} of {last + 1}, {recipe.dtype} ({len(the_plan.signatures)} unique regions = the full "
                  f"model's {len(full.signatures)}; {seconds:.0f} s)")
            print(f"  {'region':26s} {'module':24s} {'calls':>5s} {'max err / max|eager|':>20s} {'rows over':>10s} "
                  f"{'int differ':>11s}  worst tensor")
            for fp in the_plan.signatures:
                row = worst.get(fp)
                if row is None:
                    print(f"  {fp:26s} {the_plan.region_paths[fp]:24s} never called by these steps")
                    continue
                verdict = "ok" if row.error <= tolerance else f"OVER {tolerance:g}"
                ints = f"{row.int_differ}/{row.int_total}" if row.int_total else "-"
                print(f"  {fp:26s} {the_plan.region_paths[fp]:24s} {row.calls:5d} {row.error:20.2e} "
                      f"{f'{row.rows_over}/{row.rows}':>10s} {ints:>11s}  {row.where}  {verdict}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--dtype", choices=sorted(TOLERANCE), help="instead of the recipe's (bfloat16 as released)")
    parser.add_argument("--ranks", default="both", help="'both' (rank 0 and the last) or one rank number")
    args = parser.parse_args()
    torch.set_num_threads(2)
    for model in args.models:
        check_model(model, args.dtype, args.ranks)


if __name__ == "__main__":
    main()
