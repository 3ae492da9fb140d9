"""The README's tour runs as written, and the docs build as a site with no broken link.

The tour's `sh` blocks and its `python` blocks run in the README's order as one bash script (a
python block as `python - <<EOF`), in a fresh directory holding the repository's recipes and
checkpoints, with this test process's environment (`.venv` its own), the session's compile cache
and a free port in place of 8000. Blocks fenced `text` are synopses, not run.
"""

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.M | re.S)


def blocks(markdown: str) -> list[tuple[str, str]]:
    """(language, code) of each fenced block, in order."""
    return [(m.group(1), m.group(2)) for m in BLOCK.finditer(markdown)]


def as_script(markdown: str, port: int) -> str:
    """The sh and python blocks as one bash script, stopping at the first failure."""
    parts = ["set -euo pipefail"]
    for language, code in blocks(markdown):
        if language == "sh":
            parts.append(code)
        elif language == "python":
            parts.append(f"python - <<'PYTHON'\n{code}PYTHON")
    return "\n".join(parts).replace("8000", str(port))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_readmes_tour_runs_as_written(tmp_path, cache_dir):
    readme = (ROOT / "README.md").read_text()
    assert {language for language, _ in blocks(readme)} <= {"sh", "python", "text"}
    for name in ("recipes", "checkpoints"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    script = as_script(readme, free_port())
    run = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=900,
                         env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "DEEPINFER_CACHE_DIR": str(cache_dir),
                              "HOME": str(tmp_path)})
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "'hello' -> " in run.stdout, out[-4000:]  # deepinfer-run generated
    assert "deepinfer-serve: ready:" in run.stderr and "serving 'tiny-code-eval'" in run.stderr, out[-4000:]
    assert "completion_tokens=16" in run.stderr, out[-4000:]  # the client's call, in the access log


def test_the_readme_links_pages_that_exist():
    readme = (ROOT / "README.md").read_text()
    linked = re.findall(r"\]\((docs/[\w-]+\.md)\)", readme)
    assert linked and all((ROOT / page).is_file() for page in linked)
    assert set(linked) == {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")} - {"docs/index.md"}


def test_the_docs_build_and_a_broken_link_fails_the_build(tmp_path):
    mkdocs = [str(Path(sys.executable).parent / "mkdocs"), "build"]  # (--quiet would stop strict mode counting warnings)
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run([*mkdocs, "--site-dir", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "site" / "serving" / "index.html").is_file()
    copy = tmp_path / "copy"
    shutil.copytree(ROOT / "docs", copy / "docs")
    shutil.copy(ROOT / "mkdocs.yml", copy)
    (copy / "docs" / "index.md").write_text((copy / "docs" / "index.md").read_text() + "\n[gone](no-such-page.md)\n")
    run = subprocess.run([*mkdocs, "--site-dir", str(tmp_path / "site2")], cwd=copy, capture_output=True, text=True,
                         timeout=300, env=env)
    assert run.returncode != 0 and "no-such-page.md" in run.stderr, run.stderr[-3000:]
