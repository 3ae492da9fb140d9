"""A bundle runs only what it was compiled to run: no pickles, no paths outside it, tensors that
fit the regions' specs, and (with a deploy key) a signature that matches."""

import hashlib
import json
import os
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
    body["sizes"] = {rel: (bundle / rel).stat().st_size if (bundle / rel).is_file() else body.get("sizes", {}).get(rel, 0)
                     for rel in body["files"]}
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


def first_node_with(program, kind):
    """The first node argument of this kind (e.g. "as_int") in the region's graph."""
    return next(item["arg"] for node in program["graph_module"]["graph"]["nodes"] for item in node["inputs"] if kind in item["arg"])


def symbolic_size(program, marker):
    """The probe's attack: a tensor size handed to sympy.sympify by torch's deserializer."""
    values = program["graph_module"]["graph"]["tensor_values"]
    meta = values[sorted(values)[0]]
    meta["sizes"][0] = {"as_expr": {"expr_str": f"__import__('os').system('touch {marker}') + 64", "hint": {"as_int": 64}}}


def tampered_region(bundle, change):
    region = sorted((bundle / "regions").iterdir())[0]
    program = json.loads(region.read_bytes())
    change(program)
    region.write_text(json.dumps(program))
    edit_manifest(bundle, lambda body: None)


def test_a_symbolic_size_in_a_region_is_never_evaluated(bundle, tmp_path):
    marker = tmp_path / "PWNED"
    tampered_region(bundle, lambda program: symbolic_size(program, marker))
    out = run(bundle)
    assert out.returncode == 1 and "as_expr" in out.stderr and "static" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and not marker.exists()


SUBCLASSES = "torch.ops.aten.__class__.__subclasses__"


@pytest.mark.parametrize("change, message", [
    (lambda p: p.update(guards_code=["__import__('os').system('true')"]), r"guards_code: must be empty"),
    (lambda p: p.update(range_constraints={"s0": {"min_val": 1, "max_val": 2}}), r"range_constraints: must be empty"),
    (lambda p: p["graph_module"]["graph"]["nodes"][0].update(target="builtins.eval"), "'builtins.eval'.*not a PyTorch operator"),
    (lambda p: p["graph_module"]["graph"]["nodes"][0].update(target=SUBCLASSES), "__subclasses__', which is not an operator"),
    (lambda p: p["graph_module"]["graph"]["nodes"][0].update(target="torch.ops.aten.no_such_op.default"),
     "no_such_op.default', which is not an operator this PyTorch has"),
    (lambda p: first_node_with(p, "as_int").update(as_int=None) or first_node_with(p, "as_int").update(
        as_sym_int={"as_name": "s0"}) or first_node_with(p, "as_int").pop("as_int"), "holds 'as_sym_int'"),
    (lambda p: p["graph_module"]["graph"]["sym_int_values"].update(s0={"as_expr": {"expr_str": "1"}}), "sym_int_values: must be empty"),
    (lambda p: p["graph_module"]["graph"]["nodes"][0].update(metadata={"stack_trace": 5}), r"metadata.stack_trace: must be a string"),
    (lambda p: p["graph_module"]["graph"].update(extra=1), r"field\(s\) \['extra'\] that deepinfer-compile never writes"),
    (lambda p: next(n for n in p["graph_module"]["graph"]["nodes"] if n["outputs"] and "as_tensor" in n["outputs"][0]).update(
        outputs=[]), "not a graph this runtime can run"),
    (lambda p: p["graph_module"]["module_call_graph"][0]["signature"].update(
        in_spec='[1, {"type": "os.system", "context": "null", "children_spec": []}]'),
     "in_spec.type: must be one of"),
])
def test_an_export_region_holds_a_static_operator_graph_only(bundle, change, message):
    tampered_region(bundle, change)
    with pytest.raises(BundleError, match=message):
        BundleExecutor(bundle)


def test_a_region_file_of_another_region_is_refused(bundle):
    regions = sorted((bundle / "regions").iterdir(), key=lambda p: p.stat().st_size)
    regions[0].write_bytes(regions[-1].read_bytes())
    edit_manifest(bundle, lambda body: None)
    with pytest.raises(BundleError, match="not a graph this runtime can run on the manifest's inputs|computes .* where the manifest says"):
        BundleExecutor(bundle)


def test_a_deeply_nested_region_is_refused(bundle):
    region = sorted((bundle / "regions").iterdir())[0]
    region.write_text("[" * 100000)
    edit_manifest(bundle, lambda body: None)
    with pytest.raises(BundleError, match="not a serialized ExportedProgram"):
        BundleExecutor(bundle)


@pytest.mark.parametrize("backend", ["neuron|__init__", "__init__", "../export", "no_such_backend"])
def test_an_unknown_backend_is_refused(bundle, backend):
    edit_manifest(bundle, lambda body: [r.update(backend=backend) for r in body["regions"].values()])
    with pytest.raises(BundleError, match=r"backend .* is not one this runtime loads \(export, inductor, neuron, pjrt\)"):
        BundleExecutor(bundle)


def test_what_is_verified_is_what_is_loaded(bundle, tmp_path, monkeypatch):
    """A region file swapped for the payload after the manifest was read and signed (a shared
    model cache, NFS): the bytes loaded are the bytes hashed, so the swap is caught."""
    import deepinfer.runtime.executor as executor_module

    key = tmp_path / "deploy.key"
    key.write_text("k" * 64)
    sign(bundle, read_key(key))
    marker = tmp_path / "PWNED"
    region = sorted((bundle / "regions").iterdir())[0]
    program = json.loads(region.read_bytes())
    symbolic_size(program, marker)
    verified_read = executor_module.read_manifest

    def read_then_swap(*args, **kwargs):
        manifest = verified_read(*args, **kwargs)
        region.write_text(json.dumps(program))
        return manifest

    monkeypatch.setattr(executor_module, "read_manifest", read_then_swap)
    from deepinfer.runtime.trust import Trust

    with pytest.raises(BundleError, match="checksum mismatch|bytes, but the manifest says"):
        BundleExecutor(bundle, trust=Trust(verify_key_file=key))
    assert not marker.exists()


