"""Recipes: which model, dtype, layout, methods and buckets, region policy, backend, KV pool, output.

Every problem raises `RecipeError` naming the key (and its line in the YAML file), exit code 2.
Relative paths (model.checkpoint, output) are taken from the current directory.
"""

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from deepinfer.models import QUANTIZED_WEIGHTS, context_parallel_supported, model_config, mtp_problem
from deepinfer.models.int_weights import BITS as INT_BITS
from deepinfer.models.int_weights import GROUPS as INT4_GROUPS
from deepinfer.models.moe import DEFAULT_CAPACITY, OVERFLOW_FORMS
from deepinfer.runtime.errors import DeepinferError

from . import recipe_yaml
from .backends import BACKENDS, backend_module, options_problem

METHODS = ("prefill", "decode")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")
MAX_SEQS = 1 << 16  # sequence slots in the KV pool
MAX_LEN = 1 << 24  # positions per slot
MAX_BUCKETS = 64  # per method
MAX_DEVICE_MEMORY_GIB = 1 << 20


class RecipeError(DeepinferError):
    exit_code = 2


@dataclass
class Recipe:
    name: str
    model: dict  # arch, checkpoint | config, seed, quantized_weights, expert_capacity, expert_overflow, quantize(_group, _head)
    dtype: str
    parallel: dict  # world_size, tp, ep, hierarchical_allreduce, device_memory_gib (None: not checked)
    buckets: dict[str, list[int]]  # method -> sorted buckets
    contexts: dict[str, list[int]]  # method -> sorted context buckets (ending at kv.max_len); absent: whole pool
    kv: dict  # max_seqs, max_len
    split_layers: bool
    boundaries: list[dict]
    backend: str
    backend_options: dict
    output: Path
    raw: dict = field(repr=False, default_factory=dict)  # the recipe as written, for the manifest
    speculative: int = 0  # draft tokens a decode step verifies (speculative.num_tokens; 0: off)
    prompt_logprobs: bool = False  # also compile score programs: prompt tokens' logprobs (echo)

    def program_buckets(self) -> dict[str, list[int]]:
        """The traced programs' buckets, in rows. With k draft tokens a decode step verifies each
        sequence's last token and its drafts (B (k + 1) rows for a bucket of B sequences), and a
        draft step takes the same rows: each sequence's tokens the MTP module has not seen (at
        most k + 1), then drafts k tokens in the same program. Score programs (prompt_logprobs)
        are prefill chunks: the prefill buckets."""
        buckets = dict(self.buckets)
        if self.speculative:
            buckets["decode"] = buckets["draft"] = speculative_buckets(self.buckets["decode"], self.speculative)
        if self.prompt_logprobs:
            buckets["score"] = self.buckets["prefill"]
        return buckets

    def program_contexts(self) -> dict[str, list[int]]:
        """Context buckets per traced method: draft steps take the decode steps', score steps the prefill steps'."""
        contexts = dict(self.contexts)
        if self.speculative and "decode" in self.contexts:
            contexts["draft"] = self.contexts["decode"]
        if self.prompt_logprobs and "prefill" in self.contexts:
            contexts["score"] = self.contexts["prefill"]
        return contexts


def speculative_buckets(decode: list[int], k: int) -> list[int]:
    """The verify and draft steps' buckets in rows, for decode buckets of B sequences and k draft tokens."""
    return [b * (k + 1) for b in decode]


