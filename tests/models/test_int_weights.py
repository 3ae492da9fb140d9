"""model.quantize: int8 and int4 weights (models/int_weights.py): what they cost the trained tiny
DeepSeek-V3 in held-out loss and greedy tokens; bundles that generate what the eager quantized
model does, with MTP speculation and context buckets, at world size 2 as at 1; prefix caching as
exact as with float weights; the compile and plan saying what is stored and read; and the refusals."""

import importlib.util
import json
import shutil

import pytest
import torch
import yaml
from safetensors import safe_open

from deepinfer.compiler.build import compile_recipe
from deepinfer.compiler.recipe import RecipeError, load_recipe
from deepinfer.models import build_model, int_weights
from deepinfer.runtime import int_matmul
from deepinfer.runtime.errors import BundleError
from deepinfer.runtime.executor import BundleExecutor
from tests.conftest import ROOT, TINY_RECIPE, write_recipe
from tests.models.test_fp8_checkpoint import run_tokens

CHECKPOINT = ROOT / "checkpoints" / "tiny-v3-code"
spec = importlib.util.spec_from_file_location("quantization_eval", ROOT / "tools" / "quantization_eval.py")
quantization_eval = importlib.util.module_from_spec(spec)
spec.loader.exec_module(quantization_eval)


@pytest.fixture(scope="module")
def heldout():
    return quantization_eval.heldout_stream(CHECKPOINT)


def test_int8_and_int4_keep_the_trained_models_loss_and_int8_its_greedy_tokens(heldout):
    """The issue's bars: int8 within 0.01 nats of float32's held-out loss, int4 within 0.05; int8
    continues most code prompts exactly as float32 does."""
    prompts = quantization_eval.prompts(heldout, 16, 48)
    results = {}
    for name, options in {"float32": {}, "int8": {"quantize": "int8"}, "int4": {"quantize": "int4"}}.items():
        model = build_model(checkpoint=CHECKPOINT, **options)
        results[name] = (quantization_eval.heldout_loss(model, heldout, spans=8, length=256),
                         [quantization_eval.greedy(model, p, 12) for p in prompts])
    (f32_loss, f32_tokens), (int8_loss, int8_tokens), (int4_loss, int4_tokens) = results.values()
    assert abs(int8_loss - f32_loss) < 0.01 and abs(int4_loss - f32_loss) < 0.05, results
    assert sum(a == b for a, b in zip(int8_tokens, f32_tokens)) >= 12, (int8_tokens, f32_tokens)
    assert int4_tokens != f32_tokens  # (4 bits change something: the comparison is not vacuous)


def test_quantized_weights_are_codes_and_the_head_is_optional():
    model = build_model(checkpoint=CHECKPOINT, quantize="int4", quantize_group=64, quantize_head=False)
    layer = model.layers[1]
    assert layer.self_attn.o_proj.weight.dtype == torch.uint8 and layer.self_attn.o_proj.bits == 4  # 128 inputs
    assert layer.self_attn.q_b_proj.weight.dtype == torch.int8  # 96 inputs, not groups of 64: int8 instead
    assert layer.mlp.experts_down.dtype == torch.uint8 and layer.mlp.experts_down_qscale.shape == (8, 192, 2, 2)
    assert layer.mlp.experts_gate_up.shape == (8, 256, 96) and layer.mlp.experts_gate_up_qscale.shape == (8, 256, 3, 2)
    # kv_b_proj per head, as the kernels take it: w_uk [H, R, n] (32 inputs: int8), w_uv [H, v, R] (int4)
    assert layer.self_attn.w_uk.dtype == torch.int8 and layer.self_attn.w_uv.dtype == torch.uint8
    assert layer.self_attn.w_uk.shape == (4, 64, 32) and layer.self_attn.w_uv_qscale.shape == (4, 32, 1, 2)
    assert not hasattr(layer.self_attn, "kv_b_proj")
    assert model.embed.weight.dtype == torch.float32 and model.head.lm_head.weight.dtype == torch.float32


def test_the_up_projections_are_kv_b_projs_heads_as_the_kernels_take_them():
    """An int model's w_uk holds each head's key block of the checkpoint's kv_b_proj transposed
    ([R, n]: the kernels reduce over a row's inputs) and w_uv its value block [v, R], each within
    int8's rounding of the float weight."""
    w_uk, w_uv = build_model(checkpoint=CHECKPOINT).layers[1].self_attn.absorbed(torch.float32)  # [H, n, R], [H, v, R]
    attention = build_model(checkpoint=CHECKPOINT, quantize="int8").layers[1].self_attn
    for codes, scales, weight in ((attention.w_uk, attention.w_uk_qscale, w_uk.transpose(1, 2)), (attention.w_uv, attention.w_uv_qscale, w_uv)):
        assert codes.shape == weight.shape
        assert ((int_matmul.values(codes, scales, torch.float32) - weight).abs() <= scales.float()[..., None] * 0.51).all()


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_a_long_chunk_expands_the_int_heads_keys_and_values_as_the_absorbed_form_attends(quantize):
    """A 96-token chunk (past the tiny V3's 64) attends with each head's keys and values expanded by
    the int heads' weights decoded; chunks of 16 attend in the latent space, the kernels' 8-bit
    activations rounding q and the latents: the same tokens, logits within that rounding."""
    from tests.models.conftest import greedy

    model = build_model(checkpoint=CHECKPOINT, quantize=quantize)
    assert model.layers[0].self_attn.expands(96, 1) and not model.layers[0].self_attn.expands(16, 1)
    prompt = list(range(5, 101))
    (expanded, expanded_logits), (absorbed, absorbed_logits) = (greedy(model, prompt, 6, chunk=chunk) for chunk in (96, 16))
    assert expanded == absorbed
    assert (expanded_logits - absorbed_logits).abs().max() < 0.02 * absorbed_logits.abs().max()


