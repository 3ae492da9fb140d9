"""AOTInductor: C++ kernels for the CPU packaged as a `.pt2`, loaded with aoti_load_package.
(CUDA bundles are not built yet: they need a GPU to compile and check on.)

`backend.options` are inductor configs (e.g. {"max_autotune": true}), merged over DEFAULTS.
Weights are region inputs, so nothing is baked into the shared object and one artifact serves
every layer.

Kernels are compiled for the vector ISA of the compiling host (`vector_isa`: ATEN_CPU_CAPABILITY
holds it lower, e.g. to avx2), recorded in the toolchain, which the runtime checks against its
host. Where that ISA has no native bfloat16 math, a bf16 model's matrix products are computed in
float32 from its bf16 operands (graph passes float32_products.py; one-row products on every host);
what is stored stays bf16. Products of a few rows with a stored float weight call deepinfer's
few-row kernel (few_row_products.py), which reads bf16 as stored on every host. Weights kept fp8
are decoded by integer ops inductor vectorizes (fp8_decode.py); int8 and int4 weights are
multiplied by deepinfer's own kernels (runtime/int_matmul.py), which the compiled code calls as
C functions (`kernel_shims`), not through torch's dispatcher."""

import fcntl
import hashlib
import json
import os
import platform
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
import torch._inductor
from torch._inductor.custom_graph_pass import CustomGraphPass

from deepinfer.compiler.backends import (blocked_matmul, few_row_products, float32_products, fp8_decode, fused_attention,
                                         gathered_matvec, one_row_views)
from deepinfer.runtime import int_matmul, latent_attention

EXTENSION = "aoti.pt2"
C_SHIMS = {**int_matmul.C_SHIMS, **latent_attention.C_SHIMS}  # deepinfer's kernels, called as C functions
INT_WEIGHTS = True  # model.quantize int8/int4: our CPU kernels (runtime/int_matmul.py) run in its regions

# A decode step and a short prompt chunk multiply a few rows by each stored weight: memory-bound
# products that deepinfer's few-row kernel computes (graph passes: few_row_products.py). Other
# one-row products (a computed weight, a head's matrix) become fused multiply-reduce kernels by
# inductor's mm decomposition pass, enabled here for one row: from 2 rows on such a kernel re-reads
# the matrix per row and loses to the BLAS call (bench/mm_decomposition_bench.py: 2 rows 2x, 8
# rows 3.8x slower) but over a matrix small enough to stay in cache (float32_products.py).
# Longer chunks are BLAS calls (cut into weight blocks at 4-8 rows where the kernel does not
# apply: blocked_matmul.py). The routed experts' decode products with gathered
# weights are the kernel's too where the experts are stored float (it takes them by id), else
# reductions at any row count (gathered_matvec.py).
#
# A region's intermediate buffers come from one block a call, planned by liveness
# (`memory_planning`), not one allocation each (19 in the trained tiny V3's attention region):
# side by side on an Intel Xeon (bench/bundle_ab_bench.py), the tiny V3's float32 TPOT-32 0.92-0.96x,
# the 190M's float32 TPOT-32 / TTFT-32 / TTFT-512 0.84 / 0.90 / 0.97x, bfloat16 0.96 / 0.94 / 0.98x.
# Not in regions with a torch.cond (the MoE's overflow passes): torch 2.13's planner frees the
# branches' buffers where the C++ wrapper no longer declares them, and g++ fails.
#
# A kernel's loop runs on the threads from 2048 elements a thread (inductor's default: 512): a
# parallel region's start and join cost more than a decode step's norms, rope and softmax take
# on one thread. Side by side (bench/bundle_ab_bench.py, an Intel Xeon with AMX, 2 threads): the
# trained tiny V3's float32 TPOT-32 0.93x, TTFT-32 1.00x (4096 a thread: TPOT 0.98x more, TTFT-32
# 1.02x: a 32-token chunk's kernels want the threads); the 190M's int4 TPOT-32 0.98x, TTFT-512
# 0.95x, bfloat16 0.97-1.00x.
DEFAULTS = {
    "memory_planning": True,
    "cpp.min_chunk_size": 2048,
    "post_grad_fusion_options": {
        "decompose_mm_pass": {"cpu_max_first_dimension_decomposition": 1, "cpu_max_other_dimension_decomposition": 1 << 30},
    },
}


def unavailable(options: dict):
    return None


def versions() -> dict:
    # CPU artifacts carry the host ISA in their build flags (the runtime refuses a host without it),
    # and it decides what bf16 products compute in. The graph passes deepinfer adds change what a
    # region compiles to: their source hash too.
    isa = vector_isa()
    return {"inductor_host": platform.machine(), "inductor_isa": isa,
            "inductor_bf16_products": "bfloat16" if native_bf16(isa) else "float32", "inductor_passes": passes_hash(),
            "inductor_kernel_shims": hashlib.sha256(json.dumps(C_SHIMS).encode()).hexdigest()[:12]}


