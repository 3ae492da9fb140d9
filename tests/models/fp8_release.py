"""Checkpoints in DeepSeek-V3's and V4's release formats, written from transformers models for
tests. V3: every linear weight of the decoder layers but the router is float8_e4m3fn with a float32
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


def write_release(hf_model, directory: Path, dequantized_directory: Path, quantize_tensor, quantization_config: dict):
    """Save `hf_model` in a release format to `directory` — `quantize_tensor(key, tensor)` gives
    the tensors a key is stored as (weight and scales) and what they decode to, or None to keep it —
    and to `dequantized_directory` as those bytes decode: an unquantized checkpoint, transformers'
    reference for the same weights."""
    hf_model.save_pretrained(dequantized_directory)  # transformers' own layout: one tensor per expert
    (file,) = Path(dequantized_directory).glob("*.safetensors")
    tensors, dequantized = {}, {}
    for key, tensor in load_file(str(file)).items():
        quantized = quantize_tensor(key, tensor)
        if quantized is None:
            tensors[key] = dequantized[key] = tensor
        else:
            stored, dequantized[key] = quantized
            tensors.update(stored)
    save_file(dequantized, str(file), metadata={"format": "pt"})
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((Path(dequantized_directory) / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def v3_tensor(key: str, tensor: torch.Tensor):
    if not quantized_in_release(key, tensor):
        return None
    fp8, scales = quantize(tensor)
    return {key: fp8, key + "_scale_inv": scales}, dequantize_reference(fp8, scales).to(tensor.dtype)


def write_fp8_release(hf_model, directory: Path, dequantized_directory: Path):
    write_release(hf_model, directory, dequantized_directory, v3_tensor, RELEASE_QUANTIZATION)


# DeepSeek-V4's release: fp8 with power-of-two (e8m0) block scales named `<module>.scale`, the
# routed experts fp4 e2m1 two a byte (even column in the low nibble) with an e8m0 scale per 32
# inputs; the compressors and the indexer's scoring projection stay unquantized.
V4_QUANTIZATION = {**RELEASE_QUANTIZATION, "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of codes 0-7; bit 3 is the sign


def quantized_in_v4_release(key: str, tensor: torch.Tensor) -> bool:
    return (key.startswith("model.layers.") and key.endswith(".weight") and tensor.dim() == 2
            and not any(part in key for part in ("compressor.", "indexer.weights_proj", "ffn.gate.")))


def power_of_two_at_least(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(x)))


def quantize_fp8_ue8m0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    fp8, scales = quantize(weight)
    pow2 = power_of_two_at_least(scales)  # the same blocks, a power-of-two scale at least as large
    out, columns = weight.shape
    per_value = pow2.repeat_interleave(BLOCK, dim=0)[:out].repeat_interleave(BLOCK, dim=1)[:, :columns]
    return (weight.float() / per_value).to(torch.float8_e4m3fn), pow2.to(torch.float8_e8m0fnu)


def quantize_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> int8 [out, in/2] (code pairs) and e8m0 scales [out, in/32]."""
    groups = weight.float().view(weight.shape[0], -1, 32)
    scales = power_of_two_at_least(groups.abs().amax(dim=-1).clamp(min=1e-12) / 6.0)  # [out, in/32]
    scaled = (groups / scales[..., None]).flatten(1)
    magnitudes = torch.tensor(E2M1)
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1) | ((scaled < 0).long() << 3)
    packed = (codes[:, 0::2] | codes[:, 1::2] << 4).to(torch.uint8)
    return packed.view(torch.int8), scales.to(torch.float8_e8m0fnu)


def dequantize_fp4_reference(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1 + tuple(-v for v in E2M1))
    u8 = packed.view(torch.uint8).long()
    values = torch.stack([table[u8 & 0xF], table[u8 >> 4]], dim=-1).flatten(1)  # [out, in]
    return values * scales.float().repeat_interleave(32, dim=1)


def v4_tensor(key: str, tensor: torch.Tensor):
    if not quantized_in_v4_release(key, tensor):
        return None
    scale_key = key.removesuffix(".weight") + ".scale"
    if ".ffn.experts." in key:
        packed, scales = quantize_fp4(tensor)
        return {key: packed, scale_key: scales}, dequantize_fp4_reference(packed, scales).to(tensor.dtype)
    fp8, scales = quantize_fp8_ue8m0(tensor)
    return {key: fp8, scale_key: scales}, dequantize_reference(fp8, scales.float()).to(tensor.dtype)


def write_v4_release(hf_model, directory: Path, dequantized_directory: Path):
    write_release(hf_model, directory, dequantized_directory, v4_tensor, V4_QUANTIZATION)


def reference_tokens(model_class, dequantized_directory: Path, prompts: list[list[int]], steps: int):
    """transformers' model on the dequantized copy, and its greedy `steps` tokens for each prompt."""
    hf = model_class.from_pretrained(dequantized_directory).eval()
    hf.config._attn_implementation = "eager"
    tokens = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(steps):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            tokens.append(ids[len(prompt):])
    return hf, tokens
