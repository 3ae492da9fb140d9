"""What a recipe compiles to, before any backend work: the model traced per (method, bucket) on
fake weights (rank 0's shards), split into regions, fingerprinted and deduplicated, with the
schedules, the state pool and the weights each rank stores.

    from deepinfer.compiler.plan import plan
    the_plan = plan(load_recipe("recipes/tiny.yaml"))

The model is built twice, once per use: fake tensors of rank 0's shard shapes to trace, and meta
tensors of full shapes to check and read a checkpoint against. Nothing else builds one
(the compile of random weights builds the real model when it writes them).
"""

import operator
import os
from dataclasses import dataclass

import torch

from deepinfer.models import DTYPES, Layout, LayoutError, build_model, check_checkpoint
from deepinfer.models.decode_reads import weight_bytes_per_token
from deepinfer.runtime.manifest import KVSpec, Program, ScheduleStep, StateTensor, TensorSpec
from deepinfer.runtime.versions import toolchain_versions

from . import trace
from .backends import backend_module
from .fingerprint import fingerprint
from .pack import pack_collectives
from .recipe import Recipe, RecipeError
from .split import boundary_matches, input_values, output_values, split_unit
from .weights import file_bytes


@dataclass
class RegionSignature:
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]


@dataclass
class Plan:
    """What a recipe compiles to, before any backend work."""

    programs: dict[str, Program]
    regions: dict[str, object]  # fingerprint -> region GraphModule (one per unique region); empty in a stored plan
    signatures: dict[str, RegionSignature]  # fingerprint -> its inputs and outputs (every unique region)
    toolchain: dict
    backend_options: dict  # the backend's defaults merged with the recipe's
    region_paths: dict  # fingerprint -> module path of the unit it came from ("layers.*"), for bisect
    weights: list[tuple[str, list[int], torch.dtype]]  # (name, shape, dtype) a rank stores, the same on every rank
    kv: KVSpec
    state: list[list[StateTensor]]
    model_config: dict
    decode_bytes: int  # weight bytes a batch-1 decode token reads on a rank (models/decode_reads.py)
    largest_activation: tuple[int, str]  # (bytes, "shape dtype, program (module)") of the largest tensor a region computes
    full_model: torch.nn.Module  # meta tensors of full (unsharded) shapes: what a checkpoint is read and checked against
    # (float: model.quantize's codes are made from its weights)


def recipe_model(recipe: Recipe, device: str, layout: Layout = Layout(), quantize: bool = True):
    """The recipe's model; `quantize=False`: the float model whose weights model.quantize's are made from
    (an fp8 checkpoint's dequantized as read)."""
    m = recipe.model
    fp8 = "dequantize" if m["quantize"] else m["quantized_weights"]
    return build_model(m["arch"], checkpoint=m["checkpoint"], config=m["config"], seed=m["seed"], dtype=recipe.dtype,
                       device=device, layout=layout, quantized_weights=fp8, expert_capacity=m["expert_capacity"],
                       expert_overflow=m["expert_overflow"], draft_tokens=recipe.speculative,
                       quantize=m["quantize"] if quantize else None, quantize_group=m["quantize_group"], quantize_head=m["quantize_head"])


def compute_note(recipe: Recipe, the_plan: Plan) -> str | None:
    """What the backend computes the recipe's weights in on this host, where it says (inductor:
    bf16, and fp8 kept quantized)."""
    backend = backend_module(recipe.backend)
    if not hasattr(backend, "compute_note"):
        return None
    quantization = the_plan.model_config.get("quantization_config") or {}
    kept_quantized = quantization.get("quant_method") == "fp8" and recipe.model["quantized_weights"] == "keep"
    return backend.compute_note(the_plan.toolchain, recipe.dtype, kept_quantized)


def weights_note(recipe: Recipe, the_plan: Plan) -> str:
    """'weights int8 per output channel, LM head quantized: 41.2 MiB a rank, 13.1 MiB read per decode token'."""
    quantization = the_plan.model_config.get("quantization_config") or {}
    if quantization.get("quant_method") == "deepinfer":  # the recipe's model.quantize
        scheme = "per output channel" if quantization["weights"] == "int8" else f"in groups of {quantization['group_size']}"
        stored = f"weights {quantization['weights']} {scheme}, LM head {'quantized' if quantization['lm_head'] else 'kept'}"
    elif quantization.get("quant_method") == "fp8" and recipe.model["quantized_weights"] == "keep":
        stored = f"weights {recipe.dtype}, the checkpoint's fp8/fp4 kept"
    else:
        stored = f"weights {recipe.dtype}"
    return f"{stored}: {_mib(file_bytes(the_plan.weights))} a rank, {_mib(the_plan.decode_bytes)} read per decode token"


