"""The checkpoint reader reads tensors and their row or column slices with plain reads (no memory
map: a mapped page it touched would stay in RSS beside the tensor, twice its size)."""

import torch
from safetensors.torch import save_file

from deepinfer.models import checkpoint
from deepinfer.models.checkpoint import SafetensorsDir


def test_tensors_and_slices_read_back_exactly(tmp_path, monkeypatch):
    weight = torch.randn(37, 24).to(torch.bfloat16)
    tensors = {"w": weight, "fp8": torch.randn(5, 8).to(torch.float8_e4m3fn), "e8m0": torch.arange(6, dtype=torch.uint8).view(torch.float8_e8m0fnu),
               "codes": torch.randint(-128, 128, (4, 16), dtype=torch.int8), "table": torch.arange(12).view(3, 4)}
    save_file(dict(list(tensors.items())[:2]), str(tmp_path / "a.safetensors"))
    save_file(dict(list(tensors.items())[2:]), str(tmp_path / "b.safetensors"))
    monkeypatch.setattr(checkpoint, "READ_CHUNK", 5 * 24 * 2)  # 5 rows at a time: a partial last chunk
    weights = SafetensorsDir(tmp_path)
    for key, tensor in tensors.items():
        got = weights.get(key)
        assert got.dtype == tensor.dtype and torch.equal(got.view(torch.uint8), tensor.view(torch.uint8)), key
    assert torch.equal(weights.get_slice("w", 0, 10, 9), weight[10:19])
    assert torch.equal(weights.get_slice("w", 1, 6, 12), weight[:, 6:18])
    assert torch.equal(weights.get_slice("table", 1, 2, 2), tensors["table"][:, 2:])
