"""Weights and the state pool on 2 MiB pages (runtime/huge_pages.py)."""

import hashlib
from pathlib import Path

import pytest
import torch

from deepinfer.runtime import huge_pages
from deepinfer.runtime.files import read_verified

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def mapping_flags_at(address: int) -> list[str]:
    """VmFlags of the mapping that holds `address` (/proc/self/smaps): `hg` once it is advised as
    huge-page memory. (Whether the kernel then finds free 2 MiB pages for it, AnonHugePages, depends
    on how fragmented the machine's memory is: not something to assert on a shared CI machine.)"""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(bound, 16) for bound in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return []


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="this kernel gives no transparent huge pages")
def test_a_big_buffer_starts_on_a_huge_page_and_is_advised_as_huge_page_memory():
    t = huge_pages.empty((3, 1 << 20), torch.float32)
    assert t.shape == (3, 1 << 20) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert "hg" in mapping_flags_at(t.data_ptr()) and "hg" in mapping_flags_at(t.data_ptr() + t.nbytes - 1)
    t.fill_(1)
    assert t.sum().item() == 3 << 20


def test_a_small_buffer_is_an_ordinary_tensor():
    t = huge_pages.empty((5, 7), torch.int64)
    assert t.shape == (5, 7) and t.dtype == torch.int64 and t.untyped_storage().nbytes() == 5 * 7 * 8


def test_a_bundle_file_is_read_into_a_buffer_on_a_huge_page_boundary(tmp_path):
    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8).numpy().tobytes()
    (tmp_path / "rank-0.safetensors").write_bytes(data)
    buffer = read_verified(tmp_path / "rank-0.safetensors", hashlib.sha256(data).hexdigest(), len(data))
    assert buffer.data_ptr() % huge_pages.HUGE_PAGE == 0 and buffer.numpy().tobytes() == data
