"""The compile cache: one directory per region fingerprint (which already covers the backend, its
options and the toolchain versions), written atomically, holding successes only."""

import json
import os
import shutil
import tempfile
from pathlib import Path


class CompileCache:
    def __init__(self, root: Path):
        self.root = Path(root)
        (self.root / "regions").mkdir(parents=True, exist_ok=True)

    def _entry(self, fingerprint: str) -> Path:
        return self.root / "regions" / fingerprint

    def get(self, fingerprint: str) -> Path | None:
        entry = self._entry(fingerprint)
        artifacts = list(entry.glob("artifact.*")) if (entry / "meta.json").is_file() else []
        return artifacts[0] if artifacts else None

    def put(self, fingerprint: str, artifact: Path, meta: dict) -> Path:
        """Copy artifact in under a temporary name, then rename the whole entry into place, so a
        reader never sees half an entry and concurrent writers of one fingerprint cannot collide."""
        staging = Path(tempfile.mkdtemp(prefix=f".{fingerprint}.", dir=self.root / "regions"))
        shutil.copyfile(artifact, staging / f"artifact.{artifact.name.split('.', 1)[1]}")
        (staging / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.rename(staging, self._entry(fingerprint))
        except OSError:  # another compile stored it first; theirs is as good as ours
            shutil.rmtree(staging)
        return self.get(fingerprint)

    def work_dir(self, fingerprint: str) -> Path:
        """Scratch space for a region's compile: its graph file and log (kept on failure for repro)."""
        path = self.root / "work" / fingerprint
        path.mkdir(parents=True, exist_ok=True)
        return path
