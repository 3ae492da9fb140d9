"""A bundle is verified on load: any flipped byte, edited manifest or toolchain mismatch is caught."""

import json
import shutil

import pytest

from deepinfer.runtime.executor import BundleExecutor
from deepinfer.runtime.manifest import BundleError, Manifest, read_manifest
from deepinfer.runtime.versions import toolchain_versions


@pytest.fixture
def bundle(tiny_bundle, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(tiny_bundle("export"), copy)
    return copy


def flip_byte(path, offset=None):
    data = bytearray(path.read_bytes())
    offset = len(data) // 2 if offset is None else offset
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_intact_bundle_loads(bundle):
    manifest = read_manifest(bundle, toolchain_versions())
    assert set(manifest.files) >= {"weights/rank-0.safetensors"} and len(manifest.regions) == 16


def test_flipped_byte_in_a_region(bundle):
    region = sorted((bundle / "regions").iterdir())[0]
    flip_byte(region)
    with pytest.raises(BundleError, match=rf"{region.name}: checksum mismatch"):
        BundleExecutor(bundle)  # (files are hashed as they are read for use)


def test_flipped_byte_in_the_weights(bundle):
    flip_byte(bundle / "weights" / "rank-0.safetensors")
    with pytest.raises(BundleError, match=r"rank-0.safetensors: checksum mismatch"):
        BundleExecutor(bundle)


def test_edited_manifest(bundle):
    path = bundle / "manifest.json"
    body = json.loads(path.read_text())
    body["buckets"]["decode"] = [1, 2, 4]
    path.write_text(json.dumps(body))
    with pytest.raises(BundleError, match="manifest was edited"):
        read_manifest(bundle, toolchain_versions())


def test_missing_file(bundle):
    (bundle / "weights" / "rank-0.safetensors").unlink()
    with pytest.raises(BundleError, match="rank-0.safetensors: missing"):
        read_manifest(bundle, toolchain_versions())


def test_toolchain_mismatch_names_both_versions(bundle):
    path = bundle / "manifest.json"
    manifest = Manifest.from_dict(json.loads(path.read_text()))
    manifest.toolchain["torch"] = "2.99.0"
    path.write_text(manifest.to_json())  # a consistent manifest, as another machine would write it
    with pytest.raises(BundleError, match=r"compiled with torch 2.99.0, but this runtime has torch 2\.13"):
        read_manifest(bundle, toolchain_versions())


def test_kernels_built_for_cpu_features_this_host_lacks_are_refused(tiny_bundle, tmp_path):
    bundle = tmp_path / "inductor"
    shutil.copytree(tiny_bundle("inductor"), bundle)
    path = bundle / "manifest.json"
    manifest = Manifest.from_dict(json.loads(path.read_text()))
    assert manifest.toolchain["inductor_isa"]  # the compiling host's vector ISA, e.g. "avx2"
    assert manifest.toolchain["inductor_bf16_products"] in ("bfloat16", "float32")
    manifest.toolchain["inductor_isa"] += " avx10_2"  # as a newer CPU's compile would record it
    path.write_text(manifest.to_json())
    with pytest.raises(BundleError, match=r"built for CPU features .* this host lacks avx10_2 .* illegal instruction"):
        BundleExecutor(bundle)


def test_not_a_bundle(tmp_path):
    with pytest.raises(BundleError, match="no manifest.json"):
        read_manifest(tmp_path, toolchain_versions())
    (tmp_path / "manifest.json").write_text('{"magic": "other"}')
    with pytest.raises(BundleError, match="not a deepinfer bundle"):
        read_manifest(tmp_path, toolchain_versions())
