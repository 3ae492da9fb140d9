"""Property: a manifest edited in any way (and re-checksummed, as an attacker would) loads, or is
refused with a BundleError; never a traceback (KeyError, TypeError, IndexError ...), never a hang.

    .venv/bin/python -m pytest tests/runtime/test_manifest_fuzz.py -s     # prints the tally
"""

import json
import shutil

import pytest
from hypothesis import HealthCheck, given, settings

from deepinfer.runtime.errors import DeepinferError
from deepinfer.runtime.executor import BundleExecutor
from deepinfer.runtime.manifest import BundleError, _checksum
from tests.compiler.test_recipe_fuzz import apply_edits, edits_of

TALLY = {"manifests": 0, "loaded": 0, "clean errors": 0}


@pytest.fixture(scope="module")
def bundle(tiny_bundle, tmp_path_factory):
    copy_dir = tmp_path_factory.mktemp("fuzz") / "bundle"
    shutil.copytree(tiny_bundle("export"), copy_dir)
    return copy_dir


@pytest.fixture(scope="module")
def body(bundle):
    return json.loads((bundle / "manifest.json").read_text())


def test_mutated_manifests_load_or_fail_cleanly(bundle, body):
    @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
    @given(edits_of(body))
    def check(edit_list):
        mutated = apply_edits(body, edit_list)
        mutated["checksum"] = _checksum(mutated)
        (bundle / "manifest.json").write_text(json.dumps(mutated))
        TALLY["manifests"] += 1
        try:
            BundleExecutor(bundle)
            TALLY["loaded"] += 1
        except BundleError:
            TALLY["clean errors"] += 1
        except DeepinferError as err:
            raise AssertionError(f"not a BundleError: {err}")

    try:
        check()
    finally:
        (bundle / "manifest.json").write_text(json.dumps(body))
    print(f"\nmanifest fuzz: {TALLY}; tracebacks 0, hangs 0 (any would have failed this test)")
