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
from dataclasses import dataclass, replace
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
from .moe import DEFAULT_CAPACITY, OVERFLOW_FORMS
from .parallel import Layout, LayoutError
from .int_weights import BITS, GROUPS, IntWeights, float_source, quantized, source_name
from .quantization import BLOCK, FP4, FP4_GROUP, FP8, SCALE_SUFFIX, blocks, dequantize, expand_rows, is_quantized_param

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
QUANTIZED_WEIGHTS = ("keep", "dequantize")  # recipe model.quantized_weights: fp8 in the bundle, or the recipe's dtype


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
    if isinstance(config, dict) and config.get("quantization_config"):
        raise ConfigError("model.config: quantization_config describes a checkpoint's stored weights, and random weights are "
                          "not quantized. Give model.checkpoint for an fp8 checkpoint, or drop quantization_config.")
    return config_class.from_dict(config, "model.config", strict=True)


def build_model(
    arch: str = "deepseek_v3",
    checkpoint: str | Path | None = None,
    config: dict | None = None,
    seed: int = 0,
    dtype: str = "float32",
    device: str = "cpu",
    layout: Layout = Layout(),
    quantized_weights: str = "keep",
    expert_capacity: float = DEFAULT_CAPACITY,
    expert_overflow: str = "exact",
    draft_tokens: int = 0,
    quantize: str | None = None,
    quantize_group: int = 32,
    quantize_head: bool = True,
) -> DeepseekV3 | DeepseekV4:
    """Exactly one of `checkpoint` (an HF directory) or `config` (HF field names, random weights).

    A checkpoint with fp8 weights (quantization_config) keeps them fp8 (`quantized_weights`
    "keep": models/quantization.py) or is dequantized to `dtype` as it is read ("dequantize").
    `expert_overflow`: a prompt chunk's routed-experts form, `expert_capacity`: the grouped
    form's capacity (models/moe.py). `draft_tokens`: speculative decoding's drafts per step; above 0 the
    checkpoint's multi-token prediction modules (the drafter) are built and read. `quantize`
    "int8" / "int4" (groups of `quantize_group`; V3's LM head unless `quantize_head` is off) holds
    the weights as integer codes (models/int_weights.py), quantized from the float weights read
    (an fp8 checkpoint's dequantized).

    device="meta" or "fake" builds shapes only: nothing is allocated and no weights are read.
    "fake" gives FakeTensors on the CPU (from one FakeTensorMode, `model.embed.weight.fake_mode`),
    which torch.export traces like real weights. A `layout` other than one rank gives rank 0's
    shard shapes and collectives; it is for tracing (meta or fake) only — per-rank weights are
    cut from the full model by models.parallel.shard."""
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not supported; choose one of {list(DTYPES)}.")
    cfg = model_config(arch, checkpoint, config)
    if quantized_weights not in QUANTIZED_WEIGHTS:
        raise ConfigError(f"model.quantized_weights={quantized_weights!r}: choose one of {list(QUANTIZED_WEIGHTS)}.")
    if quantized_weights == "dequantize" or quantize:
        cfg = replace(cfg, quantization=None)
    if expert_overflow not in OVERFLOW_FORMS:
        raise ConfigError(f"model.expert_overflow={expert_overflow!r}: choose one of {list(OVERFLOW_FORMS)}.")
    cfg = replace(cfg, expert_capacity=expert_capacity, expert_overflow=expert_overflow)
    if draft_tokens:
        problem = mtp_problem(cfg)
        if problem:
            raise ConfigError(f"{checkpoint or 'model.config'}: {problem}")
        cfg = replace(cfg, draft_tokens=draft_tokens)
    if layout.world_size > 1 and device == "cpu":
        raise ValueError("build_model: a multi-rank layout is for tracing (device='meta' or 'fake') only.")
    if quantize:
        spec = int_weights_spec(quantize, quantize_group, quantize_head and arch_of(arch).model.INT_HEAD)
        if device == "cpu":
            return _quantized_copy(arch, replace(cfg, quantization=spec), model_from_config(arch, cfg, checkpoint, seed, dtype))
        cfg = replace(cfg, quantization=spec)
    return model_from_config(arch, cfg, checkpoint, seed, dtype, device, layout)


def int_weights_spec(quantize: str, group: int, head: bool) -> IntWeights:
    if quantize not in BITS:
        raise ConfigError(f"model.quantize={quantize!r}: choose one of {list(BITS)} (or leave it out for the recipe's dtype).")
    if group not in GROUPS:
        raise ConfigError(f"model.quantize_group={group}: int4 groups of {' / '.join(map(str, GROUPS))} inputs share a scale.")
    return IntWeights(BITS[quantize], group, head)