def test_every_int8_linear_is_the_kernels_whatever_its_size():
    """A small int8 linear's codes are in the kernel's layout as a big one's, and its decode row and
    prompt rows go to the kernel: x times the weight the codes hold, within the 8-bit activations' rounding."""
    from tests.models.test_moe import OpCalls

    spec = int_weights.IntWeights(8)
    for dim_in, dim_out in ((192, 96), (512, 512)):
        w = torch.randn(dim_out, dim_in)
        linear = int_weights.IntLinear(dim_in, dim_out, spec)
        linear.weight.data, linear.weight_qscale.data = int_weights.int_tensors(w, 8, 32)
        codes, scales = int_weights.int8_codes(w)
        assert torch.equal(linear.weight, int_matmul.pack_int8(codes))
        weight = codes.float() * scales.float()[:, None]
        for rows in (1, 5):
            x = torch.randn(rows, dim_in)
            with OpCalls() as calls:
                out = linear(x)
            assert "deepinfer::int8_matmul" in calls.names, calls.names
            assert (out - x @ weight.T).abs().max() < 0.02 * (x @ weight.T).abs().max()


# Prompts of 5 tokens and more: the eager model computes them in the dense and exact forms, int8
# experts decoded to bf16 for a GEMM, as the bundle's 32-row chunks do (2 tokens would be gathered).
PROMPTS = [[5, 17, 42, 99, 7, 3, 9, 11], [77, 78, 79, 80, 81], list(range(10, 70))]


@pytest.fixture(scope="module")
def code_bundles(tmp_path_factory, cache_dir):
    """The trained tiny V3 with int8 and with int4 weights through the export backend, its MTP
    module drafting 3 tokens a step, decode in a context bucket and the whole pool: name -> summary."""
    directory = tmp_path_factory.mktemp("int-weights")
    summaries = {}
    for quantize in ("int8", "int4"):
        recipe = write_recipe(directory, f"code-{quantize}", model={"checkpoint": str(CHECKPOINT), "config": None, "quantize": quantize},
                              methods={"decode": {"buckets": [1], "context": [128]}, "prefill": {"buckets": [32]}},
                              kv={"max_seqs": 4, "max_len": 256}, backend={"name": "export"},
                              speculative={"method": "mtp", "num_tokens": 3})
        summaries[quantize] = compile_recipe(load_recipe(recipe), cache_dir=cache_dir, progress=False)
    return summaries


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_a_bundle_generates_the_eager_quantized_models_tokens(code_bundles, quantize):
    """With speculative decoding (the drafter quantized too) and context buckets: greedy tokens
    equal the eager model's, one token a step."""
    summary = code_bundles[quantize]
    what = "int8 per output channel" if quantize == "int8" else "int4 in groups of 32"
    assert f"weights {what}, LM head quantized:" in str(summary) and "read per decode token" in str(summary)
    manifest = json.loads((summary.bundle / "manifest.json").read_text())
    assert manifest["model_config"]["quantization_config"]["weights"] == quantize
    with safe_open(summary.bundle / "weights" / "rank-0.safetensors", "pt") as f:
        assert f.get_tensor("layers.1.mlp.experts_down").dtype == (torch.int8 if quantize == "int8" else torch.uint8)
    model = build_model(checkpoint=CHECKPOINT, quantize=quantize)
    for prompt, got in zip(PROMPTS, run_tokens(summary.bundle, PROMPTS)):
        assert equal_but_at_a_near_tie(model, prompt, got, quantization_eval.greedy(model, torch.tensor(prompt), 8))


def equal_but_at_a_near_tie(model, prompt: list[int], got: list[int], expected: list[int], margin: float = 0.02) -> bool:
    """The same tokens, or tokens that part where the eager model's two best logits are within
    `margin` and the bundle took the other: a longer chunk computes int4 products of
    int_matmul.DECODED_FROM_ROWS rows and more as bf16 GEMMs, where a shorter prompt takes the
    kernel; two ranks sum their halves in another order (seen: a margin of 0.0007)."""
    if got == expected:
        return True
    at = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
    best = quantization_eval.all_logits(model, torch.tensor(prompt + expected[:at]))[-1].topk(2)
    return float(best.values[0] - best.values[1]) < margin and got[at] in best.indices.tolist()


