"""A bundle runs only what it was compiled to run: no pickles, no paths outside it, tensors that
fit the regions' specs, and (with a deploy key) a signature that matches."""

import hashlib
import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer.runtime.executor import BundleExecutor
from deepinfer.runtime.manifest import BundleError, Manifest, read_key, read_manifest, sign
from deepinfer.runtime.versions import toolchain_versions


@pytest.fixture
def bundle(tiny_bundle, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(tiny_bundle("export"), copy)
    return copy


def edit_manifest(bundle, edit):
    """Apply edit(body) and rewrite the manifest consistently (sha256 of every file, checksum), as an
    attacker who knows the format would: the checksum is no guard."""
    path = bundle / "manifest.json"
    body = json.loads(path.read_text())
    edit(body)
    body["files"] = {rel: hashlib.sha256((bundle / rel).read_bytes()).hexdigest() if (bundle / rel).is_file() else digest
                     for rel, digest in body["files"].items()}
    path.write_text(Manifest.from_dict(body).to_json())


def run(bundle, *args):
    return subprocess.run([sys.executable, "-m", "deepinfer.runtime.cli", "--bundle", str(bundle), "--prompt-ids", "5,6,7",
                           "--max-tokens", "3", *map(str, args)], capture_output=True, text=True, timeout=300)


class Payload:
    """Unpickling this writes a marker file: proof that a bundle ran code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickle_in_a_region_never_runs(bundle, tmp_path):
    marker = tmp_path / "pwned"
    region = sorted((bundle / "regions").iterdir())[0]
    # The old attack: a torch.export archive whose sample inputs are a pickle, under the region's name.
    program = torch.export.export(torch.nn.ReLU(), (torch.zeros(2),))
    archive = tmp_path / "evil.pt2"
    torch.export.save(program, archive)
    import zipfile

    with zipfile.ZipFile(archive) as src, zipfile.ZipFile(region, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename.endswith("sample_inputs/model.pt"):
                import io

                buffer = io.BytesIO()
                torch.save(Payload(marker), buffer)
                data = buffer.getvalue()
            dst.writestr(item, data)
    edit_manifest(bundle, lambda body: None)
    out = run(bundle)
    assert out.returncode == 1 and "not a serialized ExportedProgram" in out.stderr and "Traceback" not in out.stderr
    assert not marker.exists()


@pytest.mark.parametrize("change, message", [
    (lambda p: p.update(guards_code=["__import__('os').system('true')"]), "carries guard code"),
    (lambda p: p["graph_module"]["graph"]["nodes"][0].update(target="builtins.eval"), "'builtins.eval', which is not a PyTorch operator"),
])
def test_an_export_region_holds_operator_calls_only(bundle, change, message):
    region = sorted((bundle / "regions").iterdir())[0]
    program = json.loads(region.read_bytes())
    change(program)
    region.write_text(json.dumps(program))
    edit_manifest(bundle, lambda body: None)
    with pytest.raises(BundleError, match=message):
        BundleExecutor(bundle)


@pytest.mark.parametrize("path", ["/etc/passwd", "../../outside.ep.json", "regions/../../x", "regions//x"])
def test_a_path_outside_the_bundle_is_refused(bundle, path):
    def edit(body):
        fp = sorted(body["regions"])[0]
        old = body["regions"][fp]["file"]
        body["regions"][fp]["file"] = path
        body["files"][path] = body["files"].pop(old)

    edit_manifest(bundle, edit)
    with pytest.raises(BundleError, match="not a plain relative path inside the bundle"):
        read_manifest(bundle, toolchain_versions())


def test_a_referenced_file_without_a_checksum_is_refused(bundle):
    edit_manifest(bundle, lambda body: body["files"].pop("weights/rank-0.safetensors"))
    with pytest.raises(BundleError, match="weights/rank-0.safetensors is used but has no sha256"):
        read_manifest(bundle, toolchain_versions())


def test_a_shortened_weight_is_refused_before_any_region_runs(bundle):
    path = bundle / "weights" / "rank-0.safetensors"
    weights = load_file(path)
    weights["embed.weight"] = weights["embed.weight"][:100].clone()
    save_file(weights, path)
    edit_manifest(bundle, lambda body: None)
    with pytest.raises(BundleError, match=r"input \d+ \(embed.weight\) is \(\[100, 64\], 'float32'\) but the region was compiled for "
                                          r"\(\[320, 64\], 'float32'\).*out of bounds"):
        BundleExecutor(bundle)


def test_a_smaller_kv_pool_is_refused(bundle):
    def edit(body):
        body["kv"]["max_len"] = 128
        body["kv"]["shape"][1] = 128
        for layer in body["state"]:
            layer[0]["shape"][1] = 128

    edit_manifest(bundle, edit)
    with pytest.raises(BundleError, match=r"\(kv.0.latent\) is \(\[5, 128, 40\], 'float32'\) but the region was compiled for \(\[5, 256, 40\]"):
        BundleExecutor(bundle)


def test_signed_bundles(bundle, tmp_path):
    key, other = tmp_path / "deploy.key", tmp_path / "other.key"
    key.write_text("k" * 64)
    other.write_text("o" * 64)
    out = run(bundle, "--verify-key", key)
    assert out.returncode == 1 and "not signed" in out.stderr
    sign(bundle, read_key(key))
    assert run(bundle, "--verify-key", key).returncode == 0
    out = run(bundle, "--verify-key", other)
    assert out.returncode == 1 and "signature does not match" in out.stderr
    edit_manifest(bundle, lambda body: body.update(name="renamed"))  # re-checksummed, not re-signed
    out = run(bundle, "--verify-key", key)
    assert out.returncode == 1 and "signature does not match" in out.stderr
    (tmp_path / "short.key").write_text("short")
    out = run(bundle, "--verify-key", tmp_path / "short.key")
    assert out.returncode == 1 and "at least 16 bytes" in out.stderr


def test_compile_signs_with_a_deploy_key(tiny_bundle, cache_dir, tmp_path):
    from tests.conftest import TINY_RECIPE

    tiny_bundle("export")
    key = tmp_path / "deploy.key"
    key.write_text("s" * 64)
    out = tmp_path / "signed"
    compile_run = subprocess.run([sys.executable, "-m", "deepinfer.compiler.cli", str(TINY_RECIPE), "--backend", "export",
                                  "--out", str(out), "--cache-dir", str(cache_dir), "--sign-key", str(key)],
                                 capture_output=True, text=True, timeout=600)
    assert compile_run.returncode == 0, compile_run.stderr
    assert run(out, "--verify-key", key).returncode == 0


def test_a_symlinked_directory_out_of_the_bundle_is_refused(bundle, tmp_path):
    outside = tmp_path / "elsewhere"
    (bundle / "regions").rename(outside)
    (bundle / "regions").symlink_to(outside)
    with pytest.raises(BundleError, match="leads outside the bundle"):
        read_manifest(bundle, toolchain_versions())
