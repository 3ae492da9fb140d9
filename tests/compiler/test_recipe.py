"""Recipe validation: each problem names the key and its line, and the CLI exits 2."""

import subprocess
import sys

import pytest

from deepinfer.compiler.recipe import RecipeError, load_recipe
from tests.conftest import TINY_RECIPE, write_recipe


def test_tiny_recipe_loads():
    recipe = load_recipe(TINY_RECIPE)
    assert recipe.buckets == {"prefill": [16, 64], "decode": [1, 4]} and recipe.backend == "inductor"
    assert recipe.contexts == {}


def test_context_buckets_are_sorted_and_end_at_max_len(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path, methods={"decode": {"buckets": [1], "context": [128, 32]},
                                                         "prefill": {"buckets": [16], "context": [256, 64]}}))
    assert recipe.contexts == {"decode": [32, 128, 256], "prefill": [64, 256]}


BASE = """name: x
model: {config: {}}
methods:
  decode: {buckets: [1]}
  prefill: {buckets: [8]}
kv: {max_seqs: 2, max_len: 16}
backend: {name: export}
"""


@pytest.mark.parametrize(
    "old, new, message",
    [
        ("backend:", "modle: {}\nbackend:", r":7: modle: unknown key"),
        ("{config: {}}", "{config: {}, prompt_logprobs: true}",
         r"model.prompt_logprobs: unknown key here; .* `prompt_logprobs` belongs at the top level \(prompt_logprobs: \.\.\.\)"),
        ("max_seqs: 2", "max_seqs: 2, buckets: [1]", r"kv.buckets: unknown key here; .* belongs at methods.decode.buckets or"),
        ("max_seqs: 2", "max_seqs: four", r":6: kv.max_seqs: must be int, not str"),
        ("{config: {}}", "\n  config: {}\n  seed: true", r":4: model.seed: must be int, not bool"),
        ("buckets: [1]", "buckets: []", r":4: methods.decode.buckets: is empty"),
        ("{config: {}}", "{checkpoint: /nonexistent/ckpt}", r":2: model.checkpoint: /nonexistent/ckpt is not a readable HF checkpoint"),
        ("kv: {max_seqs: 2, max_len: 16}", "", r"kv.max_seqs: is required"),
    ],
)
def test_bad_recipes_name_key_and_line(tmp_path, old, new, message):
    path = tmp_path / "bad.yaml"
    assert old in BASE
    path.write_text(BASE.replace(old, new))
    with pytest.raises(RecipeError, match=message) as err:
        load_recipe(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"methods": {"decode": {"buckets": [1, 8]}}}, r"methods.decode.buckets: bucket 8 has more rows than kv.max_seqs=4"),
        ({"methods": {"prefill": {"buckets": [512]}}}, r"methods.prefill.buckets: bucket 512 is longer than kv.max_len=256"),
        ({"backend": {"name": "neuron"}}, r"backend.name: backend 'neuron' is not available here: libneuronxla \(Neuron's PJRT plugin"),
        ({"backend": {"name": "tensorrt"}}, r"backend.name: unknown backend 'tensorrt'"),
        ({"dtype": "float16"}, r"dtype: 'float16' is not supported"),
        ({"regions": {"boundaries": [{"module": "layers.*"}]}}, r"regions.boundaries\[0\]: a boundary is"),
        ({"methods": {"decode": {"buckets": [1], "context": [64, 512]}}}, r"methods.decode.context: context bucket 512 is longer than kv.max_len=256"),
        ({"methods": {"decode": {"buckets": [1], "context": [64, 64]}}}, r"methods.decode.context: \[64, 64\] lists a bucket twice"),
        ({"methods": {"prefill": {"buckets": [16], "context": []}}}, r"methods.prefill.context: is empty"),
        ({"methods": {"prefill": {"buckets": [16], "context": 64}}}, r"methods.prefill.context: must be list, not int"),
        ({"parallel": {"device_memory_gib": 0}}, r"parallel.device_memory_gib: 0.0 must be in \(0, 1048576\]: the memory of one"),
        ({"parallel": {"world_size": 2, "tp": 2, "ep": 2, "cp": 2}}, r"parallel.cp: 2 must divide world_size / tp = 1"),
        ({"parallel": {"world_size": 4, "ep": 2, "cp": 3}}, r"parallel.cp: 3 must divide world_size / tp = 4"),
        ({"parallel": {"world_size": 2, "ep": 2, "cp": 2}, "methods": {"prefill": {"buckets": [15]}}},
         r"methods.prefill.buckets: bucket 15 is not a multiple of parallel.cp=2"),
        ({"parallel": {"world_size": 2, "ep": 2, "cp": 2}, "kv": {"max_seqs": 4, "max_len": 255}},
         r"kv.max_len: 255 is not a multiple of parallel.cp=2"),
        ({"parallel": {"world_size": 2, "ep": 2, "cp": 2}, "methods": {"decode": {"buckets": [1], "context": [63]}}},
         r"methods.decode.context: context bucket 63 is not a multiple of parallel.cp=2"),
    ],
)
def test_invalid_values(tmp_path, changes, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(write_recipe(tmp_path, **changes))


def test_missing_recipe_file_and_cli_exit_code(tmp_path):
    with pytest.raises(RecipeError, match="cannot read the recipe"):
        load_recipe(tmp_path / "nope.yaml")
    path = write_recipe(tmp_path, backend={"name": "neuron"})
    run = subprocess.run([sys.executable, "-m", "deepinfer.compiler.cli", str(path)], capture_output=True, text=True)
    assert run.returncode == 2
    assert "backend.name" in run.stderr and "neuron" in run.stderr and "Traceback" not in run.stderr


V4 = TINY_RECIPE.parent / "tiny-v4.yaml"


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"kv": {"max_seqs": 4, "max_len": 200}}, r"kv.max_len: 200 must be a multiple of every compress rate the layers use "
                                                  r"\(\[4, 16\]\).*multiple of 16, e.g. 192"),
        ({"model": {"layer_types": ["sliding_attention"] * 3 + ["lightning"]}}, r"model.config: .*layer_types must list one of"),
        ({"model": {"scoring_func": "softmax"}}, r"model.config: scoring_func='softmax' is not supported"),
        ({"model": {"o_groups": 3}}, r"o_groups=3 must divide num_attention_heads=4"),
        ({"model": {"compress_rate": 4}}, r"unknown field\(s\) \['compress_rate'\]"),
        ({"methods": {"decode": {"buckets": [1], "context": [32, 40]}, "prefill": {"buckets": [16]}}},
         r"methods.decode.context: context bucket 40 must be a multiple of every compress rate"),
        ({"parallel": {"world_size": 2, "ep": 2, "cp": 2}, "kv": {"max_seqs": 4, "max_len": 240}},
         r"kv.max_len: 240 must be a multiple of every compress rate the layers use \(\[4, 16\]\) times parallel.cp=2.*"
         r"multiple of 32, e.g. 224"),
        ({"parallel": {"world_size": 2, "ep": 2, "cp": 2},
          "methods": {"decode": {"buckets": [1], "context": [48, 64]}, "prefill": {"buckets": [16]}}},
         r"methods.decode.context: context bucket 48 must be a multiple .* times parallel.cp=2"),
    ],
)
def test_deepseek_v4_constraints_name_the_key(tmp_path, changes, message):
    import yaml

    recipe = yaml.safe_load(V4.read_text())
    recipe["model"]["config"].update(changes.pop("model", {}))
    recipe.update(changes)
    path = tmp_path / "v4.yaml"
    path.write_text(yaml.safe_dump(recipe))
    with pytest.raises(RecipeError, match=message):
        load_recipe(path)