# key -> (type, default); a dict value is a nested section; REQUIRED marks keys without a default.
REQUIRED = object()
SCHEMA = {
    "name": (str, REQUIRED),
    "model": {"arch": (str, "deepseek_v3"), "checkpoint": (str, None), "config": (dict, None), "seed": (int, 0),
              "quantized_weights": (str, "keep"), "expert_capacity": (float, DEFAULT_CAPACITY),
              "expert_overflow": (str, None), "quantize": (str, None), "quantize_group": (int, 32), "quantize_head": (bool, True)},
    "dtype": (str, "float32"),
    "parallel": {"world_size": (int, 1), "tp": (int, 1), "ep": (int, 1), "cp": (int, 1), "hierarchical_allreduce": (int, 0),
                 "device_memory_gib": (float, None)},
    "methods": {m: {"buckets": (list, REQUIRED), "context": (list, None)} for m in ("decode", "prefill")},
    "kv": {"max_seqs": (int, REQUIRED), "max_len": (int, REQUIRED)},
    "regions": {"split_layers": (bool, True), "boundaries": (list, [])},
    "backend": {"name": (str, "inductor"), "options": (dict, {})},
    "speculative": {"method": (str, None), "num_tokens": (int, None)},
    "prompt_logprobs": (bool, False),
    "output": (str, None),
}
SPECULATIVE_METHODS = ("mtp",)
MAX_DRAFT_TOKENS = 5


