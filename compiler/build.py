"""recipe -> bundle: trace, split, fingerprint + dedup, compile unique regions, write the bundle.

    from deepinfer.compiler.build import compile_recipe
    summary = compile_recipe(load_recipe("recipes/tiny.yaml"), jobs=2)
"""

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from deepinfer.models import DTYPES, Layout, LayoutError, build_model, check_checkpoint, read_weight, stored_dtype
from deepinfer.models.quantization import SCALE_SUFFIX
from deepinfer.models.checkpoint import SafetensorsDir
from deepinfer.models.parallel import shard
from deepinfer.models.prompt_scoring import TOP as SCORE_TOP
from deepinfer.runtime.errors import DeepinferError
from deepinfer.runtime.manifest import KVSpec, Manifest, Program, Region, ScheduleStep, StateTensor, TensorSpec
from deepinfer.runtime.versions import toolchain_versions

from . import trace
from .backends import backend_module
from .bundle import check_output, output_lock, write_bundle
from .cache import CompileCache
from .fingerprint import fingerprint
from .pack import pack_collectives
from .pool import LOCAL, Executor, Job, JobResult, run_jobs
from .recipe import Recipe, RecipeError
from .split import boundary_matches, export_region, input_values, output_values, split_unit
from .tokenizer_files import tokenizer_files
from .weights import write_rank_files


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
class Plan:
    """What a recipe compiles to, before any backend work."""

    programs: dict[str, Program]
    regions: dict[str, object]  # fingerprint -> region GraphModule (one per unique region)
    toolchain: dict
    backend_options: dict  # the backend's defaults merged with the recipe's
    region_paths: dict  # fingerprint -> module path of the unit it came from ("layers.*"), for bisect
    weight_names: list[str]
    kv: KVSpec
    state: list[list[StateTensor]]
    model_config: dict


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

    def __str__(self) -> str:
        return (f"{self.programs} programs, {self.steps} region calls in schedules, {self.unique_regions} unique regions "
                f"({self.cache_hits} cache hits, {self.compiled} compiled), {self.seconds:.1f} s -> {self.bundle}"
                + (f"; {self.compute}" if self.compute else ""))


def _model(recipe: Recipe, device: str, layout: Layout = Layout()):
    m = recipe.model
    return build_model(m["arch"], checkpoint=m["checkpoint"], config=m["config"], seed=m["seed"], dtype=recipe.dtype,
                       device=device, layout=layout, quantized_weights=m["quantized_weights"], expert_capacity=m["expert_capacity"],
                       expert_overflow=m["expert_overflow"], draft_tokens=recipe.speculative)


def compute_note(recipe: Recipe, the_plan: Plan) -> str | None:
    """What the backend computes the recipe's weights in on this host, where it says (inductor:
    bf16, and fp8 kept quantized)."""
    backend = backend_module(recipe.backend)
    if not hasattr(backend, "compute_note"):
        return None
    kept_quantized = bool(the_plan.model_config.get("quantization_config")) and recipe.model["quantized_weights"] == "keep"
    return backend.compute_note(the_plan.toolchain, recipe.dtype, kept_quantized)


def recipe_layout(recipe: Recipe) -> Layout:
    p = recipe.parallel
    return Layout(p["world_size"], p["tp"], p["ep"])


