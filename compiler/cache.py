"""The compile cache: one directory per region fingerprint (which already covers the backend, its
options and the toolchain versions), written atomically, holding successes only.

Each entry records its artifact's sha256, verified on every hit: an entry that was corrupted or
edited is dropped and the region compiled again, never shipped inside a bundle."""

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from deepinfer.runtime.manifest import sha256_file


class CompileCache:
    def __init__(self, root: Path):
        self.root = Path(root)
        (self.root / "regions").mkdir(parents=True, exist_ok=True)

    def _entry(self, fingerprint: str) -> Path:
        return self.root / "regions" / fingerprint

    def has(self, fingerprint: str) -> bool:
        """Whether an entry is stored (unverified: `get` verifies it)."""
        return (self._entry(fingerprint) / "meta.json").exists()

    def get(self, fingerprint: str) -> Path | None:
        """The cached artifact, verified against its recorded sha256; None on a miss or a bad entry."""
        entry = self._entry(fingerprint)
        if not entry.exists():
            return None
        try:
            meta = json.loads((entry / "meta.json").read_text())
            artifact = entry / meta["artifact"]
            if sha256_file(artifact) == meta["sha256"]:
                return artifact
        except (OSError, ValueError, KeyError, TypeError):
            pass
        print(f"deepinfer-compile: cache entry {entry} is damaged (its artifact does not match its recorded sha256); "
              "dropping it and compiling the region again.", file=sys.stderr)
        self._drop(entry)
        return None

    def put(self, fingerprint: str, artifact: Path, meta: dict) -> Path:
        """Copy artifact in under a temporary name, then rename the whole entry into place, so a
        reader never sees half an entry and concurrent writers of one fingerprint cannot collide."""
        staging = Path(tempfile.mkdtemp(prefix=f".{fingerprint}.", dir=self.root / "regions"))
        name = f"artifact.{artifact.name.split('.', 1)[1]}"
        shutil.copyfile(artifact, staging / name)
        meta = {**meta, "artifact": name, "sha256": sha256_file(staging / name)}
        (staging / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.rename(staging, self._entry(fingerprint))
        except OSError:  # another compile stored it first; theirs is as good as ours (once verified)
            shutil.rmtree(staging)
            return self.get(fingerprint)
        return self._entry(fingerprint) / name

    def _drop(self, entry: Path):
        aside = Path(tempfile.mkdtemp(prefix=f".{entry.name}.bad.", dir=entry.parent))
        try:
            os.rename(entry, aside / "entry")
        except OSError:
            pass  # someone else dropped or replaced it
        shutil.rmtree(aside, ignore_errors=True)

    def work_dir(self, fingerprint: str) -> Path:
        """Scratch space for one compile of a region: its graph file and log, in a directory of its
        own (two compiles sharing this cache may compile one region at once). Removed once the
        region is cached (prune_work); kept after a failure, for the reproduce command."""
        (self.root / "work").mkdir(exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"{fingerprint}.", dir=self.root / "work"))

    def prune_work(self, work: Path):
        shutil.rmtree(work, ignore_errors=True)
