"""The fenced examples of README.md and the docs pages, run the way a reader would run them.

- ```sh and ```python blocks are commands: a page's run in its order as one bash script (a python
  block as `python - <<'PYTHON'`), stopping at the first failure;
- ```text blocks are synopses (placeholders such as RECIPE or DIR): not run;
- ```yaml blocks are recipe text: a whole recipe (it has a `name`) or keys to put in one (laid over
  recipes/tiny-code.yaml), loaded and checked like `deepinfer-compile` does;
- a block right after the line `<!-- example: bench -->` takes long (training, a cluster, every
  recipe): bench/docs_examples.py runs those, the test suite the others.

Pages run in one directory holding the repository's recipes, checkpoints and examples, README
first: a page may use the tour's bundles, as a reader who took the tour would. Port 8000 becomes a
free port, so that a page's server cannot meet another's.
"""

import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
BENCH_MARK = "<!-- example: bench -->"
BLOCK = re.compile(r"^(?:(<!-- example: \w+ -->)\n)?```(\w+)\n(.*?)^```$", re.M | re.S)
RUN = ("sh", "python")
LANGUAGES = (*RUN, "text", "yaml")
SHARED = ("recipes", "checkpoints", "examples")
PORTS = ("8000", "29500")  # a server's, torchrun's rendezvous


@dataclass
class Example:
    page: str
    line: int
    language: str
    code: str
    bench: bool


def pages() -> list[Path]:
    """README.md, then the docs site's pages in its navigation's order."""
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    return [ROOT / "README.md", *(ROOT / "docs" / page for entry in nav for page in entry.values())]


def examples(page: Path) -> list[Example]:
    text = page.read_text()
    found = []
    for match in BLOCK.finditer(text):
        marker, language, code = match.groups()
        if marker not in (None, BENCH_MARK):
            raise ValueError(f"{page.name}: unknown example marker {marker}; the one there is: {BENCH_MARK}")
        line = text.count("\n", 0, match.start(2)) + 1
        name = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page.name
        found.append(Example(str(name), line, language, code, bench=marker is not None))
    return found


def script(commands: list[Example]) -> str:
    """The sh and python examples as one bash script that stops at the first failure."""
    parts = ["set -euo pipefail", "trap 'kill $(jobs -p) 2> /dev/null || true' EXIT"]  # (a server a failed page left)
    for example in commands:
        parts.append(f"echo '# {example.page}:{example.line}' >&2")
        parts.append(example.code if example.language == "sh" else f"python - <<'PYTHON'\n{example.code}PYTHON")
    text = "\n".join(parts)
    for port in PORTS:
        text = text.replace(port, str(free_port()))
    return text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reader_directory(directory: Path, copied: tuple[str, ...] = ()) -> Path:
    """A working directory as a reader's checkout: the repository's recipes, checkpoints and
    examples (linked; those named in `copied` copied, for examples that write there), and this
    Python's environment as .venv."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in SHARED:
        if name in copied:
            shutil.copytree(ROOT / name, directory / name)
        else:
            (directory / name).symlink_to(ROOT / name)
    (directory / ".venv").symlink_to(Path(sys.executable).parent.parent)
    return directory


def run_commands(commands: list[Example], directory: Path, cache_dir: Path, timeout: float) -> subprocess.CompletedProcess:
    """Run the commands in `directory` with this Python's environment on PATH (a reader who
    activated .venv) and `cache_dir` as the compile cache."""
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "DEEPINFER_CACHE_DIR": str(cache_dir),
           "HOME": str(directory), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "DO_NOT_TRACK": "1"}
    return subprocess.run(["bash", "-c", script(commands)], cwd=directory, capture_output=True, text=True,
                          timeout=timeout, env=env)


def check_recipe_text(example: Example, directory: Path):
    """Load a yaml example as a recipe (keys laid over recipes/tiny-code.yaml when it has no name);
    raises RecipeError naming the page's line when a key or value is wrong."""
    from deepinfer.compiler.recipe import load_recipe

    recipe = yaml.safe_load(example.code)
    if "name" not in recipe:
        base = yaml.safe_load((ROOT / "recipes" / "tiny-code.yaml").read_text())
        recipe = {**base, **{key: {**base[key], **value} if isinstance(value, dict) and isinstance(base.get(key), dict) else value
                             for key, value in recipe.items()}}
    path = directory / f"{Path(example.page).stem}-line-{example.line}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return load_recipe(path, backend_installed=False)