def _mib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def recipe_layout(recipe: Recipe) -> Layout:
    p = recipe.parallel
    return Layout(p["world_size"], p["tp"], p["ep"], p["cp"])


def plan(recipe: Recipe, check_weights: bool = True) -> Plan:
    """Trace every (method, bucket) on fake weights, split, fingerprint, and lay out the schedules.
    `check_weights=False` reads only the checkpoint's config.json (a plan before downloading it)."""
    try:
        model = recipe_model(recipe, "fake", recipe_layout(recipe))  # rank 0's shards: what is traced
    except LayoutError as err:
        raise RecipeError(f"{recipe.name}: {err}") from None
    full = recipe_model(recipe, "meta", quantize=False)
    if recipe.model["checkpoint"] and check_weights:
        check_checkpoint(recipe.model["checkpoint"], full)
    state = [[StateTensor(s.name, list(s.shape), _dtype_name(s.dtype), s.positions_per_entry) for s in layer]
             for layer in model.state_specs(recipe.kv["max_seqs"], recipe.kv["max_len"])]
    _check_state_pool(recipe, state)
    toolchain = plan_toolchain(recipe)
    options = backend_module(recipe.backend).options(recipe.backend_options)
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
    names = sorted({w for p in programs for call in p.calls for w in call.weights})
    weights = [(name, list(t.shape), t.dtype) for name in names for t in [trace.tensor_at(model, name)]]
    signatures = {fp: RegionSignature([tensor_spec(v) for v in input_values(gm)], [tensor_spec(v) for v in output_values(gm)])
                  for fp, gm in regions.items()}
    return Plan(schedules, regions, signatures, toolchain, options, region_paths, weights, kv, state, model.config.to_dict(),
                weight_bytes_per_token(model, weights, recipe.parallel["world_size"]),
                largest_activation(schedules, regions, region_paths), full)


def plan_toolchain(recipe: Recipe) -> dict:
    """The versions a plan's regions are fingerprinted with: torch, Python, deepinfer and the
    backend's own (none when the backend is not installed here: only a plan)."""
    backend = backend_module(recipe.backend)
    return {**toolchain_versions(), **({} if backend.unavailable(recipe.backend_options) else backend.versions())}


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


def largest_activation(programs: dict[str, Program], regions: dict, region_paths: dict) -> tuple[int, str]:
    """(bytes, description) of the largest tensor a region's op allocates; views and in-place
    updates (of the state pool, say) allocate nothing and are skipped."""
    used_in = {}
    for key, program in programs.items():
        for step in program.steps:
            used_in.setdefault(step.region, key)
    best = (0, "none")
    for fp, graph_module in regions.items():
        for node in graph_module.graph.nodes:
            value = node.meta.get("val")
            if node.op != "call_function" or not isinstance(value, torch.Tensor) or not _allocates(node):
                continue
            size = value.numel() * value.element_size()
            if size > best[0]:
                dtype = str(value.dtype).removeprefix("torch.")
                best = (size, f"{list(value.shape)} {dtype}, {used_in.get(fp, '?')} ({region_paths[fp]})")
    return best


def _allocates(node) -> bool:
    if node.op != "call_function":
        return False  # a region input: a weight, the state pool, an activation counted where it was made
    if node.target is operator.getitem:  # one output of a multi-output op: a view if the op returns views
        return _allocates(node.args[0])
    schema = getattr(node.target, "_schema", None)
    return schema is None or not any(r.alias_info is not None for r in schema.returns)


STATE_POOL_LIMIT = 1 << 40  # bytes per rank; no host holds more


def check_random_weights_fit(recipe: Recipe, the_plan: Plan):
    """A config + seed recipe's random weights are created in memory when the bundle is written,
    after every region compiled: check before compiling that they fit."""
    if recipe.model["checkpoint"]:
        return  # streamed tensor by tensor
    size = sum(p.numel() * DTYPES[recipe.dtype].itemsize for p in the_plan.full_model.parameters())
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


def tensor_spec(value: torch.Tensor) -> TensorSpec:
    return TensorSpec(list(value.shape), _dtype_name(value.dtype))
