"""Every example of README.md and the docs pages runs as written (tests/markdown_examples.py says
how: the README's tour first, then each page in the site's order, in one reader's directory), and
the docs build as a site with no broken link."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.markdown_examples import LANGUAGES, RUN, check_recipe_text, examples, pages, reader_directory, run_commands

DOCS = [page for page in pages() if page.parent.name == "docs"]


@pytest.fixture(scope="module")
def reader(tmp_path_factory, cache_dir):
    """(directory, the README tour's run): the directory later pages run in."""
    directory = reader_directory(tmp_path_factory.mktemp("reader"))
    tour = [e for e in examples(ROOT / "README.md") if e.language in RUN]
    return directory, run_commands(tour, directory, cache_dir, timeout=900)


def test_the_readmes_tour_runs_as_written(reader):
    _, run = reader
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "'hello' -> " in run.stdout, out[-4000:]  # deepinfer-run generated
    assert "deepinfer-serve: ready:" in run.stderr and "serving 'tiny-code-eval'" in run.stderr, out[-4000:]
    assert "completion_tokens=16" in run.stderr, out[-4000:]  # the client's call, in the access log


@pytest.mark.parametrize("page", DOCS, ids=lambda page: page.name)
def test_a_docs_pages_examples_run_as_written(page, reader, cache_dir):
    directory, tour = reader
    assert tour.returncode == 0, "the README's tour failed (its own test says how)"
    found = examples(page)
    assert {e.language for e in found} <= set(LANGUAGES), f"{page.name}: fence a block as one of {LANGUAGES}"
    for example in found:
        if example.language == "yaml" and not example.bench:
            check_recipe_text(example, directory)
    commands = [e for e in found if e.language in RUN and not e.bench]
    if commands:
        run = run_commands(commands, directory, cache_dir, timeout=900)
        assert run.returncode == 0, (run.stdout + run.stderr)[-5000:]


def test_examples_are_found_where_they_are_and_a_wrong_one_fails(tmp_path, cache_dir):
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n```sh\necho ran > made\n```\n\n<!-- example: bench -->\n```sh\nexit 3\n```\n\n"
                    "```yaml\nkv: {max_seqs: 4, max_len: 512}\nmethods: {decode: {buckets: [1, 16]}}\n```\n")
    first, slow, recipe = examples(page)
    assert (first.line, first.bench, slow.bench, slow.line) == (3, False, True, 8)
    assert run_commands([first], reader_directory(tmp_path / "dir"), cache_dir, timeout=60).returncode == 0
    assert (tmp_path / "dir" / "made").read_text() == "ran\n"
    assert run_commands([first, slow], tmp_path / "dir", cache_dir, timeout=60).returncode == 3
    from deepinfer.compiler.recipe import RecipeError

    with pytest.raises(RecipeError, match="methods.decode.buckets"):  # a decode batch past kv.max_seqs
        check_recipe_text(recipe, tmp_path)


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
