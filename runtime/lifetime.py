"""A child process that dies with its parent, however the parent dies (even `kill -9`).

Torch-free, so a child can arm it before its slow imports."""

import ctypes
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent():
    """SIGKILL this process when the thread that started it exits. Call it in the child first
    thing (or as Popen's preexec_fn); a parent already gone is the caller's to check (getppid)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
