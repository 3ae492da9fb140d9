"""DeepSeek-V3 checkpoints in the release's fp8 format (128x128 block scales; dimensions that are
not multiples of 128, so scale grids end in partial blocks): the greedy tokens of transformers on
the same weights as the fp8 bytes decode, with the weights kept fp8 in the bundle and with them
dequantized at compile time, through export, AOTInductor and StableHLO, at world sizes 1 and 2;
requantized to int8 for CPUs; and clear errors."""

import json
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from deepinfer.compiler.build import compile_recipe
from deepinfer.compiler.recipe import RecipeError, load_recipe
from deepinfer.models import CheckpointError, ConfigError, build_model
from tests.conftest import TINY_RECIPE, write_recipe
from tests.models.fp8_release import reference_tokens, write_fp8_release

transformers = pytest.importorskip("transformers")

# The tiny model widened past one block: kv_a_proj_with_mqa [104, 192] has scales [1, 2], the
# experts' down_proj [192, 160] scales [2, 2]; o_proj's 256 input columns split into whole blocks.
WIDER = {"hidden_size": 192, "intermediate_size": 256, "moe_intermediate_size": 160, "q_lora_rank": 144,
         "kv_lora_rank": 96, "qk_nope_head_dim": 32, "v_head_dim": 64}
