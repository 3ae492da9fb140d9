"""glibc's malloc, told to keep the memory a step frees for the next step.

A region's intermediate buffers (activations; on hosts without fast bf16, a weight's float32 copy)
are allocated and freed on every call, several MiB of them live at once. By default glibc adapts
its thresholds to the largest block freed, and gives a heap top of more than twice that back to
the kernel: a step whose buffers free more than that together (any prefill) takes them again next
call as fresh pages, a page fault and a zeroed 4 KiB page each. Measured (bench/bf16_bench.py's
12M bundles held to AVX2, a 256-token prefill after decode steps, as a server interleaves them):
3,700 faults a float32 prefill, 10,300 a bf16 one (its weights' copies), bf16/f32 TTFT 1.24;
with the thresholds below, no faults in either and 1.02.

So the runtime pins them, once per process, as tcmalloc and jemalloc behave by default: blocks up
to 32 MiB (glibc's largest threshold) come from the heap and are reused, and the heap keeps up to
2 GiB of freed memory (the process's memory stays at its high-water mark, which a server reaches
on its first steps anyway). Blocks of 32 MiB and more are still mapped and unmapped each time.
"""

import ctypes
import functools

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20  # glibc refuses more (its DEFAULT_MMAP_THRESHOLD_MAX on 64-bit hosts)
TRIM_THRESHOLD = (1 << 31) - 1  # the largest mallopt takes (an int)


@functools.cache
def keep_freed_memory() -> None:
    """Pin glibc's thresholds, once a process. Where the C library is not glibc (musl, macOS),
    nothing: its allocator decides."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
