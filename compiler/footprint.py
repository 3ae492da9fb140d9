"""What a recipe asks of each rank, known before anything compiles (`deepinfer-compile plan`).

From the traced plan (fake weights: shapes and dtypes only, no backend, nothing written): the
programs with their region calls and unique regions, and per rank the bytes of its weights, of
its state pool (the KV cache and what else a model keeps per sequence slot; the pool has
kv.max_seqs slots and one scratch slot) and of the largest tensor any region computes. With
`parallel.device_memory_gib` in the recipe, a rank fits when the three together do; they are a
floor (a backend adds its own workspace), so a layout that fails here fails on the device.
"""

from dataclasses import asdict, dataclass

import torch

from .plan import Plan, compute_note, plan, state_bytes, weights_note
from .recipe import Recipe, RecipeError
from .weights import file_bytes

GIB = 1 << 30


@dataclass
class RankFootprint:
    weight_bytes: int
    state_bytes: int  # the whole pool: kv.max_seqs slots + the scratch slot
    state_bytes_per_slot: int
    activation_bytes: int  # the largest tensor a region computes
    activation: str  # its shape, dtype and where: "[512, 7168] bfloat16, prefill/512 (layers.*)"

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.state_bytes + self.activation_bytes


def rank_footprint(recipe: Recipe, the_plan: Plan) -> RankFootprint:
    """One rank's needs; every rank's are the same (shards are even, the graph is shared)."""
    weights = file_bytes(the_plan.weights)
    pool = state_bytes(the_plan.state)
    size, where = the_plan.largest_activation
    return RankFootprint(weights, pool, pool // (recipe.kv["max_seqs"] + 1), size, where)


def report(recipe: Recipe) -> dict:
    """The plan as one JSON-able object (what `deepinfer-compile plan --json` prints)."""
    the_plan = plan(recipe, check_weights=False)
    rank = rank_footprint(recipe, the_plan)
    programs = []
    for key, program in the_plan.programs.items():
        calls = [step for step in program.steps if not step.collective]
        programs.append({"program": key, "region_calls": len(calls), "collectives": len(program.steps) - len(calls),
                         "unique_regions": len({step.region for step in calls})})
    budget = recipe.parallel["device_memory_gib"]
    p = recipe.parallel
    return {
        "recipe": recipe.name, "arch": recipe.model["arch"], "dtype": recipe.dtype, "backend": recipe.backend,
        "compute": compute_note(recipe, the_plan), "weights": weights_note(recipe, the_plan),
        "quantization": the_plan.model_config.get("quantization_config"), "decode_bytes_per_token": the_plan.decode_bytes,
        "parallel": {"world_size": p["world_size"], "tp": p["tp"], "ep": p["ep"], "cp": p["cp"]},
        "kv": dict(recipe.kv), "programs": programs, "unique_regions": len(the_plan.signatures),
        "region_calls": sum(row["region_calls"] for row in programs),
        "ranks": [{"rank": r, **asdict(rank), "total_bytes": rank.total_bytes} for r in range(p["world_size"])],
        "device_memory_gib": budget,
        "fits": None if budget is None else rank.total_bytes <= budget * GIB,
        "problem": None if budget is None else fit_problem(recipe, rank, budget),  # why it does not fit
    }


def check_fits(recipe: Recipe, the_plan: Plan):
    """Refuse, before any compile, a layout whose ranks cannot hold what the plan needs."""
    budget = recipe.parallel["device_memory_gib"]
    if budget is not None:
        problem = fit_problem(recipe, rank_footprint(recipe, the_plan), budget)
        if problem:
            raise RecipeError(problem)


def fit_problem(recipe: Recipe, rank: RankFootprint, budget: float) -> str | None:
    if rank.total_bytes <= budget * GIB:
        return None
    p, kv = recipe.parallel, recipe.kv
    return (f"{recipe.name}: each of the {p['world_size']} ranks (tp={p['tp']}, ep={p['ep']}) needs {_gib(rank.total_bytes)} "
            f"(weights {_gib(rank.weight_bytes)} + state pool {_gib(rank.state_bytes)} for kv.max_seqs={kv['max_seqs']} x "
            f"kv.max_len={kv['max_len']} + largest activation {_gib(rank.activation_bytes)}), more than "
            f"parallel.device_memory_gib={budget:g}. Use more ranks (a larger ep or tp shrinks the weights), fewer or "
            "shorter sequence slots (kv.max_seqs, kv.max_len), or smaller prefill buckets.")


def format_report(plan_report: dict) -> str:
    r = plan_report
    p = r["parallel"]
    cp = f", cp {p['cp']}" if p["cp"] > 1 else ""
    lines = [f"plan for {r['recipe']}: {r['arch']}, {r['dtype']}, backend {r['backend']}, world_size {p['world_size']} "
             f"(tp {p['tp']}, ep {p['ep']}{cp}), kv.max_seqs {r['kv']['max_seqs']} x kv.max_len {r['kv']['max_len']}; "
             "nothing compiled",
             f"{r['weights']}",
             *([f"compute: {r['compute']}"] if r["compute"] else []),
             f"{len(r['programs'])} programs, {r['region_calls']} region calls, {r['unique_regions']} unique regions",
             f"  {'program':<16} {'region calls':>12} {'collectives':>11} {'unique regions':>14}"]
    lines += [f"  {row['program']:<16} {row['region_calls']:>12} {row['collectives']:>11} {row['unique_regions']:>14}"
              for row in r["programs"]]
    rank = r["ranks"][0]
    lines += [f"per rank (all {p['world_size']} alike):",
              f"  weights             {_gib(rank['weight_bytes']):>12}",
              f"  state per slot      {_gib(rank['state_bytes_per_slot']):>12}",
              f"  state pool          {_gib(rank['state_bytes']):>12}  ({r['kv']['max_seqs']} slots + 1 scratch)",
              f"  largest activation  {_gib(rank['activation_bytes']):>12}  {rank['activation']}",
              f"  total               {_gib(rank['total_bytes']):>12}"]
    if r["device_memory_gib"] is not None:
        verdict = "fits" if r["fits"] else "DOES NOT FIT"
        lines.append(f"  of parallel.device_memory_gib {r['device_memory_gib']:g} GiB: {verdict}")
    return "\n".join(lines)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 2**20:.2f} MiB"
