"""recipe -> bundle: plan (trace, split, fingerprint + dedup), compile unique regions, write the bundle.

    from deepinfer.compiler.build import compile_recipe
    summary = compile_recipe(load_recipe("recipes/tiny.yaml"), jobs=2)
"""

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from deepinfer.models import DTYPES, Layout
from deepinfer.models.prompt_scoring import TOP as SCORE_TOP
from deepinfer.runtime.errors import DeepinferError
from deepinfer.runtime.manifest import Manifest, Region, WeightTensor

from .backends import backend_module
from .bundle import check_output, output_lock, write_bundle
from .cache import CompileCache
from .footprint import check_fits
from .plan import Plan, check_random_weights_fit, compute_note, plan, recipe_layout, recipe_model, weights_note
from .pool import LOCAL, Executor, Job, JobResult, run_jobs
from .recipe import Recipe, RecipeError
from .split import export_region
from .tokenizer_files import tokenizer_files
from .trace_cache import cached_plan
from .weights import checkpoint_reader, int_quantized, model_reader, transformed, write_rank_files


class CompileFailed(DeepinferError):
    def __init__(self, failures: list[JobResult], timeout: float):
        self.failures = failures
        report = "\n\n".join(f.describe() for f in failures)
        if all(f.returncode is None for f in failures):
            advice = (f"Every failure is a timeout: the regions may simply need longer than --timeout {timeout:.0f} s on "
                      "this machine. Raise --timeout first; if they still hang, `deepinfer-compile bisect RECIPE` finds "
                      "the graph boundary that avoids the hang.")
        else:
            advice = "Run `deepinfer-compile bisect RECIPE` to find the graph boundary that avoids the failure."
        super().__init__(f"{len(failures)} region(s) failed to compile; no bundle was written. Regions that compiled "
                         f"are cached.\n\n{report}\n\n{advice}")


@dataclass
class Summary:
    programs: int
    steps: int
    unique_regions: int
    cache_hits: int
    compiled: int
    seconds: float
    bundle: Path
    compute: str | None = None  # the backend's note on what the weights compute in on this host, where it says
    weights: str = ""  # what the weights are stored as and the bytes a decode token reads (plan.weights_note)
    decode_bytes: int = 0  # weight bytes a batch-1 decode token reads on a rank
    plan_reused: bool = False  # the plan came from the trace cache: nothing was traced
    phases: dict[str, float] = field(default_factory=dict)  # seconds: plan, export, backend (summed over regions), write
    longest_region: tuple[float, str] = (0.0, "")  # (backend seconds, fingerprint) of the slowest region compiled

    def __str__(self) -> str:
        return (f"{self.programs} programs, {self.steps} region calls in schedules, {self.unique_regions} unique regions "
                f"({self.cache_hits} cache hits, {self.compiled} compiled{', plan from the trace cache' if self.plan_reused else ''}), "
                f"{self.seconds:.1f} s -> {self.bundle}" + (f"; {self.weights}" if self.weights else "")
                + (f"; {self.compute}" if self.compute else ""))

    def where_the_time_went(self) -> str:
        phases = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases.items())
        slowest = f" (slowest region {self.longest_region[1]}: {self.longest_region[0]:.1f} s)" if self.longest_region[1] else ""
        return f"time: {phases}{slowest}"


@dataclass
class Compiled:
    artifacts: dict[str, Path]  # fingerprint -> artifact in the cache
    hits: int
    export_seconds: float  # regions exported for their workers (or compiled in process)
    region_seconds: dict[str, float]  # fingerprint -> backend seconds, for each region compiled


class NotTraced(Exception):
    """A region to compile whose graph the plan does not hold (a stored plan): trace first."""


