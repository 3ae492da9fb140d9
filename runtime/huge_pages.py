"""Big buffers a step streams through (a rank's weights, the state pool) on 2 MiB pages.

Linux backs a process's memory with 4 KiB pages unless the process asks for more (transparent huge
pages in `madvise` mode, the default of many distributions) or the system always gives them.
Streamed through 4 KiB pages, reads slow down at every page (a TLB entry each; the hardware
prefetchers stop at page boundaries): two threads of an Intel Xeon sum 512 MiB of float32 at
21.5 GB/s on 4 KiB pages, 31.7 GB/s on 2 MiB ones. (llama.cpp's weights, mapped from its file,
come from the page cache, in large folios where the file system has them.)
"""

import ctypes
import mmap

import torch

HUGE_PAGE = 1 << 21
_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)  # (Linux only)
_libc = ctypes.CDLL(None, use_errno=True) if _ADVICE is not None else None


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized contiguous tensor; from 2 MiB on, starting on a 2 MiB boundary and advised to
    the kernel as huge-page memory before anything touches it (where the kernel does not take the
    advice, ordinary pages: the same tensor)."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if _ADVICE is None or nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # (untouched: only the pages used are ever backed)
    offset = -raw.data_ptr() % HUGE_PAGE
    _libc.madvise(ctypes.c_void_p(raw.data_ptr() + offset), ctypes.c_size_t(nbytes), _ADVICE)  # (a refusal changes nothing)
    return raw[offset : offset + nbytes].view(dtype).view(shape)
