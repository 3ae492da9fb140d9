"""Writing a bundle: into a staging directory beside the output, then renamed into place, so a
failed or interrupted compile never leaves a half-written bundle behind.

The output directory is only ever replaced when it holds a deepinfer bundle (its manifest has the
bundle magic) or nothing at all: `--out ~/thesis` must not delete a thesis."""

import contextlib
import fcntl
import json
import os
import shutil
from pathlib import Path

from deepinfer.runtime.errors import DeepinferError
from deepinfer.runtime.manifest import MAGIC, Manifest, sha256_file, sign

from .recipe import RecipeError


def check_output(out: Path):
    """Refuse an output path that exists and is not a bundle (checked before any compile work,
    and again just before the old bundle is replaced: it may have changed meanwhile)."""
    out = Path(out)
    if not out.exists() and not out.is_symlink():
        return
    if out.is_symlink() or not out.is_dir():
        raise RecipeError(f"output {out}: exists and is not a directory; choose another output (--out or the recipe's output:).")
    if not any(out.iterdir()):
        return
    try:
        magic = json.loads((out / "manifest.json").read_text()).get("magic")
    except (OSError, ValueError, AttributeError):
        magic = None
    if magic != MAGIC:
        raise RecipeError(f"output {out}: the directory holds files that are not a deepinfer bundle (no bundle manifest.json), "
                          "and compiling would replace them. Choose an empty or new directory (--out or the recipe's "
                          "output:), or remove it yourself if its contents are expendable.")


@contextlib.contextmanager
def output_lock(out: Path):
    """Held for a whole compile into `out`: a second compile into the same output stops at once
    with a message, instead of both finishing and the last rename silently winning. The lock is a
    file beside the output (`.NAME.lock`, holding the pid), removed when the compile ends; the
    kernel drops the lock itself if the process dies."""
    out = Path(out)
    path = out.parent / f".{out.name}.lock"
    made = [d for d in [out.parent, *out.parent.parents] if not d.exists()]  # (removed again if no bundle comes)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd = _locked(path, out)
    except OSError as err:
        raise DeepinferError(f"output {out}: cannot write beside it ({err.strerror}: {err.filename}); choose another "
                             "output (--out or the recipe's output:).") from None
    try:
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.unlink(path)  # (before the lock goes: a compile waiting on this file finds it gone and takes a new one)
        os.close(fd)
        for directory in made if not out.exists() else ():  # a failed compile leaves no directories behind
            with contextlib.suppress(OSError):
                directory.rmdir()


def _locked(path: Path, out: Path) -> int:
    """A descriptor of `path` holding its exclusive lock, the file still at that path."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DeepinferError(f"output {out}: another deepinfer-compile (pid {holder}) is compiling into it now. Wait "
                                 "for it to finish, or compile into another directory (--out or the recipe's output:).") from None
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # a compile that just finished removed this file: lock the new one


def write_bundle(out: Path, manifest: Manifest, region_files: dict[str, Path], write_weights,
                 extra_files: dict[str, bytes], sign_key: bytes | None = None) -> Path:
    """`write_weights(directory)` writes the manifest's weight files into `directory` (None: a
    bundle without weights, --no-weights);
    `extra_files` (name -> content) are the tokenizer files the manifest names; with
    `sign_key` the manifest (which lists every file's sha256) is signed with it."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        (staging / "regions").mkdir(parents=True)
        (staging / "weights").mkdir()
        for fingerprint, region in manifest.regions.items():
            shutil.copyfile(region_files[fingerprint], staging / region.file)
        if write_weights is not None:
            write_weights(staging / "weights")
        for name, content in extra_files.items():
            (staging / name).write_bytes(content)
        written = [p for p in sorted(staging.rglob("*")) if p.is_file()]
        manifest.files = {str(p.relative_to(staging)): sha256_file(p) for p in written}
        manifest.sizes = {str(p.relative_to(staging)): p.stat().st_size for p in written}
        (staging / "manifest.json").write_text(manifest.to_json())
        if sign_key is not None:
            sign(staging, sign_key)
        _replace(staging, out)
    except OSError as err:  # a full disk, a quota, a read-only directory: nothing is left half-written
        raise DeepinferError(f"output {out}: the bundle could not be written ({err.strerror} writing "
                             f"{err.filename or staging}). Nothing was written (the staging directory was removed); "
                             "free space or choose another output (--out), then run the same command again: "
                             "compiled regions are cached.") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _replace(new: Path, out: Path):
    """Swap `new` into `out`; an existing bundle is moved aside first and removed after."""
    check_output(out)
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        os.rename(out, old)
    os.rename(new, out)
    shutil.rmtree(old, ignore_errors=True)