def compile_regions(recipe: Recipe, the_plan: Plan, cache: CompileCache, jobs: int, timeout: float,
                    progress: bool, executor: Executor = LOCAL) -> Compiled:
    """Artifact per unique region, from the cache or from a worker; raises CompileFailed. Each
    region is cached the moment its worker finishes, so an interrupted compile keeps it. A backend
    that only serializes (IN_PROCESS) has nothing to isolate and runs here, unless a fault is
    injected (the testing aid lives in the worker)."""
    backend = backend_module(recipe.backend)
    in_process = getattr(backend, "IN_PROCESS", False) and "inject_fault" not in the_plan.backend_options
    artifacts, todo, hits, seconds, started = {}, [], 0, {}, time.perf_counter()
    for fp in tqdm(the_plan.signatures, desc="exporting", unit="region", disable=not progress, leave=False):
        hit = cache.get(fp)
        if hit is not None:
            artifacts[fp], hits = hit, hits + 1
            continue
        graph_module = the_plan.regions.get(fp)
        if graph_module is None:
            raise NotTraced(fp)
        work = cache.work_dir(fp)
        out_file = work / f"{fp}.{backend.EXTENSION}"
        if in_process:
            region_start = time.perf_counter()
            backend.compile(export_region(graph_module), the_plan.backend_options, out_file)
            seconds[fp] = time.perf_counter() - region_start
            artifacts[fp] = cache.put(fp, out_file, {"backend": recipe.backend, "seconds": 0.0})
            cache.prune_work(work)
            continue
        torch.export.save(export_region(graph_module), work / "region.ep.pt2")
        todo.append(Job(fp, work / "region.ep.pt2", out_file, recipe.backend, the_plan.backend_options, work / "compile.log"))
    exported = time.perf_counter() - started - sum(seconds.values())  # (less what in-process compiles took)

    def store(result: JobResult):
        if result.ok:
            name = result.job.name
            seconds[name] = result.seconds
            artifacts[name] = cache.put(name, result.job.out_file, {"backend": recipe.backend, "seconds": round(result.seconds, 2)})
            cache.prune_work(result.job.log_file.parent)

    results = run_jobs(todo, jobs, timeout, progress, on_done=store, executor=executor, toolchain=the_plan.toolchain)
    failures = [r for r in results if not r.ok]
    if failures:
        raise CompileFailed(failures, timeout)
    return Compiled(artifacts, hits, exported, seconds)


def weight_writer(recipe: Recipe, the_plan: Plan):
    """write_weights(directory) for the bundle: per-rank files streamed from the checkpoint (only each
    rank's slices are read), or cut from the random model of a config + seed recipe."""
    layout, full = recipe_layout(recipe), the_plan.full_model
    read_slice = weight_reader(recipe, full, the_plan.weights, layout)
    return lambda directory: write_rank_files(directory, the_plan.weights, layout, full.config, read_slice)


def weight_reader(recipe: Recipe, full, specs, layout):
    """read_slice(name, rank) of the tensors `specs` names, from the checkpoint (against `full`, the
    float model's meta tensors) or the random model; int8/int4 codes are made as they are read."""
    checkpoint = recipe.model["checkpoint"]
    if checkpoint:
        reader = lambda layout: checkpoint_reader(Path(checkpoint), full, layout, DTYPES[recipe.dtype])  # noqa: E731
    else:
        model = recipe_model(recipe, "cpu", quantize=False)
        reader = lambda layout: model_reader(model, layout)  # noqa: E731
    read_slice = reader(layout)
    if recipe.model["quantize"]:
        whole = reader(Layout())
        read_slice = int_quantized(read_slice, lambda name: whole(name, 0), specs, layout, recipe.model["quantize_group"], full)
    transform = getattr(backend_module(recipe.backend), "transform_weight", None)
    if transform:
        read_slice = transformed(read_slice, transform, full)
    return read_slice