@pytest.mark.parametrize("quantize, key, earlier", [("int4", "int4_layout", None), ("int8", "int8_layout", None),
                                                   ("int8", "int8_layout", "int8-rows-of-8")])
def test_integer_weights_in_another_layout_are_refused(code_bundles, tmp_path, quantize, key, earlier):
    """A bundle an earlier deepinfer wrote: its manifest names no layout (rows in order, for ATen's
    kernels), or int8's rows of 8 with the small linears' rows in order."""
    from tests.runtime.test_bundle_trust import edit_manifest

    bundle = shutil.copytree(code_bundles[quantize].bundle, tmp_path / "bundle")

    def as_written_earlier(body):
        quantization = body["model_config"]["quantization_config"]
        quantization.pop(key) if earlier is None else quantization.update({key: earlier})

    edit_manifest(bundle, as_written_earlier)
    found = earlier or "an earlier deepinfer's, for ATen's kernels"
    with pytest.raises(BundleError, match=rf"{quantize} weights are in the layout {found} "
                                          rf"\(manifest model_config.quantization_config.{key}\).* Compile the recipe again"):
        BundleExecutor(bundle)


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_world_size_2_generates_what_world_size_1_does(tmp_path, cache_dir, quantize):
    """tp 2 (o_proj and down_proj cut by columns: their int8 scales are the whole rows', their int4
    groups whole) and ep 2 (the kernels take the other rank's experts as none). v_head_dim 32 and
    moe_intermediate_size 64: o_proj's and the shared expert's down_proj's inputs are whole
    groups of 32 at tp 2 too (a rank slice a layout cannot take takes the next, which would change
    the tokens). The same tokens but at a near-tie."""
    config = {**yaml.safe_load(TINY_RECIPE.read_text())["model"]["config"], "v_head_dim": 32, "moe_intermediate_size": 64}
    bundles = {}
    for world in (1, 2):
        recipe = write_recipe(tmp_path, f"{quantize}-ws{world}", model={"quantize": quantize, "config": config}, backend={"name": "export"},
                              parallel={"world_size": world, "tp": world, "ep": world},
                              methods={"decode": {"buckets": [4]}, "prefill": {"buckets": [16]}})
        bundles[world] = compile_recipe(load_recipe(recipe), cache_dir=cache_dir, progress=False).bundle
    model = build_model(config=config, quantize=quantize)  # (whose logits say where a near-tie may part them)
    for prompt, got, expected in zip(PROMPTS, run_tokens(bundles[2], PROMPTS), run_tokens(bundles[1], PROMPTS)):
        assert equal_but_at_a_near_tie(model, prompt, got, expected)


@pytest.mark.parametrize("model, backend, message", [
    ({"quantize": "int3"}, "export", r"model.quantize: 'int3': choose int8 \(per output channel\) or int4"),
    ({"quantize": "int4", "quantize_group": 48}, "export", r"model.quantize_group: 48: int4 groups of 32 / 64 / 128 / 256"),
    ({"quantize": "int8"}, "pjrt", r"model.quantize: the pjrt backend cannot compile int8/int4 weights"),
])
def test_a_quantization_the_recipe_cannot_have_is_refused_naming_the_key(tmp_path, model, backend, message):
    recipe = write_recipe(tmp_path, "bad", model=model, backend={"name": backend, "options": {}})
    with pytest.raises(RecipeError, match=message):
        load_recipe(recipe)


def test_prefix_caching_with_int8_weights_gives_the_tokens_it_gives_without():
    from deepinfer.compiler.eager import eager_engine
    from tests.runtime.test_prefix_cache import conversation
    from tests.runtime.test_speculative import CONFIGS

    model = build_model(config=CONFIGS["deepseek_v3"], expert_overflow="always", quantize="int8")
    on = eager_engine(model)
    assert conversation(on) == conversation(eager_engine(model, prefix_caching=False)) and on.prefix_hits == 4


def test_deepseek_v4_with_int8_weights_generates_the_eager_models_tokens(tmp_path, cache_dir):
    """V4: its linears and routed experts int8, its hyper-head's projection kept (and said so)."""
    from deepinfer.compiler.eager import eager_engine
    from deepinfer.runtime.engine import Request
    from tests.conftest import tiny_v4_config

    config = tiny_v4_config()
    recipe = write_recipe(tmp_path, "v4-int8", model={"arch": "deepseek_v4", "config": config, "quantize": "int8"},
                          backend={"name": "export"}, methods={"decode": {"buckets": [1]}, "prefill": {"buckets": [16]}})
    summary = compile_recipe(load_recipe(recipe), cache_dir=cache_dir, progress=False)
    assert "weights int8 per output channel, LM head kept:" in str(summary)
    model = build_model("deepseek_v4", config=config, quantize="int8")
    assert model.layers[0].attn.wq_a.weight.dtype == torch.int8 and model.head.weight.dtype == torch.float32
    engine = eager_engine(model, prefill_buckets=(16,), decode_buckets=(1,))
    assert run_tokens(summary.bundle, PROMPTS) == [engine.generate([Request(p, 8)])[0].token_ids for p in PROMPTS]
