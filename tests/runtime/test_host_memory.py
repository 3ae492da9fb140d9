"""The runtime keeps the memory a step frees for the next step (runtime/host_memory.py): a step
whose buffers together free more than twice the largest one (any prefill) would otherwise take
them again as fresh pages every call."""

import subprocess
import sys

# Four 8 MiB buffers live at once, written, freed: a step's pages first touched, for 5 steps.
STEPS = """
import ctypes, resource, sys
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
if sys.argv[1]:
    from deepinfer.runtime.executor import BundleExecutor
    BundleExecutor(sys.argv[1])

def fresh_pages(sizes):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(n) for n in sizes]
    for block, n in zip(blocks, sizes):
        ctypes.memset(block, 1, n)
    for block in blocks:
        libc.free(block)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

print(*[fresh_pages([8 << 20] * 4) for _ in range(5)])
"""


def fresh_pages_a_step(bundle: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", STEPS, bundle], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return [int(n) for n in out.stdout.split()]


def test_a_loaded_bundle_reuses_the_memory_its_steps_free(tiny_bundle):
    plain = fresh_pages_a_step("")
    assert min(plain[1:]) > 4096, plain  # glibc's defaults: half the 32 MiB or more comes fresh each step
    loaded = fresh_pages_a_step(str(tiny_bundle("export")))
    assert loaded[0] > 4096 and max(loaded[1:]) < 64, loaded  # the first step's pages, then none