def model_from_config(arch: str, cfg, checkpoint, seed: int, dtype: str, device: str = "cpu", layout: Layout = Layout()):
    """The model of a validated config: weights read, random (no checkpoint), or only shapes."""
    with torch.device("meta"):
        model = arch_of(arch).model(cfg, layout)
    if device == "meta":
        return model
    weights = SafetensorsDir(Path(checkpoint)) if checkpoint is not None and device == "cpu" else None
    with FakeTensorMode() if device == "fake" else nullcontext():
        for name, param in list(model.named_parameters()):
            param_dtype = stored_dtype(model, name, DTYPES[dtype])
            if weights is None:
                tensor = torch.empty(param.shape, dtype=param_dtype)
            else:
                tensor = read_weight(weights, model, name).to(param_dtype)
            set_parameter(model, name, tensor)
        model.tie_weights()
        init_buffers(model)
    if device == "cpu" and weights is None:
        ARCHS[arch].init_random(model, seed)
    return model.eval().requires_grad_(False)


def _quantized_copy(arch: str, cfg, source):
    """The model of `cfg` (int-quantized) with its weights quantized from `source` (float, same names)."""
    with torch.device("meta"):
        model = arch_of(arch).model(cfg)
    made = {}
    for name, param in list(model.named_parameters()):
        origin = source_name(name)
        if origin != name or param.dtype in (torch.int8, torch.uint8):
            if origin not in made:
                codes_dtype = model.get_parameter(origin).dtype
                weight = float_source(model, origin, source.get_parameter)
                made.update(quantized(origin, weight, codes_dtype, cfg.quantization.group))
            tensor = made[name]
        else:
            tensor = source.get_parameter(name)
        set_parameter(model, name, tensor)
    model.tie_weights()
    init_buffers(model)
    return model.eval().requires_grad_(False)


def context_parallel_supported(arch: str) -> bool:
    """Whether the architecture splits its state over a context-parallel group (parallel.cp)."""
    return arch_of(arch).model.CONTEXT_PARALLEL


def mtp_problem(config) -> str | None:
    """Why this model cannot draft with multi-token prediction (MTP) modules, or None."""
    if not config.num_nextn_predict_layers:
        return ("the model has no MTP module to draft with (its config says num_nextn_predict_layers: 0 or nothing): "
                "use a checkpoint that has one (DeepSeek-V3's release does), or leave speculative decoding off.")
    return None


