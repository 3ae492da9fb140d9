"""Writing a bundle: into a staging directory beside the output, then renamed into place, so a
failed or interrupted compile never leaves a half-written bundle behind.

The output directory is only ever replaced when it holds a deepinfer bundle (its manifest has the
bundle magic) or nothing at all: `--out ~/thesis` must not delete a thesis."""

import json
import os
import shutil
from pathlib import Path

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


def write_bundle(out: Path, manifest: Manifest, region_files: dict[str, Path], write_weights,
                 extra_files: dict[str, bytes], sign_key: bytes | None = None) -> Path:
    """`write_weights(directory)` writes the manifest's weight files into `directory`;
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