PROMPTS = [[5, 17, 42, 99, 7, 3, 9, 11], [77, 78], list(range(10, 30))]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The release checkpoint, transformers on the weights its bytes decode to, and its tokens."""
    from tests.models.test_hf_parity import decisive_init

    config = dict(yaml.safe_load(TINY_RECIPE.read_text())["model"]["config"], num_key_value_heads=4, **WIDER)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**config)).eval()
    decisive_init(hf, seed=3)
    release, dequantized = tmp_path_factory.mktemp("fp8-release"), tmp_path_factory.mktemp("fp8-dequantized")
    write_fp8_release(hf, release, dequantized)
    return release, *reference_tokens(transformers.DeepseekV3ForCausalLM, dequantized, PROMPTS, MAX_TOKENS)


def test_weights_stay_fp8_and_match_transformers_in_eager(checkpoints):
    release, hf, _ = checkpoints
    kept = build_model(checkpoint=release)
    dequantized = build_model(checkpoint=release, quantized_weights="dequantize")
    attention = kept.layers[1].self_attn
    assert attention.kv_a_proj_with_mqa.weight.dtype == torch.float8_e4m3fn
    assert attention.kv_a_proj_with_mqa.weight_scale_inv.shape == (104, 2)  # row-expanded [ceil(104/128) = 1, 2]
    assert kept.layers[1].mlp.experts_down.dtype == torch.float8_e4m3fn and kept.layers[1].mlp.gate.weight.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in dequantized.parameters())
    assert_prefill_logits_match(hf, kept, dequantized)


def assert_prefill_logits_match(hf, *models):
    """The last-position logits of a prompt's prefill: each of our models against transformers'."""
    ids = torch.tensor(PROMPTS[0])
    T = len(ids)
    step = (ids, torch.arange(T), torch.zeros(T, dtype=torch.long), torch.tensor([0]), torch.tensor([T - 1]))
    with torch.no_grad():
        reference = hf(ids[None]).logits[0, -1]
        for model in models:
            torch.testing.assert_close(model.prefill(*step, model.new_state(1, 64))[0], reference, atol=1e-4, rtol=1e-4)


def compile_fp8(release, tmp_path, cache_dir, backend, mode, world_size, arch="deepseek_v3", weights=True):
    """Through AOTInductor as one whole graph per program: 2 compiles, the same fp8 ops as per layer.
    `weights=False`: --no-weights (the weights step adds them)."""
    buckets = {"decode": {"buckets": [4]}, "prefill": {"buckets": [32]}}
    regions = {"split_layers": backend != "inductor", "boundaries": []}
    static = backend in ("pjrt", "neuron")  # (no torch.cond; neuron: its StableHLO on XLA's CPU client)
    recipe = write_recipe(tmp_path, f"fp8-{backend}-{mode}-ws{world_size}", methods=buckets, regions=regions,
                          backend={"name": backend, "options": {"platform": "cpu"} if backend == "neuron" else {}},
                          model={"arch": arch, "checkpoint": str(release), "config": None, "quantized_weights": mode,
                                 "expert_overflow": "always" if static else "branch"},
                          parallel={"world_size": world_size, "tp": 1, "ep": world_size}, kv={"max_seqs": 4, "max_len": 64})
    return compile_recipe(load_recipe(recipe), cache_dir=cache_dir, progress=False, weights=weights)


def run_tokens(bundle, prompts=PROMPTS) -> list[list[int]]:
    args = [a for p in prompts for a in ("--prompt-ids", ",".join(map(str, p)))]
    run = subprocess.run([sys.executable, "-m", "deepinfer.runtime.cli", "--bundle", str(bundle), *args,
                          "--max-tokens", str(MAX_TOKENS), "--json"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return [r["token_ids"] for r in json.loads(run.stdout)["results"]]


def test_an_fp8_release_requantized_to_int8_generates_the_eager_int8_models_tokens(checkpoints, tmp_path, cache_dir):
    """model.quantize on an fp8 checkpoint: its weights dequantized as read, then quantized to int8."""
    from tests.models.test_int_weights import quantization_eval

    release, _, expected_tokens = checkpoints
    recipe = write_recipe(tmp_path, "fp8-to-int8", methods={"decode": {"buckets": [4]}, "prefill": {"buckets": [32]}},
                          model={"checkpoint": str(release), "config": None, "quantize": "int8"}, backend={"name": "export"},
                          kv={"max_seqs": 4, "max_len": 64})
    bundle = compile_recipe(load_recipe(recipe), cache_dir=cache_dir, progress=False).bundle
    assert load_file(bundle / "weights" / "rank-0.safetensors")["layers.1.mlp.experts_down"].dtype == torch.int8
    model = build_model(checkpoint=release, quantize="int8")
    tokens = run_tokens(bundle)
    assert tokens == [quantization_eval.greedy(model, torch.tensor(p), MAX_TOKENS) for p in PROMPTS]
    # int8 keeps the first token transformers gives each prompt (later ones drift on this random model)
    assert [t[0] for t in tokens] == [t[0] for t in expected_tokens], (tokens, expected_tokens)


@pytest.mark.parametrize("backend, mode, world_size", [
    ("export", "keep", 1), ("export", "dequantize", 1), ("export", "keep", 2),
    ("inductor", "keep", 1),  # (inductor at ws2 passes too; left out of CI for its compile minutes)
    # The neuron backend's path off Trainium: trn2's fp8 encoding, lowered to StableHLO (f8E4M3FN
    # inputs) and compiled by XLA's CPU client in place of neuronx-cc.
    ("neuron", "keep", 2),
])
def test_compiled_tokens_equal_transformers(checkpoints, tmp_path, cache_dir, backend, mode, world_size):
    release, _, expected_tokens = checkpoints
    summary = compile_fp8(release, tmp_path, cache_dir, backend, mode, world_size)
    bundle = summary.bundle
    # the compile says that kept fp8 is decoded in every step on a CPU (inductor)
    assert ("kept quantized are decoded in every step" in str(summary)) == (backend == "inductor" and mode == "keep")
    stored = load_file(bundle / "weights" / "rank-0.safetensors")
    fp8 = {name for name, t in stored.items() if t.dtype == torch.float8_e4m3fn}
    assert ("layers.1.mlp.experts_down" in fp8 and "layers.1.mlp.experts_down_scale_inv" in stored) == (mode == "keep")
    assert "layers.1.mlp.gate.weight" not in fp8
    if mode == "keep":  # block maxima are 448; trn2's encoding (neuron) halves every value, doubling its scale
        assert stored["layers.1.mlp.experts_down"].float().abs().max() == (224 if backend == "neuron" else 448)
    assert run_tokens(bundle) == expected_tokens


def damage(release, tmp_path, edit):
    """A copy of the release checkpoint with `edit(tensors)` applied."""
    copy = tmp_path / "damaged"
    copy.mkdir()
    (copy / "config.json").write_text((release / "config.json").read_text())
    tensors = load_file(release / "model.safetensors")
    edit(tensors)
    save_file(tensors, copy / "model.safetensors")
    return copy


KEY = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop(KEY + "_scale_inv"), rf"'{KEY}' is fp8 but its scales '{KEY}_scale_inv' are missing"),
    (lambda t: t.update({KEY + "_scale_inv": torch.ones(2, 2)}), rf"'{KEY}_scale_inv' is \[2, 2\] F32, but the fp8 weight "
                                                                 r"\[104, 192\] in 128x128 blocks needs F32 or F8_E8M0 scales \[1, 2\]"),
    (lambda t: t.update({KEY: t[KEY].float()}), rf"'{KEY}' is F32, but quantization_config says it is stored fp8"),
])
def test_a_bad_scale_or_weight_names_the_tensor(checkpoints, tmp_path, edit, message):
    release, _, _ = checkpoints
    damaged = damage(release, tmp_path, edit)
    from deepinfer.models import check_checkpoint

    with pytest.raises(CheckpointError, match=message):
        check_checkpoint(damaged, build_model(checkpoint=damaged, device="meta"))
    with pytest.raises(CheckpointError, match=message):
        build_model(checkpoint=damaged)


@pytest.mark.parametrize("key, value", [("fmt", "e5m2"), ("weight_block_size", [64, 64]), ("quant_method", "awq"),
                                        ("scale_fmt", "e4m3"), ("expert_dtype", "int4")])
def test_other_quantization_formats_are_refused_naming_the_key(checkpoints, tmp_path, key, value):
    release, _, _ = checkpoints
    copy = damage(release, tmp_path, lambda t: None)
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"][key] = value
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=rf"quantization_config\.{key}={value!r} is not supported".replace("[", r"\[")):
        build_model(checkpoint=copy, device="meta")


def test_a_tp_split_that_cuts_scale_blocks_is_refused_with_the_numbers(checkpoints, tmp_path):
    """o_proj's 256 input columns split over tp=4 give 64 a rank: half a 128-column block."""
    release, _, _ = checkpoints
    recipe = write_recipe(tmp_path, "fp8-tp4", model={"checkpoint": str(release), "config": None},
                          parallel={"world_size": 4, "tp": 4, "ep": 4})
    from deepinfer.compiler.plan import plan

    with pytest.raises(RecipeError, match=r"tp=4 splits .*=256 input columns into 64 a rank.*128-column fp8 scale block"):
        plan(load_recipe(recipe))