def plan(recipe: Recipe, check_weights: bool = True) -> Plan:
    """Trace every (method, bucket) on fake weights, split, fingerprint, and lay out the schedules.
    `check_weights=False` reads only the checkpoint's config.json (a plan before downloading it)."""
    try:
        model = _model(recipe, "fake", recipe_layout(recipe))
    except LayoutError as err:
        raise RecipeError(f"{recipe.name}: {err}") from None
    if recipe.model["checkpoint"] and check_weights:
        check_checkpoint(recipe.model["checkpoint"], _model(recipe, "meta"))
    state = [[StateTensor(s.name, list(s.shape), _dtype_name(s.dtype), s.positions_per_entry) for s in layer]
             for layer in model.state_specs(recipe.kv["max_seqs"], recipe.kv["max_len"])]
    _check_state_pool(recipe, state)
    backend = backend_module(recipe.backend)
    toolchain = {**toolchain_versions(), **({} if backend.unavailable(recipe.backend_options) else backend.versions())}  # (only a plan)
    options = backend.options(recipe.backend_options)
    programs, units = trace.trace_programs(model, recipe.program_buckets(), recipe.program_contexts(), recipe.kv["max_seqs"], recipe.kv["max_len"],
                                           recipe.split_layers)
    # Splitting off the state-free part pays only where it dedups: layer units shared by contexts.
    context_inputs = _context_inputs(programs, state) if recipe.split_layers else {}
    split = {}
    regions, region_paths = {}, {}
    for key, unit in units.items():
        unit_regions = split_unit(unit.program.graph_module, unit.module_path, recipe.boundaries, model.STATE_FREE_FROM,
                                  context_inputs.get(key, frozenset()))
        fps = ["" if r.collective else fingerprint(r.graph_module, recipe.backend, options, toolchain)
               for r in unit_regions.regions]
        for fp, region in zip(fps, unit_regions.regions):
            if fp:
                regions.setdefault(fp, region.graph_module)
                region_paths.setdefault(fp, unit.module_path)
        split[key] = (unit_regions, fps)
    for i, boundary in enumerate(recipe.boundaries):
        if not any(boundary_matches(u.program.graph_module, boundary, u.module_path) for u in units.values()):
            raise RecipeError(f"{recipe.name}: regions.boundaries[{i}] {boundary} matches no node of the traced model; "
                              "check the op prefix (e.g. aten.topk) and the module glob (e.g. layers.*.mlp.gate).")
    hierarchical = bool(recipe.parallel["hierarchical_allreduce"])
    schedules = {p.key: _schedule(p, split, hierarchical) for p in programs}
    for program in schedules.values():
        program.steps = pack_collectives(program.steps, _dtypes(program, regions))
    kv = KVSpec(recipe.kv["max_seqs"], recipe.kv["max_len"], 0, [recipe.kv["max_seqs"] + 1, recipe.kv["max_len"], 0], recipe.dtype)
    weight_names = sorted({w for p in programs for call in p.calls for w in call.weights})
    return Plan(schedules, regions, toolchain, options, region_paths, weight_names, kv, state, model.config.to_dict())


def _context_inputs(programs: list[trace.TracedProgram], state: list[list[StateTensor]]) -> dict[str, frozenset[int]]:
    """Unit key -> the graph inputs (lifted weights first) that are context-sized state views, for
    the units of programs traced under a context bucket."""
    sized = {f"kv.{i}.{t.name}" for i, layer in enumerate(state) for t in layer if t.positions_per_entry}
    found = {}
    for program in programs:
        if program.context is None:
            continue
        for call in program.calls:
            found.setdefault(call.unit, frozenset(i for i, name in enumerate(call.weights + call.inputs) if name in sized))
    return found


STATE_POOL_LIMIT = 1 << 40  # bytes per rank; no host holds more


def _check_random_weights_fit(recipe: Recipe):
    """A config + seed recipe's random weights are created in memory when the bundle is written,
    after every region compiled: check before compiling that they fit."""
    if recipe.model["checkpoint"]:
        return  # streamed tensor by tensor
    size = sum(p.numel() * DTYPES[recipe.dtype].itemsize for p in _model(recipe, "meta").parameters())
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if size > available // 2:
        raise RecipeError(f"{recipe.name}: model.config describes {size / 2**30:.1f} GiB of weights, and random weights are "
                          f"made in memory ({available / 2**30:.1f} GiB free here). Use model.checkpoint (streamed tensor by "
                          "tensor) or a smaller model.config.")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def state_bytes(state: list[list[StateTensor]]) -> int:
    return sum(torch.Size(t.shape).numel() * getattr(torch, t.dtype).itemsize for layer in state for t in layer)


def _check_state_pool(recipe: Recipe, state: list[list[StateTensor]]):
    kv, size = recipe.kv, state_bytes(state)
    if size > STATE_POOL_LIMIT:
        raise RecipeError(f"{recipe.name}: the KV/state pool of kv.max_seqs={kv['max_seqs']} x kv.max_len={kv['max_len']} "
                          f"would take {size / 2**30:.0f} GiB per rank; lower kv.max_seqs or kv.max_len.")


