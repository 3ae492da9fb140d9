"""Reading files that someone else may control: a bundle's, a deploy key.

One open, one descriptor: a path is opened without blocking (a FIFO cannot hang the open),
checked to be a regular file of bounded size on that descriptor, and read from it. Bundle files
are also opened without following a final symlink (a bundle holds its own files) and hashed as
they are read, so the bytes compared with the manifest's sha256 are exactly the bytes used: a file
replaced after verification (a shared model cache, NFS) is never the one loaded.
"""

import hashlib
import os
import stat
from pathlib import Path

import torch

from . import huge_pages
from .errors import BundleError

CHUNK = 1 << 20
MAX_FILE_BYTES = 1 << 40


BUNDLE_ADVICE = "A bundle holds its own regular files: copy the bundle directory again, or recompile it."


def _open_regular(path: Path, max_bytes: int, follow_symlinks: bool, advice: str = BUNDLE_ADVICE) -> tuple[int, int]:
    """(descriptor, size) of a regular file of at most `max_bytes`; raises BundleError (ending
    with `advice`) otherwise."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as err:
        what = "a symlink (a bundle holds its own files)" if err.errno == 40 else err.strerror  # ELOOP
        raise BundleError(f"{path}: cannot be read ({what}). {advice}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size > max_bytes:
        os.close(fd)
        what = "not a regular file" if not stat.S_ISREG(info.st_mode) else f"{info.st_size} bytes, over the {max_bytes} expected"
        raise BundleError(f"{path}: {what}. {advice}")
    return fd, info.st_size


def read_regular(path: Path, max_bytes: int, follow_symlinks: bool = False, advice: str = BUNDLE_ADVICE) -> bytes:
    """The whole file, if it is a regular file of at most `max_bytes`."""
    fd, size = _open_regular(path, max_bytes, follow_symlinks, advice)
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:  # grew after the fstat
        raise BundleError(f"{path}: over the {max_bytes} bytes expected. {advice}")
    return data


def read_verified(path: Path, sha256: str, size: int, on_read=None) -> torch.Tensor:
    """The file as a uint8 tensor (one buffer, no copy), if it is `size` bytes (checked before
    anything is allocated or read: a file grown to a terabyte costs nothing) that hash to `sha256`.
    `on_read(n)` is told each chunk's bytes as they come (a progress bar)."""
    fd, found = _open_regular(path, MAX_FILE_BYTES, follow_symlinks=False)
    if found != size:
        os.close(fd)
        raise BundleError(f"{path}: {found} bytes, but the manifest says {size}: the file was cut short, grown, "
                          "replaced or corrupted. Recompile the bundle or copy it again.")
    buffer = huge_pages.empty((size,), torch.uint8)  # (read through at every step)
    view = memoryview(buffer.numpy())
    digest = hashlib.sha256()
    with os.fdopen(fd, "rb", buffering=0) as f:
        done = 0
        while done < size:
            n = f.readinto(view[done : done + CHUNK])
            if not n:
                break
            digest.update(view[done : done + n])
            done += n
            if on_read:
                on_read(n)
        grew = f.read(1)
    if done != size or grew or digest.hexdigest() != sha256:
        raise BundleError(f"{path}: checksum mismatch, the file is corrupt or was modified. Recompile the bundle or copy it again.")
    return buffer


class BundleFiles:
    """A bundle's files for use, by their path in the manifest: each read once, its size compared
    with the manifest's before it is read and its sha256 as it is read (`on_read`: read_verified's)."""

    def __init__(self, bundle: Path, sha256: dict[str, str], sizes: dict[str, int], on_read=None):
        self.bundle, self.sha256, self.sizes, self.on_read = Path(bundle), sha256, sizes, on_read

    def tensor(self, rel: str) -> torch.Tensor:
        """uint8 [file bytes] (the weights: viewed in place, never copied)."""
        return read_verified(self.bundle / rel, self.sha256[rel], self.sizes[rel], self.on_read)

    def bytes(self, rel: str) -> bytes:
        return self.tensor(rel).numpy().tobytes()

    def text(self, rel: str) -> str:
        try:
            return self.bytes(rel).decode("utf-8")
        except UnicodeDecodeError:
            raise BundleError(f"{self.bundle / rel}: not UTF-8 text. Recompile the bundle.") from None