def stored_dtype(model, name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype parameter `name` has in memory and in a bundle for a recipe `dtype`: quantized
    weights and their scales keep the checkpoint's."""
    param = model.get_parameter(name)
    return param.dtype if is_quantized_param(param, name) else model.param_dtype(name, dtype)


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
        if name.endswith(SCALE_SUFFIX):
            continue  # checked with its weight
        for key, shape in checkpoint_keys(weights, model, name, _logical_shape(param)):
            _check_tensor(weights, key, shape, param.dtype)


def read_weight(weights: SafetensorsDir, model, name: str, part: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Our parameter `name` (of `model`, full shapes), read from the checkpoint's layout and shape-checked;
    with part=(dim, start, length) only that slice is read. A quantized checkpoint tensor (fp8, or
    fp4 packed two a byte) stays so where the model keeps it (its `_scale_inv` parameter reads the
    scales, fp8 ones row-expanded) and is dequantized otherwise."""
    scales_of = name.endswith(SCALE_SUFFIX)
    weight_name = name.removesuffix(SCALE_SUFFIX)
    param = model.get_parameter(weight_name)
    kept = param.dtype in (FP8, FP4)
    logical = _logical_shape(param)

    def read(key, key_shape):  # key_shape: the logical [out, in]
        scale_key = _check_tensor(weights, key, key_shape, param.dtype)
        if scales_of:
            return _scales(weights, key, scale_key, key_shape)
        tensor = _stored(weights.get(key))
        if scale_key is None or kept:
            return tensor
        return dequantize(tensor, _scales(weights, key, scale_key, key_shape), torch.float32, BLOCK)

    keys = checkpoint_keys(weights, model, weight_name, logical)
    if len(keys) > 1:  # stacked experts
        n_parts = len(keys) // logical[0]
        first, count = (part[1], part[2]) if part else (0, logical[0])  # experts split over dim 0 only
        chosen = keys[first * n_parts : (first + count) * n_parts]
        return torch.stack([torch.cat([read(*k) for k in chosen[e : e + n_parts]]) for e in range(0, len(chosen), n_parts)])
    ((key, key_shape),) = keys
    if part is None:
        return read(key, key_shape)
    if scales_of or weights.get_dtype(key) in _QUANTIZED:  # small (scales) or dequantized whole: cut after reading
        return read(key, key_shape).narrow(*part)
    _check_tensor(weights, key, key_shape, param.dtype)
    return weights.get_slice(key, *part)


def _logical_shape(param: torch.Tensor) -> tuple:
    """A weight's [..., out, in], also for fp4 kept packed two codes a byte ([..., out, in/2])."""
    return (*param.shape[:-1], param.shape[-1] * 2) if param.dtype == FP4 else tuple(param.shape)


_QUANTIZED = ("F8_E4M3", "F8_E5M2", "F8_E8M0", "I8", "U8", "F4")
_FP4 = ("I8", "U8")  # how checkpoints store fp4 e2m1 pairs


def _stored(tensor: torch.Tensor) -> torch.Tensor:
    """fp4 pairs and e8m0 scales as the bytes we keep; anything else unchanged."""
    return tensor.view(torch.uint8) if tensor.dtype in (torch.int8, torch.float8_e8m0fnu) else tensor


def _scale_key(weights: SafetensorsDir, key: str) -> str:
    """transformers' `<weight>_scale_inv`, or DeepSeek's upstream `<module>.scale`."""
    for candidate in (key + SCALE_SUFFIX, key.removesuffix(".weight") + ".scale"):
        if candidate in weights:
            return candidate
    return key + SCALE_SUFFIX


def _scales(weights: SafetensorsDir, key: str, scale_key: str, shape: tuple) -> torch.Tensor:
    scales = _stored(weights.get(scale_key))
    return scales if weights.get_dtype(key) in _FP4 else expand_rows(scales, shape[0], BLOCK)


def _check_tensor(weights: SafetensorsDir, key: str, shape: tuple, param_dtype: torch.dtype) -> str | None:
    """Checks checkpoint tensor `key` for our logical weight `shape` and the dtype the model keeps
    (FP8 / FP4: quantized, else the recipe's); returns its scales' key if it is quantized."""
    found, dtype = tuple(weights.get_shape(key)), weights.get_dtype(key)
    where = f"{weights.file_of(key)}: weight {key!r}"
    fp4 = dtype in _FP4
    stored = (*shape[:-1], shape[-1] // 2) if fp4 else tuple(shape)
    if found != stored:
        raise CheckpointError(f"{where} has shape {list(found)}, but config.json implies {list(stored)}. "
                              "The config and the weights come from different models.")
    if dtype not in ("F8_E4M3", *_FP4):
        if param_dtype in (FP8, FP4):
            raise CheckpointError(f"{where} is {dtype}, but quantization_config says it is stored "
                                  f"{'fp4' if param_dtype == FP4 else 'fp8'} with a scale. The config and the weights do not match.")
        if dtype in _QUANTIZED:
            raise CheckpointError(f"{where} is stored as {dtype}, which deepinfer does not read (fp8 e4m3 with 128x128 block "
                                  "scales, and fp4 e2m1 experts with e8m0 scales, are read).")
        return None
    if param_dtype in (FP8, FP4) and fp4 != (param_dtype == FP4):
        raise CheckpointError(f"{where} is {dtype}, but quantization_config.expert_dtype says "
                              f"{'fp4' if param_dtype == FP4 else 'fp8'}. The config and the weights do not match.")
    scale_key = _scale_key(weights, key)
    if scale_key not in weights:
        raise CheckpointError(f"{where} is {'fp4' if fp4 else 'fp8'} but its scales {scale_key!r} are missing. "
                              "Is the checkpoint complete?")
    if fp4:
        grid, dtypes, what = [shape[0], shape[1] // FP4_GROUP], ("F8_E8M0",), f"one e8m0 scale per {FP4_GROUP} inputs"
    else:
        grid, dtypes, what = [blocks(shape[0], BLOCK), blocks(shape[1], BLOCK)], ("F32", "F8_E8M0"), f"{BLOCK}x{BLOCK} blocks"
    scale_shape, scale_dtype = weights.get_shape(scale_key), weights.get_dtype(scale_key)
    if scale_shape != grid or scale_dtype not in dtypes:
        raise CheckpointError(f"{weights.file_of(scale_key)}: {scale_key!r} is {scale_shape} {scale_dtype}, but the "
                              f"{'fp4' if fp4 else 'fp8'} weight {list(shape)} in {what} needs {' or '.join(dtypes)} scales "
                              f"{grid}. The checkpoint is corrupt or from another quantizer.")
    return scale_key


__all__ = ["build_model", "check_checkpoint", "context_parallel_supported", "mtp_problem", "stored_dtype", "QUANTIZED_WEIGHTS", "model_config", "CheckpointError", "ConfigError", "DeepseekV3", "DeepseekV3Config",
           "DeepseekV4", "DeepseekV4Config", "Layout", "LayoutError", "TINY_CONFIG", "TINY_V4_CONFIG", "DTYPES"]
