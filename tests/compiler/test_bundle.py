"""The output directory: only a bundle (or nothing) is ever replaced; the name is one path component."""

import os
import subprocess
import sys

import pytest

from deepinfer.compiler.build import compile_recipe
from deepinfer.compiler.recipe import RecipeError, load_recipe
from tests.conftest import TINY_RECIPE, write_recipe


def compile_cli(*args):
    return subprocess.run([sys.executable, "-m", "deepinfer.compiler.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=600)


def test_a_directory_of_user_files_is_refused_and_left_alone(tmp_path, cache_dir):
    mywork = tmp_path / "mywork"
    (mywork / "code").mkdir(parents=True)
    (mywork / "thesis.txt").write_text("thesis")
    run = compile_cli(TINY_RECIPE, "--backend", "export", "--out", mywork, "--cache-dir", cache_dir)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "not a deepinfer bundle" in run.stderr and str(mywork) in run.stderr
    assert (mywork / "thesis.txt").read_text() == "thesis" and (mywork / "code").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mywork"]  # no staging left either


def test_a_file_as_output_is_refused(tmp_path, cache_dir):
    out = tmp_path / "notes.txt"
    out.write_text("notes")
    recipe = load_recipe(write_recipe(tmp_path, backend={"name": "export"}), output=out)
    with pytest.raises(RecipeError, match=r"notes.txt: exists and is not a directory"):
        compile_recipe(recipe, cache_dir=cache_dir, progress=False)
    assert out.read_text() == "notes"


def test_an_empty_directory_and_an_old_bundle_are_replaced(tiny_bundle, tmp_path, cache_dir):
    tiny_bundle("export")  # the session cache holds the regions
    out = tmp_path / "empty"
    out.mkdir()
    recipe = load_recipe(TINY_RECIPE, backend="export", output=out)
    compile_recipe(recipe, cache_dir=cache_dir, progress=False)
    compile_recipe(recipe, cache_dir=cache_dir, progress=False)  # over its own bundle
    assert (out / "manifest.json").is_file()


@pytest.mark.parametrize("name", ["", "..", "../escape", "a/b", "/abs", ".hidden", "x" * 200])
def test_name_must_be_one_path_component(tmp_path, name):
    path = write_recipe(tmp_path)
    text = path.read_text().replace("name: tiny", f"name: {name!r}")
    text = "\n".join(line for line in text.splitlines() if not line.startswith("output:"))  # name decides the output
    path.write_text(text)
    with pytest.raises(RecipeError, match=r"name: .* must be one path component"):
        load_recipe(path)


def test_a_second_compile_into_the_same_output_stops_at_once(tmp_path, cache_dir):
    """While one compile holds an output, another into it exits 1 naming the holder's pid; the
    lock file goes with the compile that held it."""
    from deepinfer.compiler.bundle import output_lock

    out = tmp_path / "bundle"
    with output_lock(out):
        run = compile_cli(TINY_RECIPE, "--backend", "export", "--out", out, "--cache-dir", cache_dir)
        assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
        assert f"another deepinfer-compile (pid {os.getpid()}) is compiling into it now" in run.stderr, run.stderr
        assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_leaves_nothing_half_written(tiny_bundle, tmp_path, cache_dir):
    """A bundle that cannot be written (here: a file size limit, as a full disk or a quota would
    stop it) is one paragraph and exit 1, with no bundle, staging or lock left behind."""
    import resource
    import signal

    tiny_bundle("export")  # (the session cache holds the regions: only the bundle is written)
    limit = 64 << 10

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (a write past the limit fails with EFBIG instead)

    out = tmp_path / "out" / "bundle"
    run = subprocess.run([sys.executable, "-m", "deepinfer.compiler.cli", str(TINY_RECIPE), "--backend", "export", "--out",
                          str(out), "--cache-dir", str(cache_dir)], capture_output=True, text=True, timeout=600, preexec_fn=limited)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert "the bundle could not be written (File too large writing" in run.stderr, run.stderr
    assert "Nothing was written" in run.stderr and list(tmp_path.iterdir()) == []  # (not even the directory made for it)