def test_a_data_only_deployment_refuses_native_regions(tiny_bundle, tmp_path):
    native = tmp_path / "native"
    shutil.copytree(tiny_bundle("inductor"), native)
    out = run(native, "--native-regions", "refuse")
    assert out.returncode == 1 and "carry machine code (inductor backend)" in out.stderr, out.stderr
    assert "--native-regions refuse" in out.stderr and "Traceback" not in out.stderr


def test_a_server_runs_native_regions_only_from_a_signed_bundle(tiny_bundle, tmp_path):
    """A region of machine code runs as it is: deepinfer-serve's default (--native-regions signed)
    refuses an unsigned native bundle, naming both ways on; with a verified signature it runs."""
    native = tmp_path / "native"
    shutil.copytree(tiny_bundle("inductor"), native)
    served = subprocess.run([sys.executable, "-m", "deepinfer.runtime.serve.cli", "--bundle", str(native), "--port", "0"],
                            capture_output=True, text=True, timeout=300)
    assert served.returncode == 1 and "carry machine code (inductor backend)" in served.stderr, served.stderr
    assert "--sign-key KEYFILE" in served.stderr and "--native-regions allow" in served.stderr, served.stderr
    assert "Traceback" not in served.stderr
    key = tmp_path / "deploy.key"
    key.write_text("k" * 64)
    sign(native, read_key(key))
    assert run(native, "--native-regions", "signed").returncode == 1
    out = run(native, "--native-regions", "signed", "--verify-key", key)
    assert out.returncode == 0, out.stderr


def test_export_regions_relabelled_native_are_refused_too(bundle):
    edit_manifest(bundle, lambda body: [r.update(backend="inductor") for r in body["regions"].values()])
    out = run(bundle, "--native-regions", "refuse")
    assert out.returncode == 1 and "carry machine code" in out.stderr, out.stderr
    out = run(bundle, "--native-regions", "allow")  # (the AOTInductor loader's own error, in one paragraph)
    assert out.returncode == 1 and "not an AOTInductor package" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_grown_file_is_refused_before_it_is_read(bundle):
    """The manifest records every file's size: a weights file grown to 30 GiB (sparse: no disk
    used) is refused before anything is allocated or read."""
    weights = bundle / "weights" / "rank-0.safetensors"
    expected = weights.stat().st_size
    os.truncate(weights, 30 << 30)
    out = run(bundle)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"rank-0.safetensors: {30 << 30} bytes, but the manifest says {expected}" in out.stderr, out.stderr


def test_files_are_read_only_as_the_manifest_lists_them(bundle, tmp_path):
    (bundle / "tokenizer.json").symlink_to("/dev/zero")  # unlisted: never opened (the manifest says bytes)
    (bundle / "chat_template.json").symlink_to("/dev/zero")
    assert run(bundle).returncode == 0
    manifest = bundle / "manifest.json"
    outside = tmp_path / "manifest.json"
    manifest.rename(outside)
    manifest.symlink_to(outside)
    out = run(bundle)
    assert out.returncode == 1 and "a symlink (a bundle holds its own files)" in out.stderr, out.stderr


def test_a_signature_or_key_that_is_not_a_small_regular_file_is_refused(bundle, tmp_path):
    key = tmp_path / "deploy.key"
    key.write_text("k" * 64)
    (bundle / "manifest.json.hmac").symlink_to("/dev/zero")
    out = run(bundle, "--verify-key", key)
    assert out.returncode == 1 and "manifest.json.hmac: cannot be read (a symlink" in out.stderr, out.stderr
    (bundle / "manifest.json.hmac").unlink()
    sign(bundle, read_key(key))
    fifo = tmp_path / "key.fifo"
    os.mkfifo(fifo)
    out = run(bundle, "--verify-key", fifo)
    assert out.returncode == 1 and "not a regular file" in out.stderr, out.stderr
    out = run(bundle, "--verify-key", "/dev/zero")
    assert out.returncode == 1 and "not a regular file" in out.stderr, out.stderr


def test_a_manifest_without_its_toolchain_is_refused(bundle):
    edit_manifest(bundle, lambda body: body.update(toolchain={}))
    with pytest.raises(BundleError, match="toolchain does not say which deepinfer, python, torch"):
        read_manifest(bundle, toolchain_versions())


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
    # A weight file without one is a rank whose weights are yet to be added (the weights step): never loaded.
    edit_manifest(bundle, lambda body: body["files"].pop("weights/rank-0.safetensors"))
    with pytest.raises(BundleError, match="rank 0's weights are not in this bundle yet"):
        read_manifest(bundle, toolchain_versions())
    region = next(name for name in json.loads((bundle / "manifest.json").read_text())["files"] if name.startswith("regions/"))
    edit_manifest(bundle, lambda body: body["files"].pop(region))
    with pytest.raises(BundleError, match=f"{region} is used but has no sha256"):
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


def test_a_program_that_writes_a_value_twice_is_refused(bundle):
    def edit(body):
        steps = next(iter(body["programs"].values()))["steps"]
        steps[1]["outputs"][0] = steps[0]["outputs"][0]

    edit_manifest(bundle, edit)
    with pytest.raises(BundleError, match=r"step 1: output '.*' is already bound .* each value is written once. Recompile the bundle"):
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