def compile_recipe(recipe: Recipe, jobs: int = 2, cache_dir: Path | None = None, timeout: float = 900,
                   progress: bool = True, sign_key: bytes | None = None, executor: Executor = LOCAL,
                   weights: bool = True) -> Summary:
    """Compile `recipe` into its output bundle, holding the output's lock throughout. `weights=False`
    (--no-weights) reads only the checkpoint's config.json and writes a bundle whose manifest says
    which weights each rank's file will hold; `deepinfer-compile weights` adds them."""
    if not weights and not recipe.model["checkpoint"]:
        raise RecipeError(f"{recipe.name}: --no-weights compiles for a checkpoint's weights, added later by `deepinfer-compile "
                          "weights`; this recipe's model.config gets random weights, which the compile itself makes. Drop "
                          "--no-weights, or give model.checkpoint.")
    with output_lock(recipe.output):
        return _compile_recipe(recipe, jobs, cache_dir, timeout, progress, sign_key, executor, weights)


def _compile_recipe(recipe, jobs, cache_dir, timeout, progress, sign_key, executor, weights) -> Summary:
    from deepinfer.runtime import knobs

    start = time.perf_counter()
    check_output(recipe.output)
    cache = CompileCache(cache_dir or knobs.cache_dir())
    the_plan, reused = cached_plan(recipe, cache, check_weights=weights)
    check_fits(recipe, the_plan)
    check_random_weights_fit(recipe, the_plan)
    try:
        planned = time.perf_counter()
        compiled = compile_regions(recipe, the_plan, cache, jobs, timeout, progress, executor)
    except NotTraced:  # a region the stored plan names left the cache since
        the_plan, reused = plan(recipe, check_weights=weights), False
        planned = time.perf_counter()
        compiled = compile_regions(recipe, the_plan, cache, jobs, timeout, progress, executor)
    regions_done = time.perf_counter()

    layout = recipe_layout(recipe)
    cfg = the_plan.model_config
    checkpoint = recipe.model["checkpoint"]
    carried = tokenizer_files(checkpoint)
    ext = backend_module(recipe.backend).EXTENSION
    regions = {fp: Region(f"regions/{fp}.{ext}", recipe.backend, signature.inputs, signature.outputs)
               for fp, signature in the_plan.signatures.items()}
    manifest = Manifest(
        name=recipe.name, recipe=recipe.raw, model_config=the_plan.model_config, toolchain=the_plan.toolchain,
        parallel=recipe.parallel, buckets=recipe.program_buckets(), contexts=recipe.program_contexts(), speculative=recipe.speculative,
        prompt_logprobs=SCORE_TOP if recipe.prompt_logprobs else 0, kv=the_plan.kv, state=the_plan.state, programs=the_plan.programs, regions=regions,
        weight_files=[f"weights/rank-{r}.safetensors" for r in range(layout.world_size)], tokenizer="tokenizer.json" if "tokenizer.json" in carried else None,
        vocab_size=cfg["vocab_size"], eos_token_id=cfg["eos_token_id"],
        chat_template="chat_template.json" if "chat_template.json" in carried else None,
        weight_specs=[WeightTensor(name, shape, str(dtype).removeprefix("torch.")) for name, shape, dtype in the_plan.weights],
    )
    write_bundle(recipe.output, manifest, compiled.artifacts, weight_writer(recipe, the_plan) if weights else None, carried, sign_key)
    steps = sum(len(p.steps) for p in the_plan.programs.values())
    end, region_seconds = time.perf_counter(), compiled.region_seconds
    phases = {"plan": planned - start, "export": compiled.export_seconds, "backend (regions summed)": sum(region_seconds.values()),
              "write": end - regions_done}
    longest = max(((s, fp) for fp, s in region_seconds.items()), default=(0.0, ""))
    return Summary(len(the_plan.programs), steps, len(the_plan.signatures), compiled.hits, len(the_plan.signatures) - compiled.hits,
                   end - start, recipe.output, compute_note(recipe, the_plan), weights_note(recipe, the_plan), the_plan.decode_bytes,
                   reused, phases, longest)
