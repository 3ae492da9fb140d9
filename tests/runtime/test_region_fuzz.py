"""Property: an export region file mutated at any path (values and types, the probe's payloads
among them), re-checksummed as an attacker would, loads or is refused with a BundleError; it
never runs code (no marker file), never raises anything else, never hangs.

    .venv/bin/python -m pytest tests/runtime/test_region_fuzz.py -s     # prints the tally
"""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer.runtime.backends import export
from deepinfer.runtime.errors import BundleError
from deepinfer.runtime.manifest import Manifest
from tests.compiler.test_recipe_fuzz import apply_edits, paths

TALLY = {"regions": 0, "loaded": 0, "clean errors": 0}


@pytest.fixture(scope="module")
def region(tiny_bundle):
    """(parsed region file, its manifest entry): the smallest region of the tiny export bundle."""
    bundle = tiny_bundle("export")
    manifest = Manifest.from_dict(json.loads((bundle / "manifest.json").read_text()))
    entry = min(manifest.regions.values(), key=lambda r: (bundle / r.file).stat().st_size)
    return json.loads((bundle / entry.file).read_bytes()), entry


def payloads(marker) -> st.SearchStrategy:
    code = f"__import__('os').system('touch {marker}')"
    return st.sampled_from([
        code, f"{code} + 64", {"as_expr": {"expr_str": f"{code} + 64", "hint": {"as_int": 64}}},
        {"as_sym_int": {"as_expr": {"expr_str": code}}}, {"as_name": code}, "builtins.eval", "os.system",
        "torch.ops.aten.__class__.__subclasses__", "torch.ops.aten.add", "Infinity", "[" * 50,
        {"as_graph": {"name": "g", "graph": {}}}, {"as_custom_obj": {"name": "x", "class_fqn": "os.system"}},
    ])


def values(marker) -> st.SearchStrategy:
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 70), st.sampled_from([2**63, -(2**64), 10**400]),
                        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8), payloads(marker))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=2),
                        max_leaves=5)


def test_mutated_regions_load_or_fail_cleanly(region, tmp_path):
    program, entry = region
    export.load(json.dumps(program).encode(), entry, "unchanged.ep.json")  # the base loads
    marker = tmp_path / "PWNED"
    all_paths = list(paths(program))
    actions = st.sampled_from(["set", "set", "set", "delete"]) | st.sampled_from(["as_expr", "extra", "as_sym_int"]).map(lambda k: "add:" + k)

    @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(st.tuples(st.sampled_from(all_paths), actions, values(marker)), min_size=1, max_size=3))
    def check(edits):
        data = json.dumps(apply_edits(program, edits)).encode()
        TALLY["regions"] += 1
        try:
            export.load(data, entry, "fuzzed.ep.json")
            TALLY["loaded"] += 1
        except BundleError:
            TALLY["clean errors"] += 1
        assert not marker.exists()

    check()
    print(f"\nregion fuzz: {TALLY}; code execution 0, tracebacks 0, hangs 0 (any would have failed this test)")
