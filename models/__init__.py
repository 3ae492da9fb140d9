"""Model architectures in plain PyTorch, and how to build them from an HF checkpoint or a seed.

    from deepinfer.models import build_model
    model = build_model(config=TINY_CONFIG, seed=0)                # built-in random weights
    model = build_model(checkpoint="path/to/hf_dir", dtype="bfloat16")
    model = build_model(config=big_config, device="fake")          # shapes only, for tracing
"""

from contextlib import nullcontext
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from .checkpoint import CheckpointError, SafetensorsDir, init_buffers, read_config, set_parameter
from .deepseek_v3 import DeepseekV3, init_random
from .deepseek_v3_config import TINY_CONFIG, ConfigError, DeepseekV3Config
from .parallel import Layout, LayoutError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ARCHS = ("deepseek_v3",)


def param_dtype_of(name: str, dtype: str) -> torch.dtype:
    return torch.float32 if name.endswith(DeepseekV3.FLOAT32_PARAMS) else DTYPES[dtype]


def model_config(arch: str, checkpoint: str | Path | None = None, config: dict | None = None) -> DeepseekV3Config:
    """The validated config of a checkpoint's config.json, or of an inline config (where keys
    the model does not read are refused)."""
    if arch not in ARCHS:
        raise ConfigError(f"model.arch={arch!r} is not supported; choose one of {list(ARCHS)}.")
    if (checkpoint is None) == (config is None):
        raise ConfigError("give exactly one of model.checkpoint (an HF directory) or model.config (a dict).")
    if checkpoint is not None:
        return DeepseekV3Config.from_dict(read_config(Path(checkpoint)), str(Path(checkpoint) / "config.json"))
    return DeepseekV3Config.from_dict(config, "model.config", strict=True)


def build_model(
    arch: str = "deepseek_v3",
    checkpoint: str | Path | None = None,
    config: dict | None = None,
    seed: int = 0,
    dtype: str = "float32",
    device: str = "cpu",
    layout: Layout = Layout(),
) -> DeepseekV3:
    """Exactly one of `checkpoint` (an HF directory) or `config` (HF field names, random weights).

    device="meta" or "fake" builds shapes only: nothing is allocated and no weights are read.
    "fake" gives FakeTensors on the CPU (from one FakeTensorMode, `model.embed.weight.fake_mode`),
    which torch.export traces like real weights. A `layout` other than one rank gives rank 0's
    shard shapes and collectives; it is for tracing (meta or fake) only — per-rank weights are
    cut from the full model by models.parallel.shard."""
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not supported; choose one of {list(DTYPES)}.")
    cfg = model_config(arch, checkpoint, config)
    if layout.world_size > 1 and device == "cpu":
        raise ValueError("build_model: a multi-rank layout is for tracing (device='meta' or 'fake') only.")
    with torch.device("meta"):
        model = DeepseekV3(cfg, layout)
    if device == "meta":
        return model
    weights = SafetensorsDir(Path(checkpoint)) if checkpoint is not None and device == "cpu" else None
    with FakeTensorMode() if device == "fake" else nullcontext():
        for name, param in list(model.named_parameters()):
            param_dtype = param_dtype_of(name, dtype)
            if weights is None:
                tensor = torch.empty(param.shape, dtype=param_dtype)
            else:
                tensor = read_weight(weights, name, cfg, tuple(param.shape)).to(param_dtype)
            set_parameter(model, name, tensor)
        model.tie_weights()
        init_buffers(model)
    if device == "cpu" and weights is None:
        init_random(model, seed)
    return model.eval().requires_grad_(False)


def checkpoint_keys(name: str, cfg: DeepseekV3Config, shape: tuple) -> list[tuple[str, tuple]]:
    """The checkpoint tensors (key, shape) our parameter `name` of full `shape` is made of, in HF's
    per-expert layout: a stacked expert weight [E, out, in] is E (or 2E) tensors."""
    layer, _, rest = name.partition(".mlp.experts_")
    if rest:  # stacked routed experts [E, out, in] from model.layers.N.mlp.experts.E.*_proj.weight
        parts = ("gate_proj", "up_proj") if rest == "gate_up" else ("down_proj",)
        per_expert = (shape[1] // len(parts), shape[2])
        return [(f"model.{layer}.mlp.experts.{e}.{p}.weight", per_expert) for e in range(shape[0]) for p in parts]
    if name == "head.lm_head.weight" and cfg.tie_word_embeddings:
        name = "embed.weight"
    key = {"embed.weight": "model.embed_tokens.weight", "head.norm.weight": "model.norm.weight",
           "head.lm_head.weight": "lm_head.weight"}.get(name, f"model.{name}")
    return [(key, tuple(shape))]


def check_checkpoint(checkpoint: str | Path, model: DeepseekV3):
    """Every tensor the model (meta, full shapes) reads is in the checkpoint with the right shape:
    checked from the file headers before anything is traced or compiled."""
    weights = SafetensorsDir(Path(checkpoint))
    for name, param in model.named_parameters():
        for key, shape in checkpoint_keys(name, model.config, tuple(param.shape)):
            _check_shape(weights, key, shape)


def read_weight(weights: SafetensorsDir, name: str, cfg: DeepseekV3Config, shape: tuple,
                part: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Our parameter `name` (full `shape`), read from HF's per-expert checkpoint layout and
    shape-checked; with part=(dim, start, length) only that slice is read."""
    keys = checkpoint_keys(name, cfg, shape)
    if ".mlp.experts_" in name:
        n_parts = len(keys) // shape[0]
        first, count = (part[1], part[2]) if part else (0, shape[0])
        chosen = keys[first * n_parts : (first + count) * n_parts]
        return torch.stack([torch.cat([_read(weights, *k) for k in chosen[e : e + n_parts]])
                            for e in range(0, len(chosen), n_parts)])
    ((key, _),) = keys
    if part is None:
        return _read(weights, key, shape)
    _check_shape(weights, key, shape)
    return weights.get_slice(key, *part)


def _read(weights: SafetensorsDir, key: str, shape: tuple) -> torch.Tensor:
    _check_shape(weights, key, shape)
    return weights.get(key)


def _check_shape(weights: SafetensorsDir, key: str, shape: tuple):
    found = tuple(weights.get_shape(key))
    if found != tuple(shape):
        raise CheckpointError(
            f"{weights.file_of(key)}: weight {key!r} has shape {list(found)}, but config.json implies {list(shape)}. "
            "The config and the weights come from different models."
        )


__all__ = ["build_model", "check_checkpoint", "model_config", "CheckpointError", "ConfigError", "DeepseekV3", "DeepseekV3Config", "Layout", "LayoutError",
           "TINY_CONFIG", "DTYPES"]
