"""The docs' long examples, the ones marked `<!-- example: bench -->` (training the tiny models, a
Ray cluster of one, bisect on a crashing backend, two hosts on one machine, the tiny V4 through
export and through pjrt): run as written, after the README's tour, each timed. The test suite runs every other
example (tests/test_docs.py); tests/markdown_examples.py says how a page's examples run.

    .venv/bin/python bench/docs_examples.py               # all of them: about an hour on 2 cores (training is 50 minutes)
    .venv/bin/python bench/docs_examples.py --skip-training

It works in a fresh temporary directory with its own compile cache; the checkpoints are copied
there, since training overwrites them.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.markdown_examples import RUN, examples, pages, reader_directory, run_commands  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-training", action="store_true", help="leave out the examples that run tools/train_tiny.py")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="deepinfer-docs-") as work:
        directory = Path(work) / "reader"
        reader_directory(directory, copied=("checkpoints",))
        cache = Path(work) / "cache"
        tour = [e for e in examples(ROOT / "README.md") if e.language in RUN]
        long = [e for page in pages() for e in examples(page) if e.bench and e.language in RUN
                and not (args.skip_training and "train_tiny.py" in e.code)]
        failed = 0
        for name, commands in [("README.md tour", tour), *((f"{e.page}:{e.line}", [e]) for e in long)]:
            start = time.perf_counter()
            run = run_commands(commands, directory, cache, timeout=4 * 3600)
            seconds = time.perf_counter() - start
            print(f"{name:32s} {'ok' if run.returncode == 0 else f'FAILED (exit {run.returncode})':18s} {seconds:8.1f} s", flush=True)
            if run.returncode != 0:
                failed += 1
                print((run.stdout + run.stderr)[-3000:], file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
