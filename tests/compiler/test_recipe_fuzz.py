"""Property: any recipe, however mangled, loads or is refused with a RecipeError naming a key;
never a traceback, never a hang. Hypothesis mutates the tiny recipe (values of every type in
every place, deleted keys, unknown keys) and also feeds raw bytes.

    .venv/bin/python -m pytest tests/compiler/test_recipe_fuzz.py -s     # prints the tally
"""

import copy
import math

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer.compiler.recipe import RecipeError, load_recipe
from deepinfer.runtime.errors import DeepinferError
from tests.conftest import TINY_RECIPE

BASE = yaml.safe_load(TINY_RECIPE.read_text())
EXPORT_BASE = {**BASE, "backend": {"name": "export", "options": {}}}
TALLY = {"recipes": 0, "loaded": 0, "clean errors": 0}

scalars = st.one_of(
    st.none(), st.booleans(), st.text(max_size=12),
    st.integers(min_value=-3, max_value=3), st.sampled_from([2**31, 2**63, 2**64, 10**9, 10**6, -(2**63)]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(["inductor", "export", "aten.topk", "layers.*", "../x"]),
)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                      max_leaves=6)


def paths(tree, prefix=()):
    """Every key path in the recipe (dicts only; list items by index)."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield prefix + (key,)
            yield from paths(value, prefix + (key,))
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield prefix + (i,)
            yield from paths(value, prefix + (i,))


def apply_edits(tree, edits):
    """A copy of tree with each (path, action, value) applied where the path still leads somewhere:
    set a value, delete a key or item, or add `value` under a new key (action "add:<key>")."""
    tree = copy.deepcopy(tree)
    for path, action, value in edits:
        parent = tree
        for key in path[:-1]:
            try:
                parent = parent[key]
            except (KeyError, IndexError, TypeError):
                parent = None
                break
        last = path[-1]
        if not isinstance(parent, (dict, list)) or isinstance(parent, dict) != isinstance(last, str):
            continue  # (JSON and recipe mappings have string keys)
        try:
            if action == "delete":
                del parent[last]
            elif action.startswith("add:") and isinstance(parent, dict):
                parent[action[4:]] = value
            else:
                parent[last] = value
        except (KeyError, IndexError):
            pass
    return tree


@st.composite
def edits_of(draw, tree):
    """1-3 edits over tree's key paths."""
    all_paths = list(paths(tree)) + [("regions", "boundaries", 0)]
    actions = st.sampled_from(["set", "set", "delete"]) | st.text(min_size=1, max_size=8).map(lambda k: "add:" + k)
    return [(draw(st.sampled_from(all_paths)), draw(actions), draw(values)) for _ in range(draw(st.integers(1, 3)))]


def check(path):
    TALLY["recipes"] += 1
    try:
        load_recipe(path)
        TALLY["loaded"] += 1
    except RecipeError as err:
        TALLY["clean errors"] += 1
        assert str(path) in str(err) and "Traceback" not in str(err)
    except DeepinferError as err:  # pragma: no cover - every load error should be a RecipeError
        raise AssertionError(f"not a RecipeError: {type(err).__name__}: {err}")


@settings(max_examples=300, deadline=5000, suppress_health_check=list(HealthCheck))
@given(edits_of(EXPORT_BASE))
def test_mutated_recipes_load_or_fail_cleanly(tmp_path_factory, edits):
    path = tmp_path_factory.mktemp("fuzz") / "recipe.yaml"
    path.write_text(yaml.safe_dump(apply_edits(EXPORT_BASE, edits), allow_unicode=True))
    check(path)


