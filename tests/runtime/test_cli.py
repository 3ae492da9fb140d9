"""deepinfer-run as a user runs it."""

import json
import subprocess
import sys


def run(*args, env=None):
    import os

    return subprocess.run([sys.executable, "-m", "deepinfer.runtime.cli", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def test_json_output_with_text_and_id_prompts(tiny_bundle, tmp_path):
    bundle = str(tiny_bundle("inductor"))
    trace = tmp_path / "trace.json"
    out = run("--bundle", bundle, "--prompt", "hello", "--prompt-ids", "5,6,7", "--max-tokens", "5", "--json",
              env={"DEEPINFER_HOST_TIMING": "1", "DEEPINFER_REGION_TIMING": str(trace)})
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    first, second = body["results"]
    assert first["prompt_ids"] == [b + 2 for b in b"hello"] and second["prompt_ids"] == [5, 6, 7]
    assert all(len(r["token_ids"]) <= 5 and isinstance(r["text"], str) for r in body["results"])
    timing = body["timing"]
    assert timing["ttft"] > 0 and timing["tpot"] > 0 and len(timing["host_region_seconds"]) >= 4
    events = json.loads(trace.read_text())["traceEvents"]
    assert events and {"name", "ph", "ts", "dur"} <= set(events[0])


def test_sampling_is_reproducible_and_differs_from_greedy(tiny_bundle):
    bundle = str(tiny_bundle("inductor"))
    args = ("--bundle", bundle, "--prompt-ids", "5,6,7", "--max-tokens", "12", "--json")
    greedy = json.loads(run(*args).stdout)["results"][0]["token_ids"]
    sampled = [json.loads(run(*args, "--temperature", "1.5", "--top-p", "0.95", "--seed", "3").stdout)["results"][0]["token_ids"]
               for _ in range(2)]
    assert sampled[0] == sampled[1] and sampled[0] != greedy


def test_prompt_past_context_limit_is_a_clear_error(tiny_bundle):
    ids = ",".join(["5"] * 300)
    out = run("--bundle", str(tiny_bundle("inductor")), "--prompt-ids", ids)
    assert out.returncode == 1
    assert "300 tokens is past the context limit" in out.stderr and "Traceback" not in out.stderr


def test_tampered_bundle_is_refused(tiny_bundle, tmp_path):
    import shutil

    bundle = tmp_path / "b"
    shutil.copytree(tiny_bundle("inductor"), bundle)
    region = sorted((bundle / "regions").iterdir())[0]
    data = bytearray(region.read_bytes())
    data[len(data) // 2] ^= 0xFF
    region.write_bytes(bytes(data))
    out = run("--bundle", str(bundle), "--prompt", "hi")
    assert out.returncode == 1 and "checksum mismatch" in out.stderr and region.name in out.stderr


def test_out_of_vocabulary_ids_are_refused_by_the_compiled_bundle(tiny_bundle):
    for backend in ("inductor", "export"):
        out = run("--bundle", str(tiny_bundle(backend)), "--prompt-ids", "1,320,3")
        assert out.returncode == 1 and "token id 320 is outside the model's vocabulary" in out.stderr
        assert "Traceback" not in out.stderr


def test_bad_flags_and_knobs_fail_before_loading(tiny_bundle, tmp_path):
    bundle = str(tiny_bundle("export"))
    for args, message in [(("--top-p", "0"), "top_p=0.0"), (("--temperature", "nan"), "temperature=nan"),
                          (("--max-tokens", "0"), "0 is not in the range x>=1")]:
        out = run("--bundle", bundle, "--prompt-ids", "1,2", *args)
        assert out.returncode != 0 and message in out.stderr and "Traceback" not in out.stderr
    out = run("--bundle", bundle, "--prompt-ids", "1,2", env={"DEEPINFER_REGION_TIMING": str(tmp_path / "no" / "trace.json")})
    assert out.returncode == 1 and "is not an existing directory" in out.stderr


def test_help_and_version_on_every_command():
    import subprocess
    import sys

    for module in ("deepinfer.runtime.cli", "deepinfer.compiler.cli", "deepinfer.runtime.follower"):
        out = subprocess.run([sys.executable, "-m", module, "-h"], capture_output=True, text=True)
        assert out.returncode == 0 and "Usage:" in out.stdout
    for module in ("deepinfer.runtime.cli", "deepinfer.compiler.cli"):
        out = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True)
        assert out.returncode == 0 and "version" in out.stdout
    out = subprocess.run([sys.executable, "-m", "deepinfer.compiler.cli", "--help"], capture_output=True, text=True)
    assert "RECIPE" in out.stdout and "--out" in out.stdout and "bisect" in out.stdout  # how to compile, at the top


def test_parameters_that_underflow_in_float32_are_greedy(tiny_bundle):
    args = ("--bundle", str(tiny_bundle("export")), "--prompt-ids", "5,6,7", "--max-tokens", "4", "--json")
    greedy = json.loads(run(*args).stdout)["results"][0]["token_ids"]
    out = run(*args, "--temperature", "1e-300", "--top-p", "1e-300")
    assert out.returncode == 0 and json.loads(out.stdout)["results"][0]["token_ids"] == greedy, out.stderr


def test_prompts_are_checked_before_the_bundle_loads(tiny_bundle, tmp_path):
    """Wrong ids, other scripts' digits and invalid UTF-8 are refused with the bundle's manifest
    alone: its weights are not even read (here they are garbage)."""
    import shutil

    bundle = tmp_path / "bundle"
    shutil.copytree(tiny_bundle("export"), bundle)
    (bundle / "weights" / "rank-0.safetensors").write_bytes(b"garbage")
    out = run("--bundle", str(bundle), "--prompt-ids", "5,6,320")
    assert out.returncode == 1 and "token id 320 is outside the model's vocabulary [0, 320)" in out.stderr, out.stderr
    out = run("--bundle", str(bundle), "--prompt-ids", "\u0661,\u0662")
    assert out.returncode == 2 and "give comma-separated token ids" in out.stderr
    out = subprocess.run([sys.executable, "-m", "deepinfer.runtime.cli", "--bundle", str(bundle), "--prompt", b"\xff\xfe"],
                         capture_output=True, timeout=300)
    assert out.returncode == 2 and b"is not valid UTF-8 text" in out.stderr and b"Traceback" not in out.stderr