def _schedule(program: trace.TracedProgram, split: dict, hierarchical: bool) -> Program:
    steps = []
    for call in program.calls:
        unit_regions, fps = split[call.unit]
        unit_inputs = call.weights + call.inputs  # lifted weights come first in an exported graph
        final = {ref: call.outputs[k] for k, ref in enumerate(unit_regions.outputs)}
        if any(ref[0] == "unit" for ref in final):
            raise NotImplementedError(f"{call.unit}: a unit output that is one of its inputs")

        def name(ref):
            if ref[0] == "unit":
                return unit_inputs[ref[1]]
            return final.get(ref, f"{call.path or 'model'}#{ref[1]}.{ref[2]}")

        for r, region in enumerate(unit_regions.regions):
            outputs = [name(("region", r, j)) for j in range(region.n_outputs)]
            collective = region.collective
            if collective and collective["op"] == "all_reduce" and collective["group"] == "world" and hierarchical:
                collective = {**collective, "hierarchical": True}
            steps.append(ScheduleStep(fps[r], [name(ref) for ref in region.inputs], outputs, collective))
    return Program(program.method, program.bucket, program.inputs, program.output, steps, program.context)


def _dtypes(program: Program, regions: dict) -> dict[str, str]:
    """Value name -> dtype, from the region outputs (a collective keeps its input's dtype)."""
    dtypes = {}
    for step in program.steps:
        if step.collective:
            dtypes.update({o: dtypes.get(i) for i, o in zip(step.inputs, step.outputs)})
        else:
            dtypes.update({o: str(v.dtype) for o, v in zip(step.outputs, output_values(regions[step.region]))})
    return dtypes


def _spec(value: torch.Tensor) -> TensorSpec:
    return TensorSpec(list(value.shape), _dtype_name(value.dtype))


def compile_regions(recipe: Recipe, the_plan: Plan, cache: CompileCache, jobs: int, timeout: float,
                    progress: bool, executor: Executor = LOCAL) -> tuple[dict[str, Path], int]:
    """Artifact per unique region, from the cache or from a worker; raises CompileFailed. Each
    region is cached the moment its worker finishes, so an interrupted compile keeps it. A backend
    that only serializes (IN_PROCESS) has nothing to isolate and runs here, unless a fault is
    injected (the testing aid lives in the worker)."""
    backend = backend_module(recipe.backend)
    in_process = getattr(backend, "IN_PROCESS", False) and "inject_fault" not in the_plan.backend_options
    artifacts, todo, hits = {}, [], 0
    regions = tqdm(the_plan.regions.items(), desc="exporting", unit="region", disable=not progress, leave=False)
    for fp, graph_module in regions:
        hit = cache.get(fp)
        if hit is not None:
            artifacts[fp], hits = hit, hits + 1
            continue
        work = cache.work_dir(fp)
        out_file = work / f"{fp}.{backend.EXTENSION}"
        if in_process:
            backend.compile(export_region(graph_module), the_plan.backend_options, out_file)
            artifacts[fp] = cache.put(fp, out_file, {"backend": recipe.backend, "seconds": 0.0})
            cache.prune_work(work)
            continue
        torch.export.save(export_region(graph_module), work / "region.ep.pt2")
        todo.append(Job(fp, work / "region.ep.pt2", out_file, recipe.backend, the_plan.backend_options, work / "compile.log"))

    def store(result: JobResult):
        if result.ok:
            name = result.job.name
            artifacts[name] = cache.put(name, result.job.out_file, {"backend": recipe.backend, "seconds": round(result.seconds, 2)})
            cache.prune_work(result.job.log_file.parent)

    results = run_jobs(todo, jobs, timeout, progress, on_done=store, executor=executor, toolchain=the_plan.toolchain)
    failures = [r for r in results if not r.ok]
    if failures:
        raise CompileFailed(failures, timeout)
    return artifacts, hits


def weight_specs(recipe: Recipe, names: list[str], layout: Layout, full=None) -> list[tuple[str, list[int], torch.dtype]]:
    """(name, shape, dtype) of each bundle weight as a rank stores it (every rank's shard has the
    same shape), from meta models: nothing is read or allocated."""
    full = full or _model(recipe, "meta")
    sharded = _model(recipe, "meta", layout)
    specs = []
    for name in names:
        tensor = trace.tensor_at(sharded, name)
        dtype = stored_dtype(full, name, DTYPES[recipe.dtype]) if isinstance(tensor, torch.nn.Parameter) else tensor.dtype
        specs.append((name, list(tensor.shape), dtype))
    return specs