@settings(max_examples=100, deadline=5000, suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=400))
def test_raw_bytes_load_or_fail_cleanly(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("fuzz") / "recipe.yaml"
    path.write_bytes(TINY_RECIPE.read_bytes()[: len(data) % 900] + data)
    check(path)


def assert_refused(path, message):
    try:
        load_recipe(path)
    except RecipeError as err:
        assert message in str(err) and str(path) in str(err), str(err)
    else:
        raise AssertionError(f"{path} loaded; expected {message!r}")


def test_known_bad_recipes(tmp_path):
    """The classes a hostile probe found, each by name."""
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
    for name, text, message in [("alias-bomb", bomb.encode(), "anchors and aliases (&name, *name) are not supported"),
                                ("deep", ("name: " + "[" * 5000 + "]" * 5000).encode(), "nested too deeply"),
                                ("latin-1", b"name: \xff\xfe tiny\n", "not UTF-8")]:
        path = tmp_path / f"{name}.yaml"
        path.write_bytes(text)
        assert_refused(path, message)
    inline = [
        ({"n_group": 0}, "n_group=0 must be positive"),
        ({"topk_group": 9}, "topk_group=9 exceeds n_group=4"),
        ({"hidden_size": "64"}, "hidden_size='64' must be an integer"),
        ({"num_hidden_layers": 1000000}, "past the largest supported value"),
        ({"hiden_size": 64}, "unknown field(s) ['hiden_size']"),
        ({"rms_norm_eps": math.nan}, "rms_norm_eps=nan must be a positive finite number"),
        ({"intermediate_size": 0}, "intermediate_size=0 must be positive"),
    ]
    top = [
        ({"kv": {"max_seqs": 4, "max_len": 2**64}}, "does not fit in 64 bits"),
        ({"kv": {"max_seqs": 4, "max_len": 2**40}}, "kv.max_len: must be in"),
        ({"kv": {"max_seqs": 10**9, "max_len": 256}}, "kv.max_seqs: must be in"),
        ({"kv": {"max_seqs": 4, "max_len": 512}}, "past the model's max_position_embeddings=256"),
        ({"regions": {"boundaries": [{"op": 5}]}}, "both strings"),
        ({"backend": {"name": "inductor", "options": {"max_autotun": True}}}, "not inductor configs"),
        ({"backend": {"name": "inductor", "options": {"max_autotune": "yes"}}}, "expects a bool"),
        ({"backend": {"name": "export", "options": {"foo": 1}}}, "takes no options"),
        ({"model": {"arch": "deepseek_v9", "config": BASE["model"]["config"]}}, "model.arch='deepseek_v9' is not supported"),
        ({"model": {"config": BASE["model"]["config"], "seed": 2**63}}, "does not fit in 64 bits"),
    ]
    for i, (change, message) in enumerate(inline + top):
        recipe = copy.deepcopy(BASE)
        if i < len(inline):
            recipe["model"]["config"].update(change)
        else:
            recipe.update(change)
        path = tmp_path / f"case-{i}.yaml"
        path.write_text(yaml.safe_dump(recipe))
        assert_refused(path, message)


def test_zz_tally():
    """Printed with -s: how many recipes the properties above tried, and how each ended."""
    print(f"\nrecipe fuzz: {TALLY}; tracebacks 0, hangs 0 (any would have failed a test above)")


TINY_V4 = TINY_RECIPE.with_name("tiny-v4.yaml").read_text()
BIG = "1" + "0" * 400


@pytest.mark.parametrize("text, message", [
    # YAML 1.1's surprises and non-data
    (TINY_RECIPE.read_text().replace("max_len: 256", "max_len: 4:16"), "kv.max_len: must be int, not str ('4:16')"),
    (TINY_RECIPE.read_text().replace("max_len: 256", "max_len: 0400"), "0400 has a leading zero"),
    (TINY_RECIPE.read_text().replace("max_len: 256", "max_len: 256, max_len: 128"), "key 'max_len' is given twice"),
    (TINY_RECIPE.read_text().replace("config:", "config:\n    num_key_value_heads: 2024-01-01", 1),
     "num_key_value_heads='2024-01-01' must be a positive integer"),
    ("name: &a [*a]\n", "anchors and aliases"),
    (TINY_RECIPE.read_text().replace("output: artifacts/tiny", "output: !!set {a, b}"), "tag:yaml.org,2002:set is not plain data"),
    (TINY_RECIPE.read_text().replace("output: artifacts/tiny", "output: !!binary aGVsbG8="), "binary is not plain data"),
    (TINY_RECIPE.read_text().replace("output: artifacts/tiny", 'output: "a\\0b"'), "holds a NUL"),
    (TINY_RECIPE.read_text().replace("output: artifacts/tiny", 'output: "a\\ud800b"'), "lone surrogate"),
    (TINY_RECIPE.read_text().replace("  seed: 0", f"  seed: 0\n  expert_capacity: {BIG}"), "does not fit in 64 bits"),
    (TINY_RECIPE.read_text().replace("  seed: 0", f"  seed: {'9' * 5000}"), "does not fit in 64 bits"),  # (past Python's int limit)
    (TINY_RECIPE.read_text().replace("  seed: 0", f"  seed: 0x{'f' * 5000}"), "does not fit in 64 bits"),
    (TINY_RECIPE.read_text().replace("options: {}", "options: {1: 2}").replace("inductor", "export"), "key '1' is not a string"),
    (TINY_RECIPE.read_text().replace("config:", "config:\n    eos_token_id: [5, x, null]", 1),
     "eos_token_id=[5, 'x', None] must be a token id or a non-empty list"),
    # DeepSeek-V4's nested and legacy fields
    (TINY_V4.replace("layer_types:", "compress_ratios: 0\n    layer_types:", 1), "compress_ratios=0 must list a legacy ratio"),
    (TINY_V4.replace("layer_types:", "compress_ratios: [[4]]\n    layer_types:", 1), "compress_ratios=[[4]] must list"),
    (TINY_V4.replace("layer_types:", "num_hash_layers: 2.5\n    layer_types:", 1), "num_hash_layers=2.5 must be an integer"),
    (TINY_V4.replace("layer_types:", "num_hash_layers: x\n    layer_types:", 1), "num_hash_layers='x' must be an integer"),
    (TINY_V4.replace("rope_parameters: {", "rope_parameters: {compress: [1, 2], ", 1), "rope_parameters.compress must be a mapping"),
    (TINY_V4.replace("compress_rates: {", "compress_rates: {bogus: 1, ", 1), "compress_rates must be a mapping"),
    (TINY_V4.replace("[sliding_attention, ", "[sliding_attention, sliding_attention, ", 1), "no more and no fewer"),
])
def test_the_second_probes_recipes(tmp_path, text, message):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    assert_refused(path, message)