def vector_isa() -> str:
    """The CPU features inductor's kernels are built for here: its vector ISA ("avx2", "avx512
    avx512_vnni amx_tile", ...; "" for none), plus avx512_bf16 where the build uses bf16 instructions."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    if not isa:
        return ""
    native = getattr(isa, "is_avx512_bf16_supported", lambda: False)()
    return str(isa) + (" avx512_bf16" if native else "")


def native_bf16(isa: str) -> bool:
    return "avx512_bf16" in isa.split()


def compute_note(toolchain: dict, dtype: str, kept_quantized: bool) -> str | None:
    notes = []
    if dtype == "bfloat16" and "inductor_isa" in toolchain:  # (what versions() recorded for this compile)
        isa = toolchain["inductor_isa"] or "none"
        notes.append(f"bfloat16 math native (inductor ISA: {isa})" if toolchain["inductor_bf16_products"] == "bfloat16" else
                     f"bfloat16 stored, matrix products computed in float32 (inductor ISA {isa} has no native bfloat16)")
    if kept_quantized:
        notes.append("fp8/fp4 weights kept quantized are decoded in every step with integer ops (no CPU conversion "
                     "instruction): slower than `model.quantized_weights: dequantize` on CPUs (bench/fp8_bench.py)")
    return "; ".join(notes) or None


# Modules whose source fingerprints regions: the graph passes, and the modules defining the ops they
# call (an op's schema and tags shape the code inductor generates around its calls).
FINGERPRINTED = (fused_attention, one_row_views, float32_products, few_row_products, blocked_matmul, gathered_matvec, fp8_decode,
                 int_matmul, latent_attention)


class GraphPasses(CustomGraphPass):
    """deepinfer's own passes over inductor's post-grad graph (inductor runs them first); bf16
    chunk products in float32 for a host without native bf16 math, small ones only elsewhere."""

    def __init__(self, bf16_products_in_float32: bool):
        self.bf16_products_in_float32 = bf16_products_in_float32  # (inductor deep-copies the pass: plain data)

    def __call__(self, graph: torch.fx.Graph):
        few_row_products.patterns.apply(graph)  # (first: the kernel reads bf16 as stored, one row or more)
        float32_products.reduction_patterns.apply(graph)
        if self.bf16_products_in_float32:
            float32_products.chunk_patterns.apply(graph)
        else:
            float32_products.small_chunk_patterns.apply(graph)
        blocked_matmul.patterns.apply(graph)
        gathered_matvec.patterns.apply(graph)
        fp8_decode.patterns.apply(graph)  # last: the passes above follow fp8 converts

    def uuid(self) -> str:
        return f"{passes_hash()}-{self.bf16_products_in_float32}"


def passes_hash() -> str:
    """Changes with the passes' and the ops' source, so compiled regions (whose fingerprints carry it) follow them."""
    digest = hashlib.sha256()
    for module in FINGERPRINTED:
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:16]


def graph_passes(bf16_products_in_float32: bool = False):
    return GraphPasses(bf16_products_in_float32)


def options(user: dict) -> dict:
    return {**DEFAULTS, **user}


def options_problem(user: dict) -> str | None:
    known = torch._inductor.config.get_config_copy()
    unknown = sorted(str(k) for k in user if k not in known)
    if unknown:
        return f"{unknown} are not inductor configs (torch._inductor.config); e.g. max_autotune, cpp.threads."
    for key, value in user.items():
        default = known.get(key)
        if isinstance(default, (bool, int, float, str)) and value is not None and not _same_kind(value, default):
            return f"{key}={value!r}: inductor expects a {type(default).__name__} like its default {default!r}."
    return None


def compile(program, options: dict, out):
    from deepinfer.compiler.split import example_inputs

    # The decomposition pass reads its thresholds when its module is first imported, so they are
    # set globally before inductor loads it (this is the region's own worker process).
    torch._inductor.config.post_grad_fusion_options = options.get("post_grad_fusion_options", {})
    torch._inductor.config.post_grad_custom_pre_pass = graph_passes(not native_bf16(vector_isa()))
    program = one_row_views.apply(fused_attention.apply(program))
    program._example_inputs = (example_inputs(program), {})  # AOTInductor insists on having some
    if any(node.target is torch.ops.higher_order.cond for node in program.graph.nodes):
        options = {**options, "memory_planning": False}  # (see DEFAULTS)
    options = {**options, "aot_inductor.custom_ops_to_c_shims": kernel_shims()}
    with _private_inductor_cache(program):
        torch._inductor.aoti_compile_and_package(program, package_path=str(out), inductor_configs=dict(options))


def kernel_shims() -> dict:
    """deepinfer's kernel ops -> the C functions the generated code calls for them directly: through
    AOTInductor's proxy executor (the op boxed, its tensors wrapped as stable-ABI handles) a call
    cost ~0.65 us more (a tiny model's chain of int4 [192, 192] products, 2.5 vs 1.9 us a call)."""
    return {getattr(torch.ops.deepinfer, op).default: [declaration] for op, declaration in C_SHIMS.items()}


@contextmanager
def _private_inductor_cache(program):
    """Compile cold, in a work directory whose path depends only on the region, so its artifact is
    bit-identical from one compile to the next: inductor names kernels after their directory and
    writes its build commands (with that path) into the packaged sources, and a warm inductor
    cache packages different bytes than a cold one. (deepinfer's own cache, keyed by the region
    fingerprint, is what keeps compiled regions.) A lock keeps two compiles of one region apart."""
    key = hashlib.sha256(str(program.graph).encode()).hexdigest()[:24]
    root = Path(tempfile.gettempdir()) / f"deepinfer-inductor-{os.getuid()}"
    root.mkdir(exist_ok=True)
    work = root / key
    with _locked(root / f"{key}.lock"):
        shutil.rmtree(work, ignore_errors=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(work)  # (this is the region's own worker process)
        try:
            yield
        finally:
            shutil.rmtree(work, ignore_errors=True)


@contextmanager
def _locked(path: Path):
    """An exclusive lock file that is removed when released. A waiter that wakes holding a file
    already removed (its holder finished) tries again on the path's current file."""
    while True:
        lock = open(path, "a")
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if os.stat(path).st_ino == os.fstat(lock.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        lock.close()
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        lock.close()


def _same_kind(value, default) -> bool:
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(default, bool)
    if isinstance(default, (int, float)):
        return isinstance(value, (int, float)) and (isinstance(default, float) or isinstance(value, int))
    return isinstance(value, type(default))