def weight_writer(recipe: Recipe, names: list[str], layout: Layout):
    """write_weights(directory) for the bundle: per-rank files streamed from the checkpoint (only each
    rank's slices are read), or cut from the random model of a config + seed recipe."""
    full = _model(recipe, "meta")  # full shapes; derived buffers (rope frequencies) are real
    specs = weight_specs(recipe, names, layout, full)
    derived = dict(full.named_buffers())
    checkpoint = recipe.model["checkpoint"]
    if checkpoint:
        weights = SafetensorsDir(Path(checkpoint))

        def read_slice(name, rank):
            if name in derived:
                return derived[name]
            shape = tuple(trace.tensor_at(full, name).shape)
            split = layout.split(name)
            part = None
            if split:
                size = shape[split[0]] // split[1]
                part = (split[0], layout.shard_index(name, rank) * size, size)
            return read_weight(weights, full, name, part).to(stored_dtype(full, name, DTYPES[recipe.dtype]))
    else:
        model = _model(recipe, "cpu")

        def read_slice(name, rank):
            return shard(name, trace.tensor_at(model, name), layout, rank)

    transform = getattr(backend_module(recipe.backend), "transform_weight", None)
    if transform:
        untransformed = read_slice

        def read_slice(name, rank):
            scaled = name.removesuffix(SCALE_SUFFIX)
            scales_for = full.get_parameter(scaled).dtype if scaled != name else None
            return transform(name, untransformed(name, rank), scales_for)

    return lambda directory: write_rank_files(directory, specs, layout, full.config, read_slice)


def compile_recipe(recipe: Recipe, jobs: int = 2, cache_dir: Path | None = None, timeout: float = 900,
                   progress: bool = True, sign_key: bytes | None = None, executor: Executor = LOCAL) -> Summary:
    """Compile `recipe` into its output bundle, holding the output's lock throughout."""
    with output_lock(recipe.output):
        return _compile_recipe(recipe, jobs, cache_dir, timeout, progress, sign_key, executor)


def _compile_recipe(recipe, jobs, cache_dir, timeout, progress, sign_key, executor) -> Summary:
    from deepinfer.runtime import knobs

    from .footprint import check_fits  # (footprint builds on this module's plan)

    start = time.perf_counter()
    check_output(recipe.output)
    cache = CompileCache(cache_dir or knobs.cache_dir())
    the_plan = plan(recipe)
    check_fits(recipe, the_plan)
    _check_random_weights_fit(recipe)
    artifacts, hits = compile_regions(recipe, the_plan, cache, jobs, timeout, progress, executor)

    layout = recipe_layout(recipe)
    cfg = the_plan.model_config
    checkpoint = recipe.model["checkpoint"]
    carried = tokenizer_files(checkpoint)
    ext = backend_module(recipe.backend).EXTENSION
    regions = {fp: Region(f"regions/{fp}.{ext}", recipe.backend, [_spec(v) for v in input_values(gm)],
                          [_spec(v) for v in output_values(gm)]) for fp, gm in the_plan.regions.items()}
    manifest = Manifest(
        name=recipe.name, recipe=recipe.raw, model_config=the_plan.model_config, toolchain=the_plan.toolchain,
        parallel=recipe.parallel, buckets=recipe.program_buckets(), contexts=recipe.program_contexts(), speculative=recipe.speculative,
        prompt_logprobs=SCORE_TOP if recipe.prompt_logprobs else 0, kv=the_plan.kv, state=the_plan.state, programs=the_plan.programs, regions=regions,
        weight_files=[f"weights/rank-{r}.safetensors" for r in range(layout.world_size)], tokenizer="tokenizer.json" if "tokenizer.json" in carried else None,
        vocab_size=cfg["vocab_size"], eos_token_id=cfg["eos_token_id"],
        chat_template="chat_template.json" if "chat_template.json" in carried else None,
    )
    write_bundle(recipe.output, manifest, artifacts, weight_writer(recipe, the_plan.weight_names, layout), carried, sign_key)
    steps = sum(len(p.steps) for p in the_plan.programs.values())
    return Summary(len(the_plan.programs), steps, len(the_plan.regions), hits, len(the_plan.regions) - hits,
                   time.perf_counter() - start, recipe.output, compute_note(recipe, the_plan))