def load_recipe(path: str | Path, backend: str | None = None, output: str | Path | None = None,
                backend_installed: bool = True) -> Recipe:
    """Read and validate a recipe; `backend` and `output` override the file (command-line flags).
    `backend_installed=False` accepts a known backend that is not installed here (planning for
    another machine: nothing is compiled)."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as err:
        raise RecipeError(f"{path}: cannot read the recipe ({err.strerror}).") from None
    except UnicodeDecodeError as err:
        raise RecipeError(f"{path}: not UTF-8 text (byte {err.start}); save the recipe as UTF-8 YAML.") from None
    try:
        raw, root = recipe_yaml.load(text)
        lines = _key_lines(root, "", set()) if root is not None else {}
    except recipe_yaml.RecipeYAMLError as err:
        raise RecipeError(f"{path}:{err.line}: {err}") from None
    except yaml.YAMLError as err:
        raise RecipeError(f"{path}: not valid YAML: {err}") from None
    except RecursionError:
        raise RecipeError(f"{path}: the YAML is nested too deeply; a recipe is a few levels of keys.") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: a recipe is a YAML mapping of keys (name, model, methods, kv, ...).")

    def fail(key: str, message: str):
        line = lines.get(key)
        where = f"{path}:{line}" if line else str(path)
        raise RecipeError(f"{where}: {key}: {message}")

    values = _validate(raw, SCHEMA, "", fail)
    if not NAME.fullmatch(values["name"]):
        fail("name", f"{values['name']!r} must be one path component of letters, digits, '.', '_', '+' or '-' "
             "(it names the bundle directory), e.g. tiny-ws2.")
    model = values["model"]
    if not 0 <= model["seed"] < 1 << 63:
        fail("model.seed", f"{model['seed']} must be in [0, 2**63).")
    if (model["checkpoint"] is None) == (model["config"] is None):
        fail("model", "give exactly one of model.checkpoint (an HF directory) or model.config (HF config fields).")
    if model["checkpoint"] is not None:
        checkpoint = Path(model["checkpoint"])
        if not (checkpoint / "config.json").is_file():
            fail("model.checkpoint", f"{checkpoint} is not a readable HF checkpoint directory (no config.json there).")
    if model["quantized_weights"] not in QUANTIZED_WEIGHTS:
        fail("model.quantized_weights", f"{model['quantized_weights']!r}: choose keep (a checkpoint's fp8 weights stay fp8 in the "
             "bundle, dequantized inside the regions) or dequantize (converted to the recipe's dtype at compile time).")
    if not 0 < model["expert_capacity"] <= 1024:
        fail("model.expert_capacity", f"{model['expert_capacity']} must be in (0, 1024]: the (token, expert) pairs an expert "
             "takes in a prompt chunk, in multiples of an even share (default 2; a step past it runs every expert).")
    if model["expert_overflow"] not in (*OVERFLOW_FORMS, None):
        fail("model.expert_overflow", f"{model['expert_overflow']!r}: choose exact (a prompt chunk's experts each take "
             "exactly their rows, through deepinfer's grouped-matmul ops: inductor and export), branch (a capacity per "
             "expert; the overflow passes run when some expert needs them: torch.cond) or always (every pass runs: no "
             "control flow, for compilers that take none, like StableHLO/PJRT and neuronx-cc).")
    _check_quantize(model, values["backend"]["name"] if backend is None else backend, fail)
    if values["dtype"] not in ("float32", "bfloat16"):
        fail("dtype", f"{values['dtype']!r} is not supported; use float32 or bfloat16.")
    buckets = {method: _sizes(values["methods"][method]["buckets"], f"methods.{method}.buckets", fail) for method in METHODS}
    node = values["parallel"]["hierarchical_allreduce"]
    if node and (node < 2 or values["parallel"]["world_size"] % node or node == values["parallel"]["world_size"]):
        fail("parallel.hierarchical_allreduce", f"{node} must be a group size (ranks per node) that divides "
             f"world_size={values['parallel']['world_size']} into at least two groups, or 0 for a flat all-reduce.")
    memory = values["parallel"]["device_memory_gib"]
    if memory is not None and not 0 < memory <= MAX_DEVICE_MEMORY_GIB:
        fail("parallel.device_memory_gib", f"{memory} must be in (0, {MAX_DEVICE_MEMORY_GIB}]: the memory of one rank's "
             "device in GiB (e.g. 141 for an H200), which each rank's weights, state pool and largest activation must fit; "
             "deepinfer-compile plan RECIPE shows them.")
    kv = values["kv"]
    for name, limit in (("max_seqs", MAX_SEQS), ("max_len", MAX_LEN)):
        if not 0 < kv[name] <= limit:
            fail(f"kv.{name}", f"must be in [1, {limit}], not {kv[name]}.")
    if buckets["decode"][-1] > kv["max_seqs"]:
        fail("methods.decode.buckets", f"bucket {buckets['decode'][-1]} has more rows than kv.max_seqs={kv['max_seqs']} sequences.")
    if buckets["prefill"][-1] > kv["max_len"]:
        fail("methods.prefill.buckets", f"bucket {buckets['prefill'][-1]} is longer than kv.max_len={kv['max_len']} positions.")
    contexts = {}
    for method in METHODS:
        key, listed = f"methods.{method}.context", values["methods"][method]["context"]
        if listed is not None:
            contexts[method] = _contexts(_sizes(listed, key, fail), kv["max_len"], key, fail)
    for i, boundary in enumerate(values["regions"]["boundaries"]):
        if (not isinstance(boundary, dict) or not set(boundary) <= {"module", "op"} or "op" not in boundary
                or not all(isinstance(v, str) and v for v in boundary.values())):
            fail(f"regions.boundaries[{i}]", "a boundary is {op: OP_PREFIX, module: MODULE_GLOB (optional)}, both strings, "
                 "e.g. {op: aten.topk, module: 'layers.*.mlp.gate'}.")
    backend_name = backend or values["backend"]["name"]
    _check_backend(backend_name, values["backend"]["options"], backend_installed, lambda message: fail("backend.name", message))
    problem = options_problem(backend_name, values["backend"]["options"])
    if problem:
        fail("backend.options", problem)
    if model["expert_overflow"] is None:  # unset: the best form the backend can compile
        module = backend_module(backend_name)
        model["expert_overflow"] = ("exact" if getattr(module, "CUSTOM_OPS", True)
                                    else "branch" if getattr(module, "CONTROL_FLOW", True) else "always")
    try:
        config = model_config(model["arch"], model["checkpoint"], model["config"])
    except DeepinferError as err:
        key = "model.arch" if "model.arch" in str(err) else ("model.config" if model["config"] is not None else "model.checkpoint")
        fail(key, str(err).removeprefix("model.config: "))
    if kv["max_len"] > config.max_position_embeddings:
        fail("kv.max_len", f"{kv['max_len']} is past the model's max_position_embeddings={config.max_position_embeddings}: "
             "positions beyond it were never trained (and RoPE scaling is defined up to it). Lower kv.max_len.")
    cp = values["parallel"]["cp"]
    _check_cp(values["parallel"], model["arch"], buckets, contexts, kv["max_len"], fail)
    problem = config.max_len_problem(kv["max_len"], cp)
    if problem:
        fail("kv.max_len", problem)
    speculative = _speculative(values["speculative"], config, fail)
    for method, sizes in contexts.items():
        problem = next(filter(None, (config.max_len_problem(size, cp) for size in sizes)), None)
        if problem:
            fail(f"methods.{method}.context", f"context bucket {problem}")
    return Recipe(
        name=values["name"],
        model=model,
        dtype=values["dtype"],
        parallel=values["parallel"],
        buckets=buckets,
        contexts=contexts,
        kv=kv,
        split_layers=values["regions"]["split_layers"],
        boundaries=values["regions"]["boundaries"],
        backend=backend_name,
        backend_options=values["backend"]["options"],
        output=Path(output or values["output"] or f"artifacts/{values['name']}"),
        raw=raw,
        speculative=speculative,
        prompt_logprobs=values["prompt_logprobs"],
    )


def _check_quantize(model: dict, backend: str, fail):
    """model.quantize: int8 / int4 weights (models/int_weights.py), for backends whose regions compute them."""
    if model["quantize"] is None:
        return
    if model["quantize"] not in INT_BITS:
        fail("model.quantize", f"{model['quantize']!r}: choose int8 (per output channel) or int4 (groups of "
             "model.quantize_group inputs), or leave it out for the recipe's dtype.")
    if model["quantize_group"] not in INT4_GROUPS:
        fail("model.quantize_group", f"{model['quantize_group']}: int4 groups of {' / '.join(map(str, INT4_GROUPS))} inputs "
             "share a scale (32 is llama.cpp's q4_0 block; 128 reads fewer scales).")
    if backend in BACKENDS and not getattr(backend_module(backend), "INT_WEIGHTS", False):
        fail("model.quantize", f"the {backend} backend cannot compile int8/int4 weights: their products are CPU kernels "
             "(our deepinfer::int8_matmul and int4_matmul). Use backend inductor or export, or drop model.quantize.")


def _check_cp(parallel: dict, arch: str, buckets: dict, contexts: dict, max_len: int, fail):
    """parallel.cp: the context-parallel group size (models/context_parallel.py)."""
    cp, replicas = parallel["cp"], parallel["world_size"] // max(parallel["tp"], 1)
    if cp == 1:
        return
    if cp < 1 or parallel["world_size"] % max(parallel["tp"], 1) or replicas % cp:
        fail("parallel.cp", f"{cp} must divide world_size / tp = {replicas}: a context-parallel group is cp ranks that would "
             "otherwise compute the same rows (replicas of the tp-split model). Choose a divisor of it, or 1.")
    if not context_parallel_supported(arch):
        fail("parallel.cp", f"model.arch {arch} does not split its state over a context-parallel group yet; use cp: 1.")
    for method, size in [("prefill", b) for b in buckets["prefill"] if b % cp]:
        fail(f"methods.{method}.buckets", f"bucket {size} is not a multiple of parallel.cp={cp}: a prompt chunk's rows are "
             f"split evenly over the cp group. Use multiples of {cp}.")
    if max_len % cp:
        fail("kv.max_len", f"{max_len} is not a multiple of parallel.cp={cp}: each rank of the cp group keeps every "
             f"{cp}-th position. Use a multiple of {cp}.")
    for method, sizes in contexts.items():
        for size in sizes:
            if size % cp:
                fail(f"methods.{method}.context", f"context bucket {size} is not a multiple of parallel.cp={cp}: each rank "
                     f"reads every {cp}-th position of it. Use multiples of {cp}.")


def _speculative(section: dict, config, fail) -> int:
    """Draft tokens per decode step (0: speculative decoding off)."""
    method, k = section["method"], section["num_tokens"]
    if method is None and k is None:
        return 0
    if method not in SPECULATIVE_METHODS:
        fail("speculative.method", f"{method!r}: choose mtp (the checkpoint's multi-token prediction module drafts, the "
             "model verifies), or leave the section out.")
    if k is None or not 1 <= k <= MAX_DRAFT_TOKENS:
        fail("speculative.num_tokens", f"{k!r}: draft tokens per step, 1 to {MAX_DRAFT_TOKENS} (past the checkpoint's MTP "
             "modules the last one drafts again from its own output).")
    problem = mtp_problem(config)
    if problem:
        fail("speculative.method", problem)
    return k


def _sizes(listed: list, key: str, fail) -> list[int]:
    """A bucket list, sorted: positive integers, none twice, at most MAX_BUCKETS."""
    if not listed:
        fail(key, "is empty; give at least one bucket size.")
    if not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in listed):
        fail(key, f"{listed} must hold positive integers.")
    if len(set(listed)) != len(listed):
        fail(key, f"{listed} lists a bucket twice.")
    if len(listed) > MAX_BUCKETS:
        fail(key, f"{len(listed)} buckets: at most {MAX_BUCKETS} (each is a traced and compiled program).")
    return sorted(listed)


def _paths_of(key: str, schema: dict, prefix: str = ""):
    """Where `key` is a recipe key: each dotted path ("the top level" for a top-level one)."""
    for name, spec in schema.items():
        if name == key:
            yield f"{prefix}{name}" if prefix else f"the top level ({name}: ...)"
        if isinstance(spec, dict):
            yield from _paths_of(key, spec, f"{prefix}{name}.")


def _contexts(sizes: list[int], max_len: int, key: str, fail) -> list[int]:
    """Context buckets end at kv.max_len, added when not listed: every sequence the pool holds
    must have a program."""
    if sizes[-1] > max_len:
        fail(key, f"context bucket {sizes[-1]} is longer than kv.max_len={max_len} positions.")
    return sizes if sizes[-1] == max_len else sizes + [max_len]


def _check_backend(name: str, options: dict, installed: bool, fail):
    if name not in BACKENDS:
        fail(f"unknown backend {name!r}; choose one of {list(BACKENDS)}.")
    problem = installed and backend_module(name).unavailable(options)
    if problem:
        fail(f"backend {name!r} is not available here: {problem}")


def _validate(raw: dict, schema: dict, prefix: str, fail) -> dict:
    """Check keys and types of one mapping against its schema; returns values with defaults."""
    for key in raw:
        if key not in schema:
            elsewhere = list(_paths_of(str(key), SCHEMA))
            where = f" `{key}` belongs at {' or '.join(elsewhere)} (see recipes/*.yaml)." if elsewhere else ""
            fail(prefix + str(key), f"unknown key here; expected one of {sorted(schema)}.{where}")
    out = {}
    for key, spec in schema.items():
        dotted = prefix + key
        if isinstance(spec, dict):
            section = raw.get(key, {})
            if section is None:
                section = {}
            if not isinstance(section, dict):
                fail(dotted, f"must be a mapping with keys {sorted(spec)}, not {type(section).__name__}.")
            out[key] = _validate(section, spec, dotted + ".", fail)
            continue
        kind, default = spec
        if key not in raw or raw[key] is None:
            if default is REQUIRED:
                fail(dotted, "is required.")
            out[key] = default
            continue
        value = raw[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            fail(dotted, f"must be {kind.__name__}, not {type(value).__name__} ({value!r}).")
        out[key] = value
    return out


def _key_lines(node, prefix: str, seen: set) -> dict[str, int]:
    """Dotted key -> 1-based line, from the YAML node tree (an aliased node is walked once)."""
    lines = {}
    if id(node) in seen:
        return lines
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            dotted = prefix + str(key_node.value)
            lines[dotted] = key_node.start_mark.line + 1
            lines.update(_key_lines(value_node, dotted + ".", seen))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            dotted = f"{prefix[:-1]}[{i}]"
            lines[dotted] = item.start_mark.line + 1
            lines.update(_key_lines(item, dotted + ".", seen))
    return lines
