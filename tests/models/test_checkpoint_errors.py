"""Bad checkpoints get a clear error that names the file or key."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer.models import CheckpointError, ConfigError, build_model

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2,
             first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4, qk_nope_head_dim=8,
             v_head_dim=8, max_position_embeddings=64)


@pytest.fixture
def checkpoint(tmp_path):
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**SMALL))
    model.save_pretrained(tmp_path)
    return tmp_path


def edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_loads_in_bfloat16_with_router_in_float32(checkpoint):
    model = build_model(checkpoint=checkpoint, dtype="bfloat16")
    assert model.embed.weight.dtype == torch.bfloat16
    assert model.layers[1].mlp.experts_gate_up.dtype == torch.bfloat16
    assert model.layers[1].mlp.gate.weight.dtype == torch.float32


def test_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        build_model(checkpoint=tmp_path)


def test_missing_weight_files(checkpoint):
    for file in checkpoint.glob("*.safetensors"):
        file.unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        build_model(checkpoint=checkpoint)


def test_missing_weight_names_the_key(checkpoint):
    file = checkpoint / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, file)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        build_model(checkpoint=checkpoint)


def test_wrong_shape_names_file_and_key(checkpoint):
    edit_config(checkpoint, kv_lora_rank=12)
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*kv_a_proj_with_mqa\.weight.*shape"):
        build_model(checkpoint=checkpoint)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"model_type": "llama"}, "model_type is 'llama'"),
        ({"quantization_config": {"quant_method": "gptq"}}, r"quantization_config\.quant_method='gptq' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_type='longrope'"),
        ({"n_group": 3}, "not divisible by n_group=3"),
    ],
)
def test_unsupported_config_values_name_the_key(checkpoint, changes, message):
    edit_config(checkpoint, **changes)
    with pytest.raises(ConfigError, match=message) as err:
        build_model(checkpoint=checkpoint)
    assert "config.json" in str(err.value)


def test_real_deepseek_v3_legacy_rope_scaling_is_read():
    """DeepSeek-V3's own config.json writes `rope_scaling` with `type`, not `rope_parameters`."""
    from deepinfer.models import DeepseekV3Config

    config = DeepseekV3Config.from_dict({
        "model_type": "deepseek_v3", "rope_theta": 10000,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
    })
    assert config.rope.rope_type == "yarn" and config.rope.factor == 40
    assert config.softmax_scale == pytest.approx(192**-0.5 * (0.1 * __import__("math").log(40) + 1) ** 2)


def test_full_size_moe_layer_traces_on_meta_in_seconds():
    """A 256-expert, 7168-wide MoE layer exports on meta weights: static shapes, no data-dependent ops."""
    import time

    model = build_model(config={}, device="meta")  # every default is DeepSeek-V3 671B
    layer = model.layers[3]
    assert layer.kind == "moe" and layer.mlp.experts_gate_up.shape == (256, 4096, 7168)

    class Decode(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, *args):
            return self.layer(*args[:6], args[5], args[6])

    with torch.device("meta"):
        args = (torch.randn(4, 7168), torch.randn(4, 7168), torch.randn(4, 32), torch.randn(4, 32),
                torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long), torch.zeros(5, 4096, 576))
    start = time.perf_counter()
    torch.export.export(Decode(), args)
    assert time.perf_counter() - start < 60  # generous for a loaded CI machine; ~2 s here


@pytest.mark.parametrize("damage, message", [
    ("missing", r"model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight' is missing"),
    ("no files", r"no \*\.safetensors weight files"),
    ("quantized", r"quantization_config\.weight_block_size=\[64, 64\] is not supported"),
])
def test_a_bad_checkpoint_stops_the_compile_before_any_region_compiles(checkpoint, tmp_path, damage, message):
    import subprocess
    import sys

    from tests.conftest import write_recipe

    file = checkpoint / "model.safetensors"
    if damage == "missing":
        tensors = load_file(file)
        del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
        save_file(tensors, file)
    elif damage == "no files":
        file.unlink()
    else:
        edit_config(checkpoint, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                                     "weight_block_size": [64, 64]})
    recipe = write_recipe(tmp_path, "ckpt", model={"checkpoint": str(checkpoint), "config": None},
                          kv={"max_seqs": 4, "max_len": 64}, backend={"name": "export"},
                          methods={"decode": {"buckets": [1]}, "prefill": {"buckets": [16]}})
    run = subprocess.run([sys.executable, "-m", "deepinfer.compiler.cli", str(recipe), "--cache-dir", str(tmp_path / "cache")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert len(__import__("re").findall(message, run.stderr)) == 1, run.stderr
    assert "compiling" not in run.stderr and not (tmp_path / "cache" / "work").exists()  # nothing traced or compiled


def test_a_v4_fp8_weight_without_scales_or_format_is_refused_naming_the_key(tmp_path):
    """An fp8 tensor with no scales, or a quantization_config that is not the release's: refused
    before tracing, not misread."""
    from deepinfer.models import check_checkpoint
    from deepinfer.models.deepseek_v4_config import TINY_V4_CONFIG

    hf = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**TINY_V4_CONFIG))
    hf.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    key = "model.layers.1.attn.wq_a.weight"
    weights[key] = weights[key].to(torch.float8_e4m3fn)
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"weight '{key}' is fp8 but its scales '{key}_scale_inv' are missing"):
        check_checkpoint(tmp_path, build_model("deepseek_v4", checkpoint=tmp_path, device="meta"))
    edit_config(tmp_path, quantization_config={"quant_method": "fp8"})
    with pytest.raises(ConfigError, match=r"quantization_config\.fmt=None is not supported"):
        build_model("deepseek_v4", checkpoint=tmp_path, device="meta")
