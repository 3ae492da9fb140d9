"""Writing a bundle: into a staging directory beside the output, then renamed into place, so a
failed or interrupted compile never leaves a half-written bundle behind."""

import os
import shutil
from pathlib import Path

from deepinfer.runtime.manifest import Manifest, sha256_file


def write_bundle(out: Path, manifest: Manifest, region_files: dict[str, Path], write_weights,
                 tokenizer_file: Path | None) -> Path:
    """`write_weights(directory)` writes the manifest's weight files into `directory`."""
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
        if tokenizer_file is not None:
            shutil.copyfile(tokenizer_file, staging / manifest.tokenizer)
        manifest.files = {str(p.relative_to(staging)): sha256_file(p) for p in sorted(staging.rglob("*")) if p.is_file()}
        (staging / "manifest.json").write_text(manifest.to_json())
        _replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _replace(new: Path, out: Path):
    """Swap `new` into `out`; an existing bundle is moved aside first and removed after."""
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        os.rename(out, old)
    os.rename(new, out)
    shutil.rmtree(old, ignore_errors=True)
