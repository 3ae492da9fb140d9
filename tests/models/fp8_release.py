"""Checkpoints in DeepSeek-V3's fp8 release format, written from a transformers model for tests:
every linear weight of the decoder layers but the router is float8_e4m3fn with a float32
`_scale_inv` [ceil(out/128), ceil(in/128)], one scale per 128x128 block (amax / 448), as
DeepSeek's quantizer writes them; config.json carries the release's quantization_config."""

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

BLOCK = 128
RELEASE_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}


def quantized_in_release(key: str, tensor: torch.Tensor) -> bool:
    return key.startswith("model.layers.") and key.endswith(".weight") and tensor.dim() == 2 and not key.endswith("mlp.gate.weight")


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> fp8 [out, in] and scales [ceil(out/128), ceil(in/128)] (partial edge blocks)."""
    out, columns = weight.shape
    rows, cols = math.ceil(out / BLOCK), math.ceil(columns / BLOCK)
    padded = F.pad(weight.float(), (0, cols * BLOCK - columns, 0, rows * BLOCK - out)).view(rows, BLOCK, cols, BLOCK)
    scales = padded.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0  # [rows, cols]
    fp8 = (padded / scales[:, None, :, None]).to(torch.float8_e4m3fn).view(rows * BLOCK, cols * BLOCK)[:out, :columns]
    return fp8.contiguous(), scales


def dequantize_reference(fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The release's formula, written out: each value times the scale of the block it sits in."""
    out, columns = fp8.shape
    per_value = scales.repeat_interleave(BLOCK, dim=0)[:out].repeat_interleave(BLOCK, dim=1)[:, :columns]
    return fp8.float() * per_value


def write_fp8_release(hf_model, directory: Path, dequantized_directory: Path):
    """Save `hf_model` in the release format to `directory`, and to `dequantized_directory` as
    the fp8 bytes decode (an unquantized checkpoint: transformers' reference for the same weights)."""
    hf_model.save_pretrained(dequantized_directory)  # transformers' own layout: one tensor per expert
    (file,) = Path(dequantized_directory).glob("*.safetensors")
    tensors, dequantized = {}, {}
    for key, tensor in load_file(str(file)).items():
        if quantized_in_release(key, tensor):
            fp8, scales = quantize(tensor)
            tensors[key], tensors[key + "_scale_inv"] = fp8, scales
            dequantized[key] = dequantize_reference(fp8, scales).to(tensor.dtype)
        else:
            tensors[key] = dequantized[key] = tensor
    save_file(dequantized, str(file), metadata={"format": "pt"})
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((Path(dequantized_directory) / "config.json").read_text())
    config["quantization_config"] = RELEASE_QUANTIZATION
    (directory / "config.json").write_text(json.dumps(config, indent=2))
