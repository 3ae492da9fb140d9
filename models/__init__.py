"""Model architectures in plain PyTorch, and how to build them from an HF checkpoint or a seed.

    from deepinfer.models import build_model
    model = build_model(config=TINY_CONFIG, seed=0)                # built-in random weights
    model = build_model("deepseek_v4", config=TINY_V4_CONFIG)      # DeepSeek-V4
    model = build_model(checkpoint="path/to/hf_dir", dtype="bfloat16")
    model = build_model(config=big_config, device="fake")          # shapes only, for tracing

What the compiler and runtime see of a model is the same for every architecture: the driver
methods `prefill`/`decode`, sub-modules `embed`, `layers[i]` (with a `kind`) and `head`, and
`state_specs(max_seqs, max_len)`: per layer, the named state tensors it keeps.
"""

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from . import deepseek_v3, deepseek_v4
from .checkpoint import CheckpointError, SafetensorsDir, init_buffers, read_config, set_parameter
from .deepseek_v3 import DeepseekV3
from .deepseek_v3_config import TINY_CONFIG, ConfigError, DeepseekV3Config
from .deepseek_v4 import DeepseekV4
from .deepseek_v4_config import TINY_V4_CONFIG, DeepseekV4Config
from .parallel import Layout, LayoutError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Arch:
    config: type
    model: type
    init_random: Callable
    checkpoint_keys: Callable  # (name, config, shape, saved_by_transformers) -> [(key, shape)]
    tiny_config: dict


ARCHS = {
    "deepseek_v3": Arch(DeepseekV3Config, DeepseekV3, deepseek_v3.init_random, deepseek_v3.checkpoint_keys, TINY_CONFIG),
    "deepseek_v4": Arch(DeepseekV4Config, DeepseekV4, deepseek_v4.init_random, deepseek_v4.checkpoint_keys, TINY_V4_CONFIG),
}


def arch_of(arch: str) -> Arch:
    if arch not in ARCHS:
        raise ConfigError(f"model.arch={arch!r} is not supported; choose one of {list(ARCHS)}.")
    return ARCHS[arch]


def arch_name(model) -> str:
    return next(name for name, a in ARCHS.items() if isinstance(model, a.model))


def model_config(arch: str, checkpoint: str | Path | None = None, config: dict | None = None):
    """The validated config of a checkpoint's config.json, or of an inline config (where keys
    the model does not read are refused)."""
    config_class = arch_of(arch).config
    if (checkpoint is None) == (config is None):
        raise ConfigError("give exactly one of model.checkpoint (an HF directory) or model.config (a dict).")
    if checkpoint is not None:
        return config_class.from_dict(read_config(Path(checkpoint)), str(Path(checkpoint) / "config.json"))
    return config_class.from_dict(config, "model.config", strict=True)


def build_model(
    arch: str = "deepseek_v3",
    checkpoint: str | Path | None = None,
    config: dict | None = None,
    seed: int = 0,
    dtype: str = "float32",
    device: str = "cpu",
    layout: Layout = Layout(),
) -> DeepseekV3 | DeepseekV4:
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
        model = arch_of(arch).model(cfg, layout)
    if device == "meta":
        return model
    weights = SafetensorsDir(Path(checkpoint)) if checkpoint is not None and device == "cpu" else None
    with FakeTensorMode() if device == "fake" else nullcontext():
        for name, param in list(model.named_parameters()):
            param_dtype = model.param_dtype(name, DTYPES[dtype])
            if weights is None:
                tensor = torch.empty(param.shape, dtype=param_dtype)
            else:
                tensor = read_weight(weights, model, name, tuple(param.shape)).to(param_dtype)
            set_parameter(model, name, tensor)
        model.tie_weights()
        init_buffers(model)
    if device == "cpu" and weights is None:
        ARCHS[arch].init_random(model, seed)
    return model.eval().requires_grad_(False)


def checkpoint_keys(weights: SafetensorsDir, model, name: str, shape: tuple) -> list[tuple[str, tuple]]:
    """The checkpoint tensors (key, shape) our parameter `name` of full `shape` is made of; a
    stacked expert weight [E, out, in] is E (or 2E) per-expert tensors."""
    saved_by_transformers = "model.embed_tokens.weight" in weights
    return ARCHS[arch_name(model)].checkpoint_keys(name, model.config, shape, saved_by_transformers)


def check_checkpoint(checkpoint: str | Path, model):
    """Every tensor the model (meta, full shapes) reads is in the checkpoint with the right shape
    and a dtype we can read: checked from the file headers before anything is traced or compiled."""
    weights = SafetensorsDir(Path(checkpoint))
    for name, param in model.named_parameters():
        for key, shape in checkpoint_keys(weights, model, name, tuple(param.shape)):
            _check_shape(weights, key, shape)


def read_weight(weights: SafetensorsDir, model, name: str, shape: tuple,
                part: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Our parameter `name` (full `shape`), read from the checkpoint's layout and shape-checked;
    with part=(dim, start, length) only that slice is read."""
    keys = checkpoint_keys(weights, model, name, shape)
    if len(keys) > 1:  # stacked experts
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


_QUANTIZED = ("F8_E4M3", "F8_E5M2", "F8_E8M0", "I8", "U8", "F4")


def _check_shape(weights: SafetensorsDir, key: str, shape: tuple):
    found = tuple(weights.get_shape(key))
    if weights.get_dtype(key) in _QUANTIZED:
        raise CheckpointError(
            f"{weights.file_of(key)}: weight {key!r} is stored quantized ({weights.get_dtype(key)}), as DeepSeek's fp8/fp4 "
            "release is. Quantized checkpoints are not supported yet: dequantize to bfloat16 first."
        )
    if found != tuple(shape):
        raise CheckpointError(
            f"{weights.file_of(key)}: weight {key!r} has shape {list(found)}, but config.json implies {list(shape)}. "
            "The config and the weights come from different models."
        )


__all__ = ["build_model", "check_checkpoint", "model_config", "CheckpointError", "ConfigError", "DeepseekV3", "DeepseekV3Config",
           "DeepseekV4", "DeepseekV4Config", "Layout", "LayoutError", "TINY_CONFIG", "TINY_V4_CONFIG", "DTYPES"]
