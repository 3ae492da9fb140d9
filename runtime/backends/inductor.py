"""AOTInductor packages (`.pt2`): compiled C++ kernels (native code), weights passed in as inputs."""

import platform

import torch
import torch._inductor
from torch._inductor.cpu_vec_isa import x86_isa_checker

from .. import grouped_matmul, int_matmul  # noqa: F401  (register the deepinfer ops a region may call)
from ..errors import BundleError
from . import private_copy

NATIVE_CODE = True


def host_problem(toolchain: dict) -> str | None:
    """The CPU features the kernels were built for (the toolchain's inductor_isa, e.g. "avx512
    avx512_vnni amx_tile avx512_bf16") that this host lacks: such code stops at an illegal
    instruction. Read from the CPU's flags (no compiler needed); hosts other than x86 are not checked."""
    wanted = toolchain.get("inductor_isa", "").split()
    if not wanted or platform.machine() not in ("x86_64", "AMD64"):
        return None
    here = set(x86_isa_checker()) | ({"avx512_bf16"} if torch.cpu._is_avx512_bf16_supported() else set())
    missing = [feature for feature in wanted if feature not in here]
    if not missing:
        return None
    return (f"the bundle's AOTInductor kernels were built for CPU features {' '.join(wanted)} (toolchain.inductor_isa), "
            f"and this host lacks {' '.join(missing)} (it has {' '.join(sorted(here)) or 'no vector ISA'}): they would stop at an illegal "
            "instruction. Compile the recipe on a host like this one (deepinfer-compile builds for the CPU it runs on; "
            "ATEN_CPU_CAPABILITY=avx2 holds it to AVX2, code every x86-64 server of the last decade runs).")


def load(data: bytes, region, where: str):
    with private_copy(data, ".pt2") as path:
        try:
            runner = torch._inductor.aoti_load_package(str(path))
        except Exception as err:  # (a zip archive it cannot read, a package without a model)
            if int_matmul.KERNEL_PROBLEM and "undefined symbol: aoti_torch_cpu_" in str(err):
                raise BundleError(f"{where}: this region's compiled code calls deepinfer's CPU kernels (int8/int4 weights, few-row "
                                  "float products: runtime/int_matmul.cpp), which could not be built on this host "
                                  f"({int_matmul.KERNEL_PROBLEM.strip()[:300]}). Install g++ (or set CXX to a C++ compiler) where the "
                                  "bundle runs: the kernels are built once for this CPU into DEEPINFER_CACHE_DIR/kernels (~2 s); "
                                  "the export backend's bundles run without them, slower.") from None
            raise BundleError(f"{where}: not an AOTInductor package this runtime can load ({type(err).__name__}: "
                              f"{str(err).strip()[:200]}). Recompile the bundle.") from None
    # The package's __call__ re-parses its pytree specs from JSON on every call; regions take and
    # return flat tensor lists, so the loader's boxed_run is called directly (it consumes its list).
    run = runner.loader.boxed_run

    def call(*args):
        return run(list(args))

    return call
